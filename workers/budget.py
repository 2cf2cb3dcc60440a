"""A worker's token budget: set (--token-budget), published (tokq profile --apply, read every
BUDGET_REFRESH_S), or else the device's default, cut down to what this device runs within the
latency goal.

The defaults (DEFAULT_BUDGET) suit a fast CPU core or any recent GPU, but one CPU thread's
forward time spans several times across machines: 1,024 MiniLM tokens take ~170 ms on an
AVX-512 core in bf16 and ~670 ms on an AVX2 core in fp32. A forward longer than the goal allows
(tokq.latency_goal: half the p99 goal) puts the goal out of reach at any load. So after its
warm-up a worker times a forward at the default; while it is over, the budget is scaled down
in proportion (past a small batch, forward time grows about linearly with tokens) and timed
again, at most MAX_SIZES sizes. Each size is timed twice and the faster counts: noise only ever
slows a forward (a worker starts beside the gateway and other workers, on the same cores), and
a slowed timing would cut the budget further than the device needs. It only
shrinks: `tokq profile`, which measures the whole curve, is how a budget is tuned or grown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokq.latency_goal import max_forward_ms
from tokq.queue import claim_rule

if TYPE_CHECKING:
    from tokq.config import WorkerConfig
    from tokq.queue.sharded import ShardedQueue

log = logging.getLogger("tokq.worker")

BUDGET_REFRESH_S = 1.0  # how often a worker reads the published budget
DEFAULT_BUDGET = {"cpu": 1024, "cuda": 4096}  # before fitting; `tokq profile --apply` overrides
STEP = 64  # a fitted budget is a multiple of this, and at least this
MAX_SIZES = 3
TIMINGS_PER_SIZE = 2
# Aim this far under the ceiling, so that the next timing's noise does not cross it again.
MARGIN = 0.9


def default_budget(device_type: str) -> int:
    return DEFAULT_BUDGET.get(device_type, DEFAULT_BUDGET["cpu"])


@dataclass(frozen=True)
class BudgetFit:
    budget: int  # what the worker serves at
    max_forward_ms: float  # the ceiling the goal allows
    timings: tuple[tuple[int, float], ...]  # (tokens, fastest forward ms) in the order measured

    @property
    def fits(self) -> bool:
        """The budget's own forward was timed within the ceiling (False: even STEP tokens,
        or the last cut, was not shown to fit)."""
        return any(n == self.budget and ms <= self.max_forward_ms for n, ms in self.timings)

    def describe(self) -> str:
        first_n, first_ms = self.timings[0]
        if self.budget == first_n:
            if self.fits:
                return (f"budget {self.budget} tokens: its forward took {first_ms:.0f} ms, within the "
                        f"{self.max_forward_ms:.0f} ms the latency goal allows")
            return (f"budget {self.budget} tokens: its forward took {first_ms:.0f} ms, over the "
                    f"{self.max_forward_ms:.0f} ms the latency goal allows, and it is the smallest "
                    f"budget: the goal is out of reach on this device")
        steps = ", ".join(f"{n} tokens {ms:.0f} ms" for n, ms in self.timings)
        verdict = ("" if self.fits else
                   f"; not shown to fit: the goal may be out of reach on this device")
        return (f"budget {first_n} -> {self.budget} tokens: a forward may take {self.max_forward_ms:.0f} ms "
                f"under the latency goal (timed: {steps}){verdict}")


def fit_budget(time_forward_ms: Callable[[int], float], budget: int, max_forward_ms: float) -> BudgetFit:
    """Shrink ``budget`` until ``time_forward_ms(budget)`` (one forward of that many tokens, in
    ms) is within ``max_forward_ms``; see the module doc."""
    if max_forward_ms <= 0:
        raise ValueError(f"the forward ceiling must be positive, got {max_forward_ms} ms")
    timings: list[tuple[int, float]] = []
    for _ in range(MAX_SIZES):
        ms = min(time_forward_ms(budget) for _ in range(TIMINGS_PER_SIZE))
        timings.append((budget, ms))
        if ms <= max_forward_ms or budget <= STEP:
            break
        budget = max(STEP, min(budget - STEP, int(budget * MARGIN * max_forward_ms / ms) // STEP * STEP))
    return BudgetFit(budget, max_forward_ms, tuple(timings))


def timer(warmup: Callable[[int], None]) -> Callable[[int], float]:
    """``time_forward_ms`` for ``fit_budget`` from an engine's ``warmup`` (one full-budget batch,
    synchronized)."""
    def time_forward_ms(num_tokens: int) -> float:
        start = time.perf_counter()
        warmup(num_tokens)
        return (time.perf_counter() - start) * 1000
    return time_forward_ms


class TokenBudget:
    """A worker's budget (``tokens``) and where it came from (``source``): "set", "published",
    "default" or "fitted" (the default cut to the latency goal at start)."""

    def __init__(self, engine, config: WorkerConfig, queue: ShardedQueue, light_tokens: int) -> None:
        self.engine = engine
        self.config = config
        self.queue = queue
        self.light_tokens = light_tokens
        self.tokens = config.token_budget or default_budget(engine.device.type)
        self.source = "set" if config.token_budget else "default"
        # What a published budget replaced, served again if it is withdrawn (fitted once idle
        # when it never was: a worker started then would fit it, and the fleet should agree).
        self._unpublished = (self.tokens, self.source)
        self.refit = False  # withdrawn before any fit: fit the default when next idle
        self._fitted = False  # the default was timed once: it is not timed again

    @property
    def preempt_budget(self) -> int:
        """Tokens of a pre-empting (light-only) claim; a batch of more is heavy."""
        return claim_rule.preempt_budget(self.tokens, self.light_tokens)

    async def fit_default(self) -> None:
        """No budget set or published: cut the device's default to the latency goal. Timed
        after the warm-up, whose first forward pays one-time costs."""
        self._fitted = True
        default = default_budget(self.engine.device.type)
        fit = await asyncio.to_thread(fit_budget, timer(self.engine.warmup), default,
                                      max_forward_ms(self.config.latency_goal_ms))
        (log.info if fit.fits else log.warning)("%s; p99 goal %d ms", fit.describe(),
                                                self.config.latency_goal_ms)
        self._unpublished = (fit.budget, "fitted" if fit.budget != default else "default")
        if self.source != "published":  # one published while the fit ran wins
            self.tokens, self.source = self._unpublished

    async def read_published(self) -> None:
        """Serve the published budget, if any; one withdrawn gives way to what it replaced."""
        if self.config.token_budget:
            return
        published = await self.queue.shard(0).get_budget()
        if published is not None and published > 0:
            if published != self.tokens or self.source != "published":
                log.info("token budget %d -> %d (published)", self.tokens, published)
                self.tokens = published
                self.source = "published"
        elif self.source == "published":  # withdrawn (deleted, or not a positive count)
            budget, source = self._unpublished
            log.info("published budget withdrawn: token budget %d -> %d (%s)", self.tokens,
                     budget, source)
            self.tokens, self.source = budget, source
            self.refit = not self._fitted and bool(self.config.latency_goal_ms)
