"""Redos to isolate (attempt >= isolate_attempt) at the heavy lane's head beside light work, one
worker's claim sequence on the claim rule's reference (tokq/queue/claim_rule.py; claim.lua agrees:
tests/queue/test_claim_rule_lua_matches_python.py). The worker model is workers/loop.py's: a heavy batch
(``is_heavy_batch``) runs a light-only claim nested, and the claim after it is "heavy"; the full claim
after one that took a redo to isolate is ``after_isolated`` (light work before the isolated head)."""

from __future__ import annotations

import pytest

from tokq.queue.claim_rule import is_heavy_batch, plan_claim, preempt_budget
from tokq.queue.wire import Entry

BUDGET, LIGHT_TOKENS, ISOLATE = 448, 128, 2
NESTED = preempt_budget(BUDGET, LIGHT_TOKENS)
FAR_MS = 10**12


def _entry(name: str, tokens: int, attempt: int = 0) -> Entry:
    return Entry(b"", tokens, 0, name, 0, FAR_MS, attempt, b"")


def _light(n: int, tokens: int = 20, start: int = 0) -> list[Entry]:
    return [_entry(f"l{start + i}", tokens) for i in range(n)]


def _redos(n: int, tokens: int, start: int = 0) -> list[Entry]:
    return [_entry(f"r{start + i}", tokens, ISOLATE) for i in range(n)]


def _claims(light, heavy, *, claims: int, redo_each_claim=None):
    """The worker's claims, in order, as (light entries, redo entries, kind) per claim;
    ``redo_each_claim(n)``: entries put at the heavy lane's front after claim n (requeue.lua)."""
    rule = dict(now_ms=1_000, lookahead=4, max_skip_age_ms=50, max_drop=100,
                isolate_attempt=ISOLATE, is_live=lambda request_id: True, preempt_tokens=NESTED)
    out, lanes, after_isolated = [], "both", False
    for n in range(claims):
        if not light and not heavy:
            break
        nested = []
        if lanes == "heavy":  # inside the heavy forward: one light-only claim
            inner = plan_claim(light, heavy, **(rule | dict(token_budget=NESTED, lanes="light")))
            light, nested = inner.remaining(light), list(inner.taken)
        plan = plan_claim(light, heavy, **(rule | dict(token_budget=BUDGET, lanes=lanes,
                                                      after_isolated=after_isolated)))
        light, heavy = plan.remaining(light), plan.remaining_heavy(heavy)
        names = [e.request_id for e in plan.taken]
        out.append(([e for e in nested + list(plan.taken) if e.request_id.startswith("l")],
                    [e for e in plan.taken if e.attempt >= ISOLATE], lanes))
        assert len([x for x in names if x.startswith("r")]) <= 1  # a redo to isolate goes alone
        after_isolated = any(e.attempt >= ISOLATE for e in plan.taken)
        if after_isolated:
            assert len(plan.taken) == 1
        lanes = "heavy" if plan.taken and is_heavy_batch(
            [e.num_tokens for e in plan.taken], plan.num_heavy, NESTED) else "both"
        if redo_each_claim is not None:
            heavy = redo_each_claim(n) + heavy
    return out


def test_large_redos_beside_a_light_backlog_alternate_with_full_light_batches():
    """Each large redo goes alone and is a heavy batch; the light backlog is refused by the
    nested claim and goes first in the heavy claim after it: light work every other claim."""
    claims = _claims(_light(120), _redos(5, 400), claims=40)
    redo_claims = [n for n, (_, redos, _) in enumerate(claims) if redos]
    assert redo_claims == [0, 2, 4, 6, 8]
    for n in range(1, 10, 2):
        light, _, lanes = claims[n]
        assert lanes == "heavy" and sum(e.num_tokens for e in light) >= 0.9 * BUDGET


def test_a_short_light_lane_runs_nested_in_a_large_redo_s_forward():
    claims = _claims(_light(3), _redos(3, 400), claims=10)
    # The first redo (a heavy batch) nests the three light entries; the others follow alone.
    assert [len(light) for light, _, _ in claims] == [0, 3, 0]
    assert [len(redos) for _, redos, _ in claims] == [1, 1, 1]


def _alternate(claims, light_left):
    """While light work waits, no two claims in a row go without it: light work waits one claim
    at most. ``light_left(n)``: light work still queued before claim n."""
    for n in range(1, len(claims)):
        if light_left(n) and not claims[n][0]:
            assert claims[n - 1][0], f"claims {n - 1} and {n} both left light work waiting"


def test_small_redos_hold_light_work_back_one_claim_at_most():
    """Redos too small to be a heavy batch: each goes alone in a usual claim, which reads no
    light entry; the claim after it reads light work first. However many redos are queued ahead
    of it, light work waits one claim, and the redos go alone every other claim meanwhile."""
    for k in (1, 4, 12):
        claims = _claims(_light(60), _redos(k, 20), claims=2 * k + 3)
        assert claims[0][1] and not claims[0][0]
        assert claims[1][0] and not claims[1][1]  # a full light batch, the redo's turn next
        assert sum(e.num_tokens for e in claims[1][0]) >= 0.9 * BUDGET
        taken = [e.request_id for light, _, _ in claims for e in light]
        assert sorted(taken) == sorted(e.request_id for e in _light(60))  # all of it, once
        assert sum(len(redos) for _, redos, _ in claims) == k  # every redo went, alone
        light_until = max(n for n, (light, _, _) in enumerate(claims) if light)
        _alternate(claims, lambda n: n <= light_until)


def test_a_stream_of_small_redos_does_not_hold_light_work_back_unboundedly():
    """A redo to isolate arriving at the heavy lane's head after each claim (requeue.lua): light
    work and the redos alternate, each waiting one claim at most."""
    claims = _claims(_light(60), _redos(1, 20), claims=50,
                     redo_each_claim=lambda n: _redos(1, 20, start=n + 1))
    assert sum(len(light) for light, _, _ in claims) == 60
    light_until = max(n for n, (light, _, _) in enumerate(claims) if light)
    _alternate(claims, lambda n: n <= light_until)
    # The redos too: one every other claim at least while light work waits, then every claim.
    for n in range(1, len(claims)):
        assert claims[n][1] or claims[n - 1][1]


def test_a_stream_of_starving_batch_redos_alternates_with_light_work():
    """The batch lane's head starving and a redo to isolate, one arriving after each claim (a
    batch-class redo goes back to the batch lane's front): it goes alone, and light work the claim
    after; non-isolated batch work keeps its starvation share."""
    rule = dict(now_ms=1_000, lookahead=4, max_skip_age_ms=50, max_drop=100, isolate_attempt=ISOLATE,
                is_live=lambda request_id: True, token_budget=BUDGET, batch_share_tokens=BUDGET // 4,
                batch_starve_ms=100)
    light, batch, after_isolated = _light(60), [], False
    got = []
    for n in range(12):
        batch = [Entry(b"", 20, 0, f"b{n}", 0, FAR_MS, ISOLATE, b"")] + batch  # waited 1 s: starving
        plan = plan_claim(light, (), batch, **(rule | dict(after_isolated=after_isolated)))
        light, batch = plan.remaining(light), plan.remaining_batch(batch)
        redos = [e for e in plan.taken if e.attempt >= ISOLATE]
        assert not redos or len(plan.taken) == 1  # alone
        got.append((plan.num_batch, len(plan.taken) - plan.num_batch))
        after_isolated = bool(redos)
    # Light work within the budget less the batch lane's share (336 tokens): 16 entries a claim.
    assert got[:8] == [(1, 0), (0, 16)] * 3 + [(1, 0), (0, 12)]
    assert got[8:] == [(1, 0)] * 4  # no light work left: a redo every claim
