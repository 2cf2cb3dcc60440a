"""Priority classes on the queue (tokq/queue/priority.py, claim_rule.py): interactive work first,
batch work in the room it leaves, the batch lane never starved (its share once its head waited
batch_starve_ms), a deep batch backlog never holding an interactive item past the next claim,
each class under its own token cap, redone batch items back in the batch lane, poison batch items
isolated, cancelled batch requests leaving nothing. On a real Redis, standalone and cluster."""

from __future__ import annotations

import random

import pytest
from queue_support import NOTICE_CHANNEL, ManualClock, all_keys, items, keys_left, ok_result, open_queue

from tokq.queue import PRIORITIES
from tokq.queue.claim_rule import batch_share_tokens, isolate_attempt_for, plan_claim
from tokq.queue.shard import QueueFull
from tokq.queue.sharded import ShardedQueue
from tokq.queue.wire import format_entry, parse_entry

pytestmark = pytest.mark.redis_kinds("standalone", "cluster")

MINUTE_MS = 60_000


def _lanes(claim) -> list[str]:
    """Each claimed entry's lane by position: light, then heavy, then batch ones."""
    num_light = len(claim.entries) - claim.num_heavy - claim.num_batch
    return ["light"] * num_light + ["heavy"] * claim.num_heavy + ["batch"] * claim.num_batch


def test_the_classes_are_interactive_and_batch():
    assert PRIORITIES == ("interactive", "batch")


async def test_an_unknown_priority_is_refused_and_queues_nothing(redis_url):
    async with open_queue(redis_url, ManualClock()) as q:
        sharded = ShardedQueue.of(q)
        with pytest.raises(ValueError, match="priority"):
            await sharded.producer.enqueue("r1", items(3), timeout_ms=MINUTE_MS, gateway_id="gw",
                                           priority="urgent")
        with pytest.raises(ValueError, match="priority"):
            await q.enqueue("r2", items(3), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="BATCH")
        assert sharded.producer.shard_of_request("r1") is None
        assert await all_keys(q) == set()


async def test_each_class_goes_to_its_lanes(redis_url):
    async with open_queue(redis_url, ManualClock()) as q:
        sharded = ShardedQueue(q.redis, q.keys.queue, q.config, rng=random.Random(1))
        await sharded.producer.enqueue("i", items(3), timeout_ms=MINUTE_MS, gateway_id="gw")
        await sharded.producer.enqueue("i-heavy", items(200), timeout_ms=MINUTE_MS, gateway_id="gw",
                                       priority="interactive")
        await sharded.producer.enqueue("b", items(3, 200), timeout_ms=MINUTE_MS, gateway_id="gw",
                                       priority="batch")
        stats = await q.stats()
        assert stats.lanes == {"light": (1, 3), "heavy": (1, 200), "batch": (2, 203)}
        assert stats.queued_tokens == 406
        batch = [parse_entry(raw) for raw in await q.redis.lrange(q.keys.batch, 0, -1)]
        assert [(e.request_id, e.num_tokens) for e in batch] == [("b", 3), ("b", 200)]
        await sharded.close()


async def test_interactive_work_first_and_batch_work_fills_the_room_left(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lookahead=2) as q:
        await q.enqueue("b", items(40, 30, 20, 10), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="batch")
        clock.advance(5)
        await q.enqueue("i", items(25, 25), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL)
        await q.enqueue("h", items(150), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL)
        # Interactive first by the usual rule (light 50, heavy 150), although the batch work is
        # older; batch work fills the 40 left.
        claim = await q.claim(240)
        assert [(e.request_id, e.num_tokens) for e in claim.entries] == [
            ("i", 25), ("i", 25), ("h", 150), ("b", 40)]
        assert _lanes(claim) == ["light", "light", "heavy", "batch"] and claim.stop == "full"
        # No interactive work: batch work gets the whole budget, in order.
        claim = await q.claim(240)
        assert [e.num_tokens for e in claim.entries] == [30, 20, 10] and claim.num_batch == 3
        assert (await q.stats()).queued_entries == 0


async def test_batch_work_passed_over_keeps_its_place_and_an_oversized_head_goes_alone(redis_url):
    async with open_queue(redis_url, ManualClock(), lookahead=2) as q:
        await q.enqueue("b", items(300, 50, 10), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="batch")
        await q.enqueue("i", items(30), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(100)  # interactive 30; batch 300 passed over, 50 and 10 fit
        assert [e.num_tokens for e in claim.entries] == [30, 50, 10]
        assert claim.num_batch == 2
        claim = await q.claim(100)  # nothing else queued: the batch head goes past the budget
        assert [e.num_tokens for e in claim.entries] == [300]


async def test_a_starving_batch_lane_gets_its_share_of_every_claim(redis_url):
    clock = ManualClock()
    # QueueConfig's defaults, as the README states them: a quarter of each batch after a second
    async with open_queue(redis_url, clock) as q:
        await q.enqueue("b", items(*[10] * 100), timeout_ms=10 * MINUTE_MS, notice_channel=NOTICE_CHANNEL,
                        priority="batch")
        for n in range(30):  # light work that fills every budget on its own
            await q.enqueue(f"i{n}", items(*[20] * 6), timeout_ms=10 * MINUTE_MS, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(200)  # the batch head is young: interactive work alone
        assert claim.num_batch == 0 and claim.num_tokens == 200
        clock.advance(999)
        assert (await q.claim(200)).num_batch == 0
        clock.advance(1)  # the batch head has waited batch_starve_ms: a quarter of each budget
        for _ in range(3):
            claim = await q.claim(200)
            # interactive work within the 150 left (7 items of 20), batch work in the rest
            assert _lanes(claim) == ["light"] * 7 + ["batch"] * 6 and claim.num_tokens == 200
            assert [e.request_id for e in claim.entries[7:]] == ["b"] * 6


def _entry(tokens, request_id, index, *, age_ms=0, now_ms=1_700_000_000_000, attempt=0):
    return parse_entry(format_entry(tokens, now_ms - age_ms, request_id, index, now_ms + MINUTE_MS,
                                    attempt, b"x"))


def test_the_batch_head_never_waits_past_the_starvation_age_and_the_next_claim():
    """Interactive arrivals that more than fill every budget, beside batch work arriving one entry
    a claim: every batch entry is claimed; none waits past batch_starve_ms by a claim's
    interval or more; while starving, the batch head goes in every claim and batch work past it
    holds at most its share."""
    now, step_ms, starve_ms, budget = 1_700_000_000_000, 40, 500, 600
    share = batch_share_tokens(budget, 0.25)
    light, heavy, batch, served = [], [], [], []
    for n in range(400):
        light += [_entry(50, "i", n * 8 + k, now_ms=now) for k in range(8)]  # 400 a claim
        heavy += [_entry(300, "h", n, now_ms=now)]  # and 300 more
        if n < 300:
            batch += [_entry(30 + (n % 5) * 20, "b", n, now_ms=now)]
        plan = plan_claim(light, heavy, batch, now_ms=now, token_budget=budget, lookahead=2,
                          max_skip_age_ms=50, max_drop=100, isolate_attempt=2, is_live=lambda r: True,
                          batch_share_tokens=share, batch_starve_ms=starve_ms)
        taken_batch = plan.taken[len(plan.taken) - plan.num_batch:]
        if batch:
            waited = now - batch[0].ts_ms
            assert waited < starve_ms + step_ms, f"claim {n}: the batch head waited {waited} ms"
            if waited >= starve_ms:
                assert taken_batch and taken_batch[0] == batch[0]
                assert sum(e.num_tokens for e in taken_batch[1:]) <= share
        served += taken_batch
        light, heavy = plan.remaining(light), plan.remaining_heavy(heavy)
        batch = plan.remaining_batch(batch)
        now += step_ms
    assert sorted(e.index for e in served) == list(range(300))  # all of it, each once


async def test_a_deep_batch_backlog_never_delays_interactive_work_past_the_next_claim(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, batch_starve_ms=1_000, max_queued_batch_tokens=10**9) as q:
        for r in range(10):
            await q.enqueue(f"b{r}", items(*[50] * 1_000), timeout_ms=10 * MINUTE_MS, notice_channel=NOTICE_CHANNEL,
                            priority="batch")
        for starving in (False, True):
            if starving:
                clock.advance(1_000)
            await q.enqueue(f"light-{starving}", items(5), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL)
            await q.enqueue(f"heavy-{starving}", items(300, 100), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL)
            claim = await q.claim(600)
            # Every interactive item in this claim (its 405 tokens fit the 450 a starving batch
            # lane leaves); batch work after it, within the budget.
            assert [e.request_id for e in claim.entries[:3]] == [
                f"light-{starving}", f"heavy-{starving}", f"heavy-{starving}"]
            assert _lanes(claim)[3:] == ["batch"] * claim.num_batch and claim.num_batch >= 1
            assert claim.num_tokens <= 600
        stats = await q.stats()
        assert stats.lanes["light"] == stats.lanes["heavy"] == (0, 0)


async def test_light_only_claims_never_read_batch_work(redis_url):
    async with open_queue(redis_url, ManualClock(), batch_starve_ms=0) as q:
        await q.enqueue("b", items(5), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="batch")
        assert await q.claim(128, lanes="light") is None
        await q.enqueue("i", items(5), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL)
        claim = await q.claim(128, lanes="light")
        assert [e.request_id for e in claim.entries] == ["i"] and claim.stop == "preempt"


async def test_a_batch_backlog_at_its_cap_never_refuses_interactive_work(redis_url):
    async with open_queue(redis_url, ManualClock(), max_queued_tokens=1_000,
                          max_queued_batch_tokens=500) as q:
        for r in range(5):
            await q.enqueue(f"b{r}", items(100), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="batch")
        with pytest.raises(QueueFull) as full:
            await q.enqueue("b-over", items(1), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="batch")
        assert (full.value.queued_tokens, full.value.max_queued_tokens, full.value.priority) == (
            500, 500, "batch")
        # Interactive work has its own cap: the full batch class counts nothing against it.
        await q.enqueue("i", items(600, 400), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL)
        with pytest.raises(QueueFull) as full:
            await q.enqueue("i-over", items(1), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL)
        assert (full.value.queued_tokens, full.value.priority) == (1_000, "interactive")
        stats = await q.stats()
        assert stats.queued_tokens == 1_500 and stats.counters["rejected"] == 2
        assert stats.lanes["batch"] == (5, 500)
        # Claimed batch work makes room for batch work again.
        claim = await q.claim(1_200)
        assert claim.num_batch == 2
        await q.enqueue("b-later", items(200), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="batch")


async def test_an_empty_batch_class_takes_one_request_over_its_cap(redis_url):
    async with open_queue(redis_url, ManualClock(), max_queued_tokens=10,
                          max_queued_batch_tokens=10) as q:
        await q.enqueue("i", items(50), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL)
        await q.enqueue("b", items(50), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="batch")
        with pytest.raises(QueueFull):
            await q.enqueue("b2", items(1), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="batch")


async def test_a_crashed_worker_s_batch_items_are_redone_in_the_batch_lane(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000) as q:
        await q.enqueue("b", items(10, 10), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="batch")
        await q.enqueue("i", items(300), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL)
        crashed = await q.claim(600)
        assert _lanes(crashed) == ["heavy", "batch", "batch"]
        assert await q.redis.hget(q.keys.lease_batch_counts, crashed.batch_id) == b"2"
        clock.advance(1_000)
        assert await q.requeue_expired() == (3, 0)
        assert not await q.redis.exists(q.keys.lease_batch_counts)
        # Each item back in its own class's lane, at the front, attempt 1.
        heavy = [parse_entry(r) for r in await q.redis.lrange(q.keys.heavy, 0, -1)]
        batch = [parse_entry(r) for r in await q.redis.lrange(q.keys.batch, 0, -1)]
        assert [(e.request_id, e.index, e.attempt) for e in heavy] == [("i", 0, 1)]
        assert [(e.request_id, e.index, e.attempt) for e in batch] == [("b", 0, 1), ("b", 1, 1)]
        stats = await q.stats()
        assert stats.lanes["batch"] == (2, 20) and stats.queued_tokens == 320
        redo = await q.claim(600)
        assert _lanes(redo) == ["heavy", "batch", "batch"]
        await q.ack(redo.batch_id, [(e, ok_result(e)) for e in redo.entries])
        assert not await q.redis.exists(q.keys.lease_batch_counts)
        assert sorted(await q.collect("b")) == [0, 1] and sorted(await q.collect("i")) == [0]
        assert await keys_left(q) == set()


async def test_a_poison_batch_item_is_isolated_and_stopped(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000, max_attempts=3, batch_starve_ms=1_000) as q:
        await q.enqueue("b", items(5, 5), timeout_ms=10 * MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="batch")
        batches = []
        for n in range(3):  # a worker crashes on every batch holding item b:0
            await q.enqueue(f"i{n}", items(5), timeout_ms=10 * MINUTE_MS, notice_channel=NOTICE_CHANNEL)
            claim = await q.claim(600)
            batches.append([(e.request_id, e.attempt) for e in claim.entries])
            assert any(e.request_id == "b" and e.index == 0 for e in claim.entries)
            clock.advance(1_000)
            await q.requeue_expired()
        # Redone once: in a full batch again, each item in its class's lanes (a redone
        # interactive item in the heavy lane); twice: alone, first (its head is starving),
        # interactive work waiting one claim.
        assert batches[0] == [("i0", 0), ("b", 0), ("b", 0)]
        assert batches[1] == [("i1", 0), ("i0", 1), ("b", 1), ("b", 1)]
        assert batches[2] == [("b", 2)]
        assert (await q.redis.hget(q.keys.reply("b"), "0")).startswith(b"-INTERNAL:item failed 3 times")
        assert isolate_attempt_for(3) == 2
        # b:1, redone twice with it, goes alone too; then interactive work, in full batches.
        claim = await q.claim(600)
        assert [(e.request_id, e.index, e.attempt) for e in claim.entries] == [("b", 1, 2)]
        claim = await q.claim(600)
        assert [(e.request_id, e.attempt) for e in claim.entries] == [("i2", 0), ("i1", 1)]
        assert claim.stop == "isolated"  # i0, redone twice, goes alone next


async def test_a_cancelled_batch_request_leaves_nothing_in_redis(redis_url):
    clock = ManualClock()
    async with open_queue(redis_url, clock, lease_ms=1_000) as q:
        await q.enqueue("b", items(5, 5, 5), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="batch")
        await q.enqueue("b2", items(5), timeout_ms=MINUTE_MS, notice_channel=NOTICE_CHANNEL, priority="batch")
        claim = await q.claim(10)  # two of b's items leased
        assert await q.cancel("b") and await q.cancel("b2")
        await q.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])  # answers nothing
        assert await q.claim(100) is None  # the queued ones dropped as orphans
        stats = await q.stats()
        assert stats.queued_tokens == 0 and stats.lanes["batch"] == (0, 0)
        assert stats.counters["orphaned"] == 2
        assert await keys_left(q) == set()


async def test_producer_enqueue_takes_each_class(redis_url):
    async with open_queue(redis_url, ManualClock()) as q:
        sharded = ShardedQueue(q.redis, q.keys.queue, q.config, rng=random.Random(1))
        for i, priority in enumerate(PRIORITIES):
            await sharded.producer.enqueue(f"r{i}", items(3), timeout_ms=MINUTE_MS, gateway_id="gw",
                                           priority=priority)
        await sharded.producer.enqueue("r-default", items(3), timeout_ms=MINUTE_MS, gateway_id="gw")
        assert (await q.stats()).lanes == {"light": (2, 6), "heavy": (0, 0), "batch": (1, 3)}
        await sharded.close()
