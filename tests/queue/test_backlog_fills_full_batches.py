"""A backlog becomes full batches, and the lanes' latency bounds hold: one worker simulated on
the claim rule's reference (tokq/queue/claim_rule.py), deterministic, no Redis (the Lua script
equals the reference: tests/queue/test_claim_rule_lua_matches_python.py).

The worker model follows workers/loop.py: a claim reads both lanes; a heavy batch
(``is_heavy_batch``) runs light-only claims nested at its checkpoints (5 steps x 6 layers)
until they hold ``preempt_budget`` tokens, and the claim after it is "heavy". Forward time is
A + B x tokens, fitted to a 2-core AVX2 CPU (12 tokens: 15.5 ms; 576 tokens: 166 ms). The
workload is skewed like search traffic: most queries under 30 tokens, a few of hundreds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest

from tokq.queue.claim_rule import is_heavy_batch, plan_claim, preempt_budget
from tokq.queue.wire import Entry

A_MS, B_MS = 12.3, 0.267  # forward ms = A + B x tokens
CHECKPOINTS = 30  # steps of a heavy forward where a nested batch may run
BUDGET, LIGHT_TOKENS = 448, 128  # the issue's worker: budget 448, TOKQ_LIGHT_TOKENS 128
FAR_MS = 10**12  # deadlines out of reach: nothing expires here


def forward_ms(tokens: int) -> float:
    return A_MS + B_MS * tokens


def skewed_queries(rate_per_s: float, seconds: float, *, seed: int = 1, tail: float = 0.02
                   ) -> list[tuple[float, int]]:
    """(arrival ms, tokens): Poisson arrivals; lognormal lengths (median 10, p90 ~30) up to
    LIGHT_TOKENS, and a ``tail`` share log-uniform in [129, 400] (the heavy lane's)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while t < seconds * 1000:
        t += rng.expovariate(rate_per_s / 1000)
        if rng.random() < tail:
            n = int(math.exp(rng.uniform(math.log(LIGHT_TOKENS + 1), math.log(400))))
        else:
            n = max(3, min(LIGHT_TOKENS, round(rng.lognormvariate(math.log(10), 0.857))))
        out.append((t, n))
    return out


@dataclass
class Forward:
    tokens: int
    nested: bool  # a light-only claim run inside a heavy forward
    queued: int  # tokens queued when it was claimed
    num_heavy: int = 0


@dataclass
class Run:
    forwards: list[Forward] = field(default_factory=list)
    latency_ms: dict[int, float] = field(default_factory=dict)  # query -> arrival to answer
    tokens: dict[int, int] = field(default_factory=dict)

    def fill(self, forwards) -> float:
        forwards = list(forwards)
        return sum(f.tokens for f in forwards) / (len(forwards) * BUDGET)

    def p99(self, light: bool) -> float:
        xs = sorted(ms for q, ms in self.latency_ms.items() if (self.tokens[q] <= LIGHT_TOKENS) == light)
        return xs[int(0.99 * (len(xs) - 1))]


def simulate(queries: list[tuple[float, int]], *, budget: int = BUDGET) -> Run:
    run = Run()
    light: list[Entry] = []
    heavy: list[Entry] = []
    arrived = 0
    now = 0.0
    lanes = "both"
    nested_budget = preempt_budget(budget, LIGHT_TOKENS)

    def admit(until_ms: float) -> None:
        nonlocal arrived
        while arrived < len(queries) and queries[arrived][0] <= until_ms:
            at, n = queries[arrived]
            entry = Entry(b"", n, int(at), str(arrived), 0, FAR_MS, 0, b"")
            run.tokens[arrived] = n
            (light if n <= LIGHT_TOKENS else heavy).append(entry)
            arrived += 1

    def claim(kind: str, tokens: int):
        nonlocal light, heavy
        plan = plan_claim(light, heavy, now_ms=int(now), token_budget=tokens, lookahead=4,
                          max_skip_age_ms=50, max_drop=100, isolate_attempt=2,
                          is_live=lambda request_id: True, lanes=kind, preempt_tokens=nested_budget)
        light, heavy = plan.remaining(light), plan.remaining_heavy(heavy)
        return plan

    def answered(entries, at_ms: float) -> None:
        for e in entries:
            run.latency_ms[int(e.request_id)] = at_ms - queries[int(e.request_id)][0]

    while arrived < len(queries) or light or heavy:
        admit(now)
        queued = sum(e.num_tokens for e in light + heavy)
        plan = claim(lanes, budget)
        if not plan.taken:
            lanes = "both"
            if not light and not heavy:
                now = max(now, queries[arrived][0])
            continue
        own_ms = forward_ms(plan.taken_tokens)
        heavy_batch = is_heavy_batch([e.num_tokens for e in plan.taken], plan.num_heavy, nested_budget)
        nested_ms, nested_tokens = 0.0, 0
        if heavy_batch:
            for step in range(1, CHECKPOINTS + 1):
                if nested_tokens >= nested_budget:  # workers/loop.py _preempt_while
                    break
                at = now + step * own_ms / CHECKPOINTS + nested_ms
                admit(at)
                inner = claim("light", nested_budget)
                if inner.taken:
                    nested_tokens += inner.taken_tokens
                    nested_ms += forward_ms(inner.taken_tokens)
                    run.forwards.append(Forward(inner.taken_tokens, True, queued))
                    answered(inner.taken, at + forward_ms(inner.taken_tokens))
        now += own_ms + nested_ms
        run.forwards.append(Forward(plan.taken_tokens, False, queued, plan.num_heavy))
        answered(plan.taken, now)
        lanes = "heavy" if heavy_batch else "both"
    return run


@pytest.mark.parametrize("rate_per_s", [170, 200, 260])
def test_past_the_limit_a_backlog_becomes_full_batches(rate_per_s):
    """Past the limit (~150 req/s here) every forward, nested ones included, is half full or
    more on average, and claims made with a budget's worth queued fill 0.9 of it."""
    run = simulate(skewed_queries(rate_per_s, 20))
    assert run.fill(run.forwards) >= 0.5
    backlog = [f for f in run.forwards if not f.nested and f.queued >= BUDGET]
    assert len(backlog) > 50 and run.fill(backlog) >= 0.9
    assert sum(f.nested for f in run.forwards) <= 0.2 * len(run.forwards)
    assert len(run.latency_ms) == len(run.tokens)  # every query answered


def test_the_issue_s_backlog_shape_fills_each_claim():
    """A deep light backlog (150 entries of ~13 tokens) with a few heavy entries waiting: each
    claim of the worker's sequence (both, then heavy after a heavy batch) fills the budget,
    light-only claims refuse the backlog, and the heavy entries go in the first claims."""
    rng = random.Random(3)
    light = [Entry(b"", rng.randint(5, 22), 0, f"l{i}", 0, FAR_MS, 0, b"") for i in range(150)]
    heavy = [Entry(b"", n, 0, f"h{i}", 0, FAR_MS, 0, b"") for i, n in enumerate((300, 180, 250))]
    nested_budget = preempt_budget(BUDGET, LIGHT_TOKENS)
    rule = dict(now_ms=1_000, token_budget=BUDGET, lookahead=4, max_skip_age_ms=50, max_drop=100,
                isolate_attempt=2, is_live=lambda request_id: True, preempt_tokens=nested_budget)
    lanes, fills, heavy_claims = "both", [], []
    while sum(e.num_tokens for e in light) >= BUDGET:
        if lanes == "heavy":  # inside the heavy forward: the backlog is not cut into nested batches
            refused = plan_claim(light, heavy, **(rule | dict(token_budget=nested_budget, lanes="light")))
            assert refused.taken == () and refused.stop == "backlog"
        plan = plan_claim(light, heavy, **(rule | dict(lanes=lanes)))
        light, heavy = plan.remaining(light), plan.remaining_heavy(heavy)
        fills.append(plan.taken_tokens / BUDGET)
        heavy_claims.append(plan.num_heavy)
        heavy_batch = is_heavy_batch([e.num_tokens for e in plan.taken], plan.num_heavy, nested_budget)
        lanes = "heavy" if heavy_batch else "both"
    assert min(fills) >= 0.9, fills
    assert not heavy and sum(heavy_claims[:4]) == 3  # all three within the first four claims


def test_a_probe_beside_a_heavy_flood_waits_one_step_and_its_own_forward():
    """Six callers keep the heavy lane full of 400-token requests; a one-word call arrives every
    35 ms (sent, answered, 20 ms pause): it runs nested at the next checkpoint of the heavy
    forward in flight, so it waits about one step of it plus its own forward."""
    flood = [(0.0, 400)] * 600
    probes = [(35.0 * i + 1.0, 3) for i in range(100)]
    run = simulate(sorted(flood + probes))
    step_ms = forward_ms(BUDGET + 400) / CHECKPOINTS  # the longest heavy forward's step
    probe_ms = [run.latency_ms[q] for q, n in run.tokens.items() if n == 3]
    assert max(probe_ms) <= step_ms + 2 * forward_ms(3), max(probe_ms)
    assert len(run.latency_ms) == len(run.tokens)


def test_neither_lane_starves_under_a_flood_of_both():
    """Both lanes flooded, heavy requests as large as the budget: the light lane is served by
    every claim, the heavy lane at least every other claim, each in arrival order."""
    queries = sorted([(0.0, BUDGET)] * 40 + [(float(i), 20) for i in range(3000)])
    run = simulate(queries)
    claims = [f for f in run.forwards if not f.nested]
    took_heavy = [f.num_heavy > 0 for f in claims]
    while took_heavy and not took_heavy[-1]:  # after the last heavy request
        took_heavy.pop()
    gaps = [len(run_) for run_ in "".join("H" if h else "." for h in took_heavy).split("H")]
    assert max(gaps) <= 1, gaps  # never two claims in a row without a heavy request
    assert all(f.tokens - BUDGET * f.num_heavy > 0 for f in claims[:len(took_heavy)])
    assert len(run.latency_ms) == len(run.tokens)
