"""claim.lua and the Python reference (tokq/queue/claim_rule.py) agree on random queues of three
lanes (light, heavy and batch), redone entries (attempt > 0) included, batch heads on both sides
of the starvation age; then the rule's promises: FIFO within a lane, light requests never
starved by heavy ones, heavy ones never by light (tests/queue/test_claims_by_priority_class.py: the
batch class's)."""

from __future__ import annotations

import asyncio
import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from queue_support import NOTICE_CHANNEL, ManualClock, open_queue

from tokq.queue.claim_rule import (DEADLINE_EXCEEDED, STOP_REASONS, batch_share_tokens,
                                   is_bulk_batch, isolate_attempt_for, plan_claim, preempt_budget)
from tokq.queue.wire import format_entry, parse_entry

NOW_MS = 1_700_000_000_000
REQUEST_IDS = ("a", "b", "c", "d")
# Random cases per property test; raise it for a longer search (TOKQ_CLAIM_RULE_EXAMPLES=3000).
EXAMPLES = int(os.environ.get("TOKQ_CLAIM_RULE_EXAMPLES", "300"))


def _pending(spec, next_index=None) -> list:
    """Entries from (request_id, tokens, age_ms, deadline_in_ms, body[, attempt]) tuples,
    indexed per request."""
    next_index = dict.fromkeys(REQUEST_IDS, 0) if next_index is None else next_index
    pending = []
    for request_id, tokens, age_ms, deadline_in_ms, body, *attempt in spec:
        raw = format_entry(tokens, NOW_MS - age_ms, request_id, next_index[request_id],
                           NOW_MS + deadline_in_ms, attempt[0] if attempt else 0, body)
        next_index[request_id] += 1
        pending.append(parse_entry(raw))
    return pending


def _case(spec, *, heavy=(), batch=(), token_budget=100, lookahead=2, max_skip_age_ms=50, max_drop=8,
          live="abc", max_attempts=3, lanes="both", preempt_tokens=0, batch_share=0.25,
          batch_starve_ms=100, after_isolated=False, bulk_forward=False):
    next_index = dict.fromkeys(REQUEST_IDS, 0)
    return dict(pending=_pending(spec, next_index), heavy=_pending(heavy, next_index),
                batch=_pending(batch, next_index),
                live=set(live), token_budget=token_budget, lookahead=lookahead,
                max_skip_age_ms=max_skip_age_ms, max_drop=max_drop, max_attempts=max_attempts,
                lanes=lanes, preempt_tokens=preempt_tokens, batch_share=batch_share,
                batch_starve_ms=batch_starve_ms, after_isolated=after_isolated,
                bulk_forward=bulk_forward)


@st.composite
def claim_cases(draw):
    """A random queue and claim arguments, drawn so that the rule's boundaries come up often:
    items that exactly fill the budget, items exactly max_skip_age_ms old, deadlines exactly now."""
    token_budget = draw(st.integers(1, 300))
    max_skip_age_ms = draw(st.sampled_from((0, 10, 50, 50)))
    half = token_budget // 2 + 1  # two of these never fit together
    sizes = st.one_of(st.sampled_from((token_budget, half, max(token_budget // 3, 1), max(token_budget // 4, 1))),
                      st.integers(1, half), st.integers(1, 2 * token_budget))
    ages_ms = st.sampled_from((0, max(max_skip_age_ms - 1, 0), max_skip_age_ms,
                               max_skip_age_ms + 1))
    deadlines_in_ms = st.sampled_from((-1, 0, 1, 500, 500, 500, 500, 500, 500, 500))
    # Mostly first tries; redone ones on both sides of the isolation threshold.
    attempts = st.sampled_from((0, 0, 0, 0, 1, 1, 2, 3, 4))
    entries = st.tuples(st.sampled_from(REQUEST_IDS), sizes, ages_ms, deadlines_in_ms,
                        st.binary(max_size=6), attempts)  # a body may hold ':'
    spec = draw(st.lists(entries, min_size=0, max_size=30))
    heavy = draw(st.lists(entries, min_size=0, max_size=30))
    # Batch-class entries: heads younger and older than the starvation age, at its boundary.
    batch_starve_ms = draw(st.sampled_from((0, 20, 100)))
    batch_ages_ms = st.sampled_from((0, max(batch_starve_ms - 1, 0), batch_starve_ms,
                                     batch_starve_ms + 1, 10_000))
    batch_entries = st.tuples(st.sampled_from(REQUEST_IDS), sizes, batch_ages_ms, deadlines_in_ms,
                              st.binary(max_size=6), attempts)
    batch = draw(st.one_of(st.just([]), st.lists(batch_entries, min_size=1, max_size=30)))
    return _case(spec, heavy=heavy, batch=batch, token_budget=token_budget,
                 lookahead=draw(st.integers(0, 3)),
                 max_skip_age_ms=max_skip_age_ms, max_drop=draw(st.integers(1, 8)),
                 live=draw(st.sets(st.sampled_from(REQUEST_IDS), min_size=3)),
                 max_attempts=draw(st.sampled_from((2, 3, 5))),
                 lanes=draw(st.sampled_from(("both", "both", "light", "heavy"))),
                 preempt_tokens=draw(st.sampled_from((0, 1, half, token_budget, 2 * token_budget))),
                 batch_share=draw(st.sampled_from((0.0, 0.1, 0.25, 0.5, 1.0))),
                 batch_starve_ms=batch_starve_ms, after_isolated=draw(st.booleans()),
                 bulk_forward=draw(st.booleans()))


async def _compare(redis_url, pending, heavy, live, token_budget, lookahead, max_skip_age_ms, max_drop,
                   max_attempts, lanes, preempt_tokens, batch=(), batch_share=0.25, batch_starve_ms=100,
                   after_isolated=False, bulk_forward=False):
    """Run claim.lua once on the lanes and check everything it did against plan_claim."""
    async with open_queue(redis_url, ManualClock(NOW_MS), lease_ms=1_000,
                          max_skip_age_ms=max_skip_age_ms, max_attempts=max_attempts,
                          batch_share=batch_share, batch_starve_ms=batch_starve_ms) as q:
        k = q.keys
        await q.redis.flushdb()
        for request_id in live:
            await q.redis.hset(k.reply(request_id), mapping={"n": 99, "ch": NOTICE_CHANNEL})
        for lane, entries in ((k.pending, pending), (k.heavy, heavy), (k.batch, batch)):
            if entries:
                await q.redis.rpush(lane, *[e.raw for e in entries])
        if pending or heavy or batch:
            await q.redis.set(k.tokens, sum(e.num_tokens for e in [*pending, *heavy, *batch]))
        if batch:
            await q.redis.set(k.batch_tokens, sum(e.num_tokens for e in batch))

        claim, num_expired, num_orphaned, stop = await q.claim_step(
            token_budget, lookahead=lookahead, max_drop=max_drop, lanes=lanes,
            preempt_tokens=preempt_tokens, after_isolated=after_isolated, bulk_forward=bulk_forward)
        plan = plan_claim(pending, heavy, batch, now_ms=NOW_MS, token_budget=token_budget,
                          lookahead=lookahead, max_skip_age_ms=max_skip_age_ms, max_drop=max_drop,
                          isolate_attempt=isolate_attempt_for(max_attempts),
                          is_live=live.__contains__, lanes=lanes, preempt_tokens=preempt_tokens,
                          batch_share_tokens=batch_share_tokens(token_budget, batch_share),
                          batch_starve_ms=batch_starve_ms, after_isolated=after_isolated,
                          bulk_forward=bulk_forward)

        taken = [e.raw for e in claim.entries] if claim else []
        assert taken == [e.raw for e in plan.taken]
        assert stop == plan.stop and stop in STOP_REASONS
        if claim:
            assert claim.num_heavy == plan.num_heavy and claim.stop == plan.stop
            assert claim.num_batch == plan.num_batch
            # the lease's batch-class count, for a redo to put them back in the batch lane
            assert await q.redis.hget(k.lease_batch_counts, claim.batch_id) == (
                str(plan.num_batch).encode() if plan.num_batch else None)
        remaining, remaining_heavy = plan.remaining(pending), plan.remaining_heavy(heavy)
        remaining_batch = plan.remaining_batch(batch)
        assert await q.redis.lrange(k.pending, 0, -1) == [e.raw for e in remaining]
        assert await q.redis.lrange(k.heavy, 0, -1) == [e.raw for e in remaining_heavy]
        assert await q.redis.lrange(k.batch, 0, -1) == [e.raw for e in remaining_batch]
        assert int(await q.redis.get(k.tokens) or 0) == sum(
            e.num_tokens for e in [*remaining, *remaining_heavy, *remaining_batch])
        assert int(await q.redis.get(k.batch_tokens) or 0) == sum(e.num_tokens for e in remaining_batch)
        assert (num_expired, num_orphaned) == (len(plan.expired), len(plan.orphaned))
        for request_id in REQUEST_IDS:
            answered = await q.redis.hgetall(k.reply(request_id))
            if request_id not in live:
                assert answered == {}  # never resurrected
                continue
            expected = {str(e.index).encode(): DEADLINE_EXCEEDED
                        for e in plan.expired if e.request_id == request_id}
            assert {f: v for f, v in answered.items() if f not in (b"n", b"ch")} == expected
        if claim:
            assert await q.redis.lrange(k.lease(claim.batch_id), 0, -1) == taken
            assert await q.redis.zscore(k.leases, claim.batch_id) == NOW_MS + 1_000
            assert int(await q.redis.get(k.inflight)) == len(taken)
        else:
            assert not await q.redis.exists(k.leases, k.inflight)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=claim_cases())
# Each boundary of the rule, always checked (random cases reach them only now and then).
@example(case=_case([("a", 60, 0, 500, b""), ("a", 60, 50, 500, b""), ("a", 40, 0, 500, b"")]))
@example(case=_case([("a", 60, 0, 500, b""), ("a", 60, 0, 500, b""), ("a", 60, 0, 500, b""),
                     ("a", 40, 0, 500, b"")], lookahead=1))
@example(case=_case([("a", 60, 0, 500, b""), ("a", 60, 0, 500, b""), ("a", 40, 0, 500, b"")],
                    lookahead=0))
@example(case=_case([("a", 50, 0, 500, b""), ("a", 50, 0, 500, b":"), ("a", 10, 0, 0, b"")]))
@example(case=_case([("a", 10, 0, 0, b""), ("d", 10, 0, 500, b""), ("b", 10, 0, 1, b"")],
                    max_drop=2))
@example(case=_case([("d", 10, 0, 500, b""), ("d", 10, 0, 500, b"")], max_drop=1))
# Redone once: batched as usual; redone twice (or on its last try): alone, and it ends a batch.
@example(case=_case([("a", 10, 0, 500, b"", 1), ("b", 10, 0, 500, b"", 0), ("a", 10, 0, 500, b"", 1)]))
@example(case=_case([("a", 10, 0, 500, b"", 0), ("b", 10, 0, 500, b"", 2), ("a", 10, 0, 500, b"", 0)]))
@example(case=_case([("a", 10, 0, 500, b"", 2), ("b", 10, 0, 500, b"", 0)]))
@example(case=_case([("a", 10, 0, 500, b"", 1), ("b", 10, 0, 500, b"", 0)], max_attempts=2))
# Two lanes: the light share (half, or what the heavy head leaves), each lane's first item over
# its share, an isolated redo heading the heavy lane, max_drop reached in the light lane.
@example(case=_case([("a", 30, 0, 500, b"")] * 3, heavy=[("b", 40, 0, 500, b"")] * 3))
@example(case=_case([("a", 30, 0, 500, b"")] * 3, heavy=[("b", 90, 0, 500, b"")]))
@example(case=_case([("a", 120, 0, 500, b"")], heavy=[("b", 150, 0, 500, b"")]))
@example(case=_case([("a", 10, 0, 500, b"")], heavy=[("b", 10, 0, 500, b"", 2), ("b", 10, 0, 500, b"")]))
@example(case=_case([("a", 10, 0, 500, b"")], heavy=[("b", 10, 0, -1, b"", 2), ("b", 10, 0, 500, b"", 2)]))
@example(case=_case([("d", 10, 0, 500, b""), ("a", 10, 0, 500, b"")],
                    heavy=[("b", 10, 0, 500, b"")], max_drop=1))
# Room the heavy lane leaves goes back to the light lane, entries passed over first; a lane's
# end after passing entries over.
@example(case=_case([("a", 60, 0, 500, b""), ("a", 40, 0, 500, b""), ("a", 30, 0, 500, b""),
                     ("a", 10, 0, 500, b"")], heavy=[("b", 30, 0, 500, b"")]))
@example(case=_case([("a", 30, 0, 500, b""), ("a", 30, 0, 500, b""), ("a", 5, 0, 500, b"")],
                    heavy=[("b", 20, 0, 500, b"")]))
# Light-only (pre-empting) claims: the whole light lane when it fits the budget, else nothing
# (a backlog); the heavy lane untouched even when its head is an isolated redo or expired.
@example(case=_case([("a", 30, 0, 500, b"")] * 4, heavy=[("b", 40, 0, 500, b"")] * 3, lanes="light"))
@example(case=_case([("a", 30, 0, 500, b"")] * 3, heavy=[("b", 40, 0, 500, b"")] * 3, lanes="light"))
@example(case=_case([("a", 10, 0, 500, b"")], heavy=[("b", 10, 0, -1, b"", 2)], lanes="light"))
@example(case=_case([], heavy=[("b", 10, 0, 500, b"")], lanes="light"))
# Heavy-only (the next batch of a worker in a heavy forward): the light lane untouched while it
# holds at most preempt_tokens; past that, light first with all of the budget, then heavy work
# that fits (its head not always).
@example(case=_case([("a", 30, 0, 500, b"")] * 4, heavy=[("b", 40, 0, 500, b"")] * 3, lanes="heavy"))
@example(case=_case([("a", 30, 0, 500, b"")] * 4, heavy=[("b", 40, 0, 500, b"")] * 3, lanes="heavy",
                    preempt_tokens=120))
@example(case=_case([("a", 30, 0, 500, b"")] * 4, heavy=[("b", 40, 0, 500, b"")] * 3, lanes="heavy",
                    preempt_tokens=119))
@example(case=_case([("a", 30, 0, 500, b"")] * 2, heavy=[("b", 60, 60, 500, b""), ("b", 10, 0, 500, b"")],
                    lanes="heavy", preempt_tokens=50))
@example(case=_case([("a", 10, 0, 500, b"")], heavy=[], lanes="heavy"))
# Batch lane: it fills the room interactive work leaves (its head only when it fits, unless
# nothing else was taken); starving (its head waited batch_starve_ms), its share first and its
# head always; a starving redo to isolate alone, unless the heavy head is one too; entries passed
# over at any age; a light-only claim never reads it; a heavy claim reads it after the heavy lane.
@example(case=_case([("a", 30, 0, 500, b"")] * 2, batch=[("b", 30, 0, 500, b"")] * 3))
@example(case=_case([("a", 30, 0, 500, b"")] * 2, batch=[("b", 50, 0, 500, b""), ("b", 40, 0, 500, b"")]))
@example(case=_case([], batch=[("b", 150, 0, 500, b""), ("b", 10, 0, 500, b"")]))
@example(case=_case([("a", 30, 0, 500, b"")] * 4, batch=[("b", 50, 100, 500, b""), ("b", 20, 0, 500, b"")]))
@example(case=_case([("a", 30, 0, 500, b"")] * 4, heavy=[("c", 90, 0, 500, b"")],
                    batch=[("b", 150, 100, 500, b"")], batch_share=0.0))
@example(case=_case([("a", 30, 0, 500, b"")] * 4, batch=[("b", 20, 99, 500, b"")] * 3, batch_share=0.5))
@example(case=_case([("a", 30, 0, 500, b"")], batch=[("b", 20, 100, 500, b"", 2), ("b", 20, 0, 500, b"")]))
@example(case=_case([("a", 30, 0, 500, b"")], heavy=[("c", 20, 0, 500, b"", 2)],
                    batch=[("b", 20, 100, 500, b"", 2)]))
@example(case=_case([("a", 30, 0, 500, b"")], batch=[("b", 20, 0, 500, b"", 2), ("b", 20, 0, 500, b"")]))
@example(case=_case([("a", 50, 0, 500, b"")], batch=[("b", 60, 900, 500, b""), ("b", 70, 900, 500, b""),
                                                     ("b", 40, 900, 500, b""), ("b", 10, 900, 500, b"")]))
@example(case=_case([("a", 30, 0, 500, b"")], batch=[("b", 20, 500, 500, b"")], lanes="light"))
@example(case=_case([("a", 30, 0, 500, b"")] * 2, heavy=[("c", 40, 0, 500, b"")],
                    batch=[("b", 20, 0, 500, b"")] * 2, lanes="heavy", preempt_tokens=100))
@example(case=_case([("a", 30, 0, 500, b"")] * 2, heavy=[("c", 40, 0, 500, b"")],
                    batch=[("b", 20, 100, 500, b"")] * 2, lanes="heavy", preempt_tokens=50))
@example(case=_case([], batch=[("d", 10, 100, 500, b""), ("b", 10, 0, -1, b""), ("b", 10, 0, 500, b"")],
                    max_drop=2))
# After a claim that took a redo to isolate: light work before an isolated heavy head (the redo
# ends the batch), with the refill pass after it; the redo alone when no light work is live; a
# starving batch redo to isolate waits too (ends the batch); a starving batch head that is not
# one still goes; a heavy claim's batch lane.
@example(case=_case([("a", 30, 0, 500, b"")] * 4, heavy=[("b", 10, 0, 500, b"", 2), ("b", 10, 0, 500, b"")],
                    after_isolated=True))
@example(case=_case([("a", 30, 0, 500, b"")] * 5, heavy=[("b", 60, 0, 500, b"", 2)], after_isolated=True))
@example(case=_case([("a", 30, 0, -1, b""), ("d", 30, 0, 500, b"")], heavy=[("b", 10, 0, 500, b"", 2)],
                    after_isolated=True))
@example(case=_case([("a", 30, 0, 500, b"")], batch=[("b", 20, 100, 500, b"", 2), ("b", 20, 0, 500, b"")],
                    after_isolated=True))
@example(case=_case([], batch=[("b", 20, 100, 500, b"", 2), ("b", 20, 0, 500, b"")], after_isolated=True))
@example(case=_case([("a", 30, 0, 500, b"")], heavy=[("c", 20, 0, 500, b"", 2)],
                    batch=[("b", 20, 100, 500, b"")], after_isolated=True))
@example(case=_case([("a", 30, 0, 500, b"")] * 2, heavy=[("c", 40, 0, 500, b"")],
                    batch=[("b", 20, 100, 500, b"", 2)] * 2, lanes="heavy", preempt_tokens=50,
                    after_isolated=True))
def test_lua_claim_agrees_with_the_python_rule(redis_server, case):
    asyncio.run(_compare(redis_server.url, **case))


@st.composite
def deep_lane_cases(draw):
    """A light lane of many small entries beside a short heavy lane, mostly "heavy" and "light"
    claims: the light lane's tokens cross preempt_tokens (or a light-only claim's budget) several
    16-entry windows in, dead entries sit deep in the lane (the refill pass reaches them), and
    redos to isolate head the heavy lane."""
    token_budget = draw(st.integers(8, 135))  # claim.lua reads 16 entries a window below 136
    unit = max(1, token_budget // 12)
    max_skip_age_ms = draw(st.sampled_from((0, 10, 50)))
    ages_ms = st.sampled_from((0, 0, max(max_skip_age_ms - 1, 0), max_skip_age_ms))
    deadlines_in_ms = st.sampled_from((-1, 0) + (500,) * 10)
    light_sizes = st.one_of(st.integers(1, 2 * unit), st.integers(1, token_budget // 2 + 1))
    light = draw(st.lists(st.tuples(st.sampled_from(REQUEST_IDS), light_sizes, ages_ms, deadlines_in_ms,
                                    st.just(b""), st.sampled_from((0,) * 12 + (1, 2))),
                          max_size=70))
    heavy_sizes = st.integers(max(1, token_budget // 3), 2 * token_budget)
    heavy = draw(st.lists(st.tuples(st.sampled_from(REQUEST_IDS), heavy_sizes, ages_ms, deadlines_in_ms,
                                    st.just(b""), st.sampled_from((0, 1, 2, 2, 3))),
                          max_size=8))
    lanes = draw(st.sampled_from(("heavy", "heavy", "light", "both")))
    light_total = sum(tokens for _, tokens, *_ in light)
    near_total = st.sampled_from((max(1, light_total), max(1, light_total - 1), light_total + 1))
    preempt_tokens = draw(st.one_of(near_total, st.sampled_from((0, 1, unit, token_budget))))
    if lanes == "light" and draw(st.booleans()):
        token_budget = draw(near_total)  # the whole lane just fits, or just does not
    # A deep batch lane behind them: its scans cross windows too.
    batch = draw(st.lists(st.tuples(st.sampled_from(REQUEST_IDS), light_sizes,
                                    st.sampled_from((0, 99, 100, 5_000)), deadlines_in_ms, st.just(b""),
                                    st.sampled_from((0,) * 12 + (1, 2))), max_size=50))
    return _case(light, heavy=heavy, batch=batch, token_budget=token_budget,
                 lookahead=draw(st.integers(0, 5)),
                 max_skip_age_ms=max_skip_age_ms, max_drop=draw(st.sampled_from((1, 3, 8, 30))),
                 live=draw(st.sets(st.sampled_from(REQUEST_IDS), min_size=3)),
                 max_attempts=draw(st.sampled_from((3, 5))), lanes=lanes, preempt_tokens=preempt_tokens,
                 batch_share=draw(st.sampled_from((0.0, 0.25, 1.0))), batch_starve_ms=100,
                 after_isolated=draw(st.booleans()), bulk_forward=draw(st.booleans()))


def _e(tokens, deadline_in_ms=500, *, request_id="a", attempt=0, age_ms=0):
    return (request_id, tokens, age_ms, deadline_in_ms, b"", attempt)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=deep_lane_cases())
# A heavy claim at the light lane's exact total (heavy lane alone) and one token under it (the
# light lane first), 40 entries in; a light-only claim whose budget is the lane's total, or one less.
@example(case=_case([_e(3)] * 40, heavy=[_e(60, request_id="b")] * 3, lanes="heavy", preempt_tokens=120))
@example(case=_case([_e(3)] * 40, heavy=[_e(60, request_id="b")] * 3, lanes="heavy", preempt_tokens=119))
@example(case=_case([_e(3)] * 40, heavy=[_e(60, request_id="b")], lanes="light", token_budget=120))
@example(case=_case([_e(3)] * 40, heavy=[_e(60, request_id="b")], lanes="light", token_budget=119))
# Nested in a batch-class forward: a light-only claim takes the head of a longer lane.
@example(case=_case([_e(3)] * 40, heavy=[_e(60, request_id="b")], lanes="light", token_budget=119,
                    bulk_forward=True))
@example(case=_case([_e(3)] * 40, lanes="light", token_budget=120, bulk_forward=True))
# A heavy claim beside a light backlog: a redo to isolate at the heavy head ends the batch and
# stays; with every light entry dead, the heavy head goes only when it fits.
@example(case=_case([_e(30)] * 5, heavy=[_e(60, request_id="b", attempt=2), _e(10, request_id="b")],
                    lanes="heavy", preempt_tokens=50))
@example(case=_case([_e(30, -1)] * 5, heavy=[_e(150, request_id="b"), _e(60, request_id="b")],
                    lanes="heavy", preempt_tokens=50, max_drop=30))
# The refill pass starting on a window boundary (index 16): the two entries passed over are
# passed over again, dead entries past them dropped, and smaller ones fill the budget.
@example(case=_case([_e(1, -1)] * 13 + [_e(45), _e(30), _e(30), _e(10), _e(1, -1), _e(1, -1), _e(1, -1),
                                         _e(5), _e(20)], heavy=[_e(40, request_id="b")], max_drop=30))
def test_lua_claim_agrees_with_the_python_rule_on_deep_lanes(redis_server, case):
    asyncio.run(_compare(redis_server.url, **case))


def test_the_refill_pass_passes_over_entries_again_and_keeps_their_order():
    dead = [parse_entry(format_entry(1, NOW_MS, "a", 100 + i, NOW_MS - 1, 0, b"x")) for i in range(3)]
    pending = _entries((45, 0), (30, 0), (30, 0), (10, 0)) + dead + _entries((5, 0), (20, 0))
    heavy = _entries((40, 0))
    plan = _plan(pending, heavy, token_budget=100, lookahead=2, max_drop=30)
    # Share 50: 45; both 30s passed over; 10 one too many. Heavy 40 (85); the refill passes the
    # 30s over again, takes 10, drops the dead three, and 5 fills the budget.
    assert [e.num_tokens for e in plan.taken] == [45, 10, 5, 40] and plan.stop == "full"
    assert [e.num_tokens for e in plan.remaining(pending)] == [30, 30, 20] and len(plan.expired) == 3
    assert plan.remaining(pending)[:2] == pending[1:3]  # in their order, at the head


def _entries(*spec):
    """(tokens, age_ms) pairs as live entries of request 'a'."""
    return [parse_entry(format_entry(t, NOW_MS - age, "a", i, NOW_MS + 10_000, 0, b"x"))
            for i, (t, age) in enumerate(spec)]


def _plan(pending, heavy=(), **overrides):
    rule = dict(now_ms=NOW_MS, token_budget=600, lookahead=2, max_skip_age_ms=50, max_drop=100,
                isolate_attempt=2, is_live=lambda request_id: True)
    return plan_claim(pending, heavy, **(rule | overrides))


def test_strict_fifo_stops_at_the_first_item_that_does_not_fit():
    plan = _plan(_entries((400, 0), (300, 0), (100, 0)), lookahead=0)
    assert [e.num_tokens for e in plan.taken] == [400]
    assert plan.num_scanned == 1


def test_lookahead_passes_over_a_bounded_number_of_items():
    pending = _entries((400, 0), (300, 0), (250, 0), (210, 0), (100, 0))
    plan = _plan(pending, lookahead=2)
    assert [e.num_tokens for e in plan.taken] == [400]
    assert [e.num_tokens for e in plan.remaining(pending)] == [300, 250, 210, 100]
    assert [e.num_tokens for e in _plan(pending, lookahead=3).taken] == [400, 100]


def test_an_item_older_than_the_skip_age_is_never_passed_over():
    pending = _entries((400, 60), (300, 60), (100, 0))
    assert [e.num_tokens for e in _plan(pending).taken] == [400]
    assert [e.num_tokens for e in _plan(pending, max_skip_age_ms=61).taken] == [400, 100]


def test_the_first_item_goes_even_when_longer_than_the_budget():
    plan = _plan(_entries((900, 0), (10, 0)))
    assert [e.num_tokens for e in plan.taken] == [900]


def test_redone_items_are_isolated_only_after_failing_twice_or_on_their_last_try():
    assert [isolate_attempt_for(n) for n in (1, 2, 3, 5, 10)] == [1, 1, 2, 2, 2]
    once = [parse_entry(format_entry(10, NOW_MS, "a", i, NOW_MS + 10_000, 1, b"x")) for i in range(3)]
    assert len(_plan(once).taken) == 3
    twice = [parse_entry(format_entry(10, NOW_MS, "a", i, NOW_MS + 10_000, 2, b"x")) for i in range(3)]
    assert len(_plan(twice).taken) == 1


def test_the_light_lane_goes_first_within_its_share_and_the_heavy_head_always_fits():
    light = _entries((50, 0), (50, 0), (50, 0), (50, 0), (50, 0), (50, 0), (50, 0), (50, 0))
    heavy = _entries((200, 0), (200, 0))
    plan = _plan(light, heavy, lookahead=0)
    # Light gets half of 600, the heavy lane what it can use, light the room left (not 200).
    assert [e.num_tokens for e in plan.taken] == [50] * 6 + [50] * 2 + [200]
    assert plan.num_heavy == 1 and plan.stop == "full"
    assert [e.num_tokens for e in plan.remaining_heavy(heavy)] == [200]
    big = _entries((500, 0), (500, 0))
    assert [e.num_tokens for e in _plan(light, big, lookahead=0).taken] == [50, 50, 500]
    # No heavy work: the light lane gets the whole budget.
    assert [e.num_tokens for e in _plan(light, [], lookahead=0).taken] == [50] * 8


def test_room_the_heavy_lane_leaves_goes_to_light_entries_passed_over_first():
    light = _entries((250, 0), (100, 0), (40, 0), (60, 0))
    heavy = _entries((150, 0))
    # Share 300: 250 and 40, 100 and 60 passed over (young); heavy 150; then 100 and 60 fill
    # the 600, the older first.
    plan = _plan(light, heavy, lookahead=2)
    assert [e.num_tokens for e in plan.taken] == [250, 40, 100, 60, 150]
    assert plan.remaining(light) == [] and plan.stop == "full"
    # Share 280: 250; 100 and 40 passed over; 60 one too many (lookahead 2). Heavy 150 (400);
    # then 100 and 40 (540); 60 no longer fits and waits at the head.
    plan = _plan(light, heavy, lookahead=2, token_budget=560)
    assert [e.num_tokens for e in plan.taken] == [250, 100, 40, 150]
    assert [e.num_tokens for e in plan.remaining(light)] == [60] and plan.num_heavy == 1


def test_each_lane_with_work_gets_an_item_per_batch_even_past_its_share():
    light = _entries((40, 0), (40, 0))
    oversized = _entries((900, 0), (900, 0))
    assert [e.num_tokens for e in _plan(light, oversized).taken] == [40, 900]


def test_a_light_only_claim_takes_the_whole_light_lane_or_nothing():
    light = _entries((50, 0), (50, 0))
    heavy = _entries((200, 0), (200, 0))
    plan = _plan(light, heavy, token_budget=128, lanes="light", lookahead=0)
    assert [e.num_tokens for e in plan.taken] == [50, 50]  # not half: the heavy lane waits
    assert plan.remaining_heavy(heavy) == heavy and plan.heavy_scanned == 0
    assert plan.stop == "preempt" and plan.num_heavy == 0
    # More than its budget is a backlog: left whole to full batches, not cut into nested ones.
    backlog = _entries((50, 0), (50, 0), (50, 0))
    plan = _plan(backlog, heavy, token_budget=128, lanes="light")
    assert plan.taken == () and plan.remaining(backlog) == backlog and plan.stop == "backlog"
    assert _plan([], heavy, lanes="light").taken == ()
    assert [preempt_budget(b, 128) for b in (64, 1024, 4096, 16384)] == [64, 128, 512, 2048]


def test_nested_in_a_batch_class_forward_a_light_only_claim_takes_what_fits():
    heavy = _entries((200, 0), (200, 0))
    backlog = _entries((50, 0), (50, 0), (50, 0), (20, 0))
    # Inside an interactive heavy forward the longer lane is a backlog, left to full batches.
    assert _plan(backlog, heavy, token_budget=128, lanes="light").stop == "backlog"
    # Inside a batch-class forward: its head, FIFO, as a usual scan (lookahead 0: the 20 waits).
    plan = _plan(backlog, heavy, token_budget=128, lanes="light", lookahead=0, bulk_forward=True)
    assert plan.taken == tuple(backlog[:2]) and plan.stop == "full"
    assert plan.remaining(backlog) == backlog[2:] and plan.remaining_heavy(heavy) == heavy
    # Passed over like a usual scan: the 20 behind the third 50 fills the budget.
    plan = _plan(backlog, heavy, token_budget=128, lanes="light", lookahead=1, bulk_forward=True)
    assert [e.num_tokens for e in plan.taken] == [50, 50, 20] and plan.remaining(backlog) == [backlog[2]]
    # A lane that fits goes whole, as in any forward; the batch lane is never read.
    plan = _plan(backlog[:2], heavy, batch=_entries((30, 0)), token_budget=128, lanes="light",
                 bulk_forward=True)
    assert plan.taken == tuple(backlog[:2]) and plan.stop == "preempt" and plan.num_batch == 0
    # The flag changes nothing outside light-only claims.
    both = _plan(backlog, heavy, token_budget=300)
    assert _plan(backlog, heavy, token_budget=300, bulk_forward=True) == both


def test_a_bulk_batch_has_more_batch_lane_tokens_than_heavy_lane_ones():
    assert is_bulk_batch([10, 500], num_heavy=0, num_batch=1)
    assert not is_bulk_batch([10, 500], num_heavy=1, num_batch=0)
    assert is_bulk_batch([10, 200, 300], num_heavy=1, num_batch=1)
    assert not is_bulk_batch([10, 300, 200], num_heavy=1, num_batch=1)
    assert not is_bulk_batch([10, 200, 200], num_heavy=1, num_batch=1)  # interactive heavy: backlog rule
    assert not is_bulk_batch([10, 20], num_heavy=-1, num_batch=-1)  # a repeat: counts unknown


def test_a_heavy_only_claim_leaves_a_short_light_lane_to_light_only_claims():
    light = _entries((50, 0), (50, 0))
    heavy = _entries((200, 0), (200, 0), (300, 0))
    plan = _plan(light, heavy, lanes="heavy", lookahead=0, preempt_tokens=128)
    assert [e.num_tokens for e in plan.taken] == [200, 200]  # the whole budget, no light share
    assert plan.remaining(light) == light and plan.num_scanned == 0 and plan.stop == "heavy_item"
    assert _plan(light, [], lanes="heavy", preempt_tokens=128).taken == ()
    assert _plan(light, heavy[:1], lanes="heavy", preempt_tokens=128).stop == "heavy_only"


def test_beside_a_light_backlog_a_heavy_claim_fills_the_budget_light_lane_first():
    light = _entries(*[(50, 0)] * 10)
    heavy = _entries((200, 0), (90, 0))
    # 500 light tokens > 128: the light lane first, all of the budget; heavy work that fits
    plan = _plan(light, heavy, lanes="heavy", lookahead=0, preempt_tokens=128)
    assert [e.num_tokens for e in plan.taken] == [50] * 10  # 500: the heavy head does not fit
    assert plan.remaining_heavy(heavy) == heavy and plan.stop == "heavy_item"
    plan = _plan(light[:8], heavy, lanes="heavy", lookahead=0, preempt_tokens=128)
    assert [e.num_tokens for e in plan.taken] == [50] * 8 + [200] and plan.num_heavy == 1
    assert plan.taken_tokens == 600 and plan.stop == "full"


def _drain(light, heavy, arrivals, *, token_budget=600, claims=300):
    """Run claims until both lanes are empty, appending ``arrivals(n)`` light entries after
    claim n; returns each claim's taken entries as (lane, index) pairs."""
    batches = []
    for n in range(claims):
        if not light and not heavy:
            break
        plan = _plan(light, heavy, token_budget=token_budget, lookahead=0)
        batches.append([("heavy" if e.num_tokens == token_budget else "light", e.index) for e in plan.taken])
        light, heavy = plan.remaining(light) + arrivals(n), plan.remaining_heavy(heavy)
    assert not light and not heavy, "not drained"
    return batches


def _numbered(n, tokens, start=0):
    return [parse_entry(format_entry(tokens, NOW_MS, "a", start + i, NOW_MS + 10_000, 0, b"x"))
            for i in range(n)]


def test_neither_lane_starves_the_other_and_each_stays_in_order():
    # Light requests arriving faster than the budget serves them, beside heavy requests of a
    # whole budget each: every claim serves both lanes while both hold work.
    batches = _drain(_numbered(30, 30), _numbered(20, 600),
                     lambda n: _numbered(30, 30, start=30 * (n + 1)) if n < 60 else [])
    assert all(("heavy", i) in batches[i] for i in range(20))  # one heavy request per claim
    assert all(any(lane == "light" for lane, _ in b) for b in batches)  # never a claim without
    heavy_order = [i for b in batches for lane, i in b if lane == "heavy"]
    light_order = [i for b in batches for lane, i in b if lane == "light"]
    assert heavy_order == list(range(20))
    assert light_order == list(range(30 * 61))  # FIFO among equals, all served
