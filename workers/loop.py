"""The claim loop: claim a batch up to the token budget -> pack -> forward -> ack.

The forward runs in a thread (torch releases the GIL), so while it runs the event loop claims
the next batch (prefetch), and the chores (renewals, requeues, heartbeat) go on: the device never
waits on Redis, and Redis never waits on the device. Idle, the loop waits for a wake-up
(workers/wake.py).

Heavy work cannot hold light work back: while a heavy batch's forward runs (``is_heavy``: more tokens
than ``tokq.queue.claim_rule.preempt_budget``, half of them from the heavy or batch lanes or more:
bulk batch-class work is pre-empted as heavy work is) the worker is
registered as pre-emptible; light work that arrives tells it 'light', it claims that work
light-only and the forward thread runs it nested between two steps of the heavy forward's layers
(workers/preempt.py). Either batch is leased, renewed and acknowledged like any other: a crash
redoes both. A heavy forward stops taking nested batches once they hold ``preempt_budget`` tokens,
and a light lane longer than that is left to full batches (tokq/queue/claim_rule.py): a backlog
becomes full batches, not many small nested ones. A batch-class forward (bulk work,
``is_bulk_batch``) has no such cap, and its nested claims take what fits: queries wait for a
checkpoint, not for its end. One nested batch per checkpoint bounds how far bulk work is delayed.
A claim of interactive work beside batch-class work runs its interactive entries first, as their
own forward answered at once (a partial ack), then the batch-class part; each part is pre-emptible
when heavy (``split_interactive``): queries that rode a bulk claim do not wait for its stretched forward.

Redos to isolate cannot hold light work back either: after a full claim on a shard took one
(alone), the worker's next full claim there reads light work first (``after_isolated``,
tokq/queue/claim_rule.py): light work and a stream of such redos alternate at worst.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from tokq.queue.claim_rule import Lanes, is_bulk_batch, is_heavy_batch, isolate_attempt_for
from tokq.queue.shard import Claim
from tokq.queue.sharded import ShardedQueue
from tokq.workers.budget import TokenBudget
from tokq.workers.chores import REDIS_ERRORS, REDIS_RETRY_S
from tokq.workers.leases import Leases
from tokq.workers.preempt import Preemption
from tokq.workers.runner import BatchOutcome, BatchRunner
from tokq.workers.wake import WakeUps

log = logging.getLogger("tokq.worker")

# The next claim starts at PREFETCH_AT of the expected forward time, less PREFETCH_CLAIMS
# expected claim round trips.
PREFETCH_AT = 0.8
PREFETCH_CLAIMS = 2.0


def _ewma(avg: float, value: float, weight: float = 0.2) -> float:
    return value if avg == 0.0 else (1 - weight) * avg + weight * value


def is_heavy(claim: Claim, preempt_budget: int) -> bool:
    """A forward worth pre-empting: more tokens than a light-only claim, at least half of them
    from the heavy lane or the batch lane (batch-class work). A batch of mostly light work is
    not pre-empted: light work arriving meanwhile waits for the next batch, so under ordinary
    traffic batches stay full (pre-empting every batch past the light-only budget makes them
    several times smaller)."""
    return is_heavy_batch([e.num_tokens for e in claim.entries], claim.num_heavy, preempt_budget,
                          claim.num_batch)


def is_bulk(claim: Claim) -> bool:
    """A forward whose heavy part is batch-class work (claim_rule.is_bulk_batch)."""
    return is_bulk_batch([e.num_tokens for e in claim.entries], claim.num_heavy, claim.num_batch)


def split_interactive(claim: Claim) -> tuple[Claim, Claim] | None:
    """A claim holding batch-class work beside interactive work, as two parts of its one lease:
    (its interactive entries, light and heavy; its batch-class ones, run second). None for any
    other claim. Each part is pre-emptible as ``is_heavy`` says of it."""
    num_interactive = len(claim.entries) - claim.num_batch
    if claim.num_batch <= 0 or num_interactive <= 0:
        return None
    interactive = dataclasses.replace(claim, entries=claim.entries[:num_interactive], num_batch=0)
    return interactive, dataclasses.replace(claim, entries=claim.entries[num_interactive:], num_heavy=0)


class Prefetch:
    """When the next claim starts beside a forward: late enough that it takes what arrived
    meanwhile (fuller batches), early enough that the device does not wait on Redis."""

    def __init__(self) -> None:
        self.forward_s = 0.0  # moving averages of the forward's wall time and of a claim
        self.claim_s = 0.0

    def forwarded(self, seconds: float) -> None:
        self.forward_s = _ewma(self.forward_s, seconds)

    def claimed(self, seconds: float) -> None:
        self.claim_s = _ewma(self.claim_s, seconds)

    def delay_s(self) -> float:
        return max(0.0, PREFETCH_AT * self.forward_s - PREFETCH_CLAIMS * self.claim_s)


class ClaimLoop:
    """Claims and runs batches on ``runner`` until ``stop()``. ``healthy()``: False once the
    worker gave up (no more pre-empting claims)."""

    def __init__(self, queue: ShardedQueue, runner: BatchRunner, budget: TokenBudget, leases: Leases,
                 wake: WakeUps, *, healthy: Callable[[], bool], observer=None) -> None:
        self.queue = queue
        self.runner = runner
        self.budget = budget
        self.leases = leases
        self.wake = wake
        self.healthy = healthy
        self.observer = observer
        self.preemption = Preemption(lambda claim: self.run_batch(claim))
        self.prefetch = Prefetch()
        self.stopping = asyncio.Event()
        self.forward_since: float | None = None  # monotonic start of the running forward
        self.num_batches = 0
        self.num_preemptions = 0
        # Shards whose last full claim took a redo to isolate: light work goes first there next.
        self.isolated_at: set[int] = set()
        self.isolate_attempt = isolate_attempt_for(queue.config.max_attempts)

    def stop(self) -> None:
        """Stop claiming; the batches in hand are finished and acknowledged."""
        self.stopping.set()

    async def run(self, burst: bool) -> None:
        next_claim: asyncio.Task | None = asyncio.create_task(self._claim())
        heavy = False  # the last batch was heavy: the claim after it read the heavy lane only
        idle = self.wake.idle
        while next_claim is not None:
            claim = await next_claim
            next_claim = None
            if claim is not None and idle.maybe:
                await idle.set(False)
            if claim is None:
                if self.stopping.is_set() or (burst and await self._drained()):
                    break
                if heavy:  # light work may wait, left to the light-only claims: claim it now
                    heavy = False
                    next_claim = asyncio.create_task(self._claim())
                    continue
                if self.budget.refit:  # idle, no forward running: the engine is free to time one
                    self.budget.refit = False
                    if idle.maybe:  # busy for seconds: new work must wake another worker
                        await idle.set(False)
                    await self.budget.fit_default()
                await self.wake.wait_for_work()
                next_claim = asyncio.create_task(self._claim())
                continue
            self.forward_since = started = time.monotonic()
            first: BatchOutcome | None = None  # the interactive part's, answered before the rest
            if (parts := split_interactive(claim)) is not None:
                interactive, claim = parts
                # No claim beside it: the batch part, claimed already, runs next.
                first = await self._end_forward(*self._start_forward(interactive))
                self.forward_since = None  # a Redis stall in the ack is no hung forward
                await self.leases.answer_early(interactive, first)
                self._observe(first, full_claim=False)
                # The batch part queued until now: its queue_ms counts the interactive part's forward and ack.
                waited_ms = round((time.monotonic() - started) * 1000)
                claim = dataclasses.replace(claim, now_ms=claim.now_ms + waited_ms)
                self.forward_since = time.monotonic()
            forward, preempting = self._start_forward(claim)
            heavy = preempting is not None
            if not self.stopping.is_set():
                # Overlap the next claim with the end of this forward (Prefetch). Beside a heavy
                # forward, from the heavy lane (then batch work) only: light work arriving
                # meanwhile runs inside it, rather than ride in the next one.
                next_claim = asyncio.create_task(self._claim(
                    delay_s=self.prefetch.delay_s(), until=forward, lanes="heavy" if heavy else "both"))
            outcome = await self._end_forward(forward, preempting)
            self.forward_since = None
            # The forward's wall time, nested batches in it: the next claim aims at its end.
            self.prefetch.forwarded(outcome.forward_s + outcome.nested_s)
            await self._finish(claim, outcome, first=first)

    def _start_forward(self, claim: Claim) -> tuple[asyncio.Task, asyncio.Task | None]:
        """``claim``'s forward, in a thread; when heavy, pre-emptible, with the task that claims
        the light work run inside it (else None)."""
        heavy = is_heavy(claim, self.budget.preempt_budget)
        if heavy:
            self.preemption.arm()  # before the thread starts: the pre-empting claim may be first
        forward = asyncio.create_task(asyncio.to_thread(self.run_heavy if heavy else self.run_batch, claim))
        return forward, (asyncio.create_task(self._preempt_while(forward, bulk=is_bulk(claim))) if heavy else None)

    async def _end_forward(self, forward: asyncio.Task, preempting: asyncio.Task | None) -> BatchOutcome:
        """The forward's outcome, once the light batches that ran inside it are acknowledged."""
        try:
            outcome = await forward
        except BaseException:  # cancelled or failed: the leases in hand are left to expire
            if preempting is not None:
                preempting.cancel()
            raise
        if preempting is not None:
            await preempting
        if outcome.nested:  # only batches that ran inside it: one offered too late ran after
            self.num_preemptions += outcome.nested
            if self.observer:
                self.observer.observe_preemption(outcome.nested)
        return outcome

    async def _finish(self, claim: Claim, outcome: BatchOutcome, *, full_claim: bool = True,
                      first: BatchOutcome | None = None) -> None:
        """Acknowledge ``claim`` and observe its batch. ``full_claim``: claimed up to the token
        budget (not a light-only pre-empting claim). ``first``: the lease's interactive part,
        answered already; its results go again (first write wins) in case that ack failed."""
        results = outcome if first is None else dataclasses.replace(
            outcome, results=first.results + outcome.results)
        await self.leases.ack(claim, results)
        claimed = None if first is None else int(sum(first.seqlens)) + int(sum(outcome.seqlens))
        self._observe(outcome, full_claim=full_claim, claimed_tokens=claimed)

    def _observe(self, outcome: BatchOutcome, *, full_claim: bool, claimed_tokens: int | None = None) -> None:
        """Count one forward's batch in the loop's and the observer's metrics. ``claimed_tokens``:
        the whole claim's, where it ran as two forwards (its fill)."""
        self.num_batches += 1
        if self.observer:
            # Only full claims count in the fill ratio ("fewer workers would carry this traffic"):
            # a pre-empting claim holds what landed during one forward, however busy the worker.
            budget = self.budget.tokens if full_claim else 0
            if outcome.seqlens:  # else no forward completed (every item refused or failed)
                self.observer.observe_batch(outcome.seqlens, token_budget=budget, claimed_tokens=claimed_tokens,
                                            forward_s=outcome.forward_s, graphed=outcome.graphed)
            for _ in range(outcome.num_failed):
                self.observer.observe_error("item")

    async def _preempt_while(self, forward: asyncio.Task, *, bulk: bool = False) -> None:
        """While a heavy forward runs: registered as pre-emptible, claim light work on each
        'light' wake-up and hand it to the forward thread, which runs it nested; acknowledge it.
        Until the nested batches hold preempt_budget tokens: light work past that waits for the
        next batch, as light work past a light-only claim's budget does (a backlog). ``bulk``: a
        batch-class forward: no cap, and each claim takes what fits (one nested batch a checkpoint)."""
        loop = asyncio.get_running_loop()
        registration, light_wakeup = self.wake.preemptible, self.wake.light_wakeup
        woken = False  # woken by a 'light' wake-up: claim at once, register again after
        nested_tokens = 0
        try:
            while (not forward.done() and self.healthy() and not self.stopping.is_set()
                   and (bulk or nested_tokens < self.budget.preempt_budget)):
                if not registration.registered and not woken:
                    # Registered before the claim: no wake-up falls between. After a wake-up
                    # (which took this worker out of the set) the claim goes first, one round
                    # trip sooner; registering and this claim follow it, so nothing is missed.
                    # A wake-up read meanwhile is cleared below, and took this worker out of the
                    # set: should its work go elsewhere, register again rather than wait unheard.
                    woken = await registration.set(True)
                after_wakeup, woken = woken, False
                light_wakeup.clear()
                claim = await self._claim(self.budget.preempt_budget, lanes="light", bulk_forward=bulk)
                if claim is None:
                    if after_wakeup:  # its work went elsewhere: register, claim again, wait
                        continue
                    wakeup = asyncio.create_task(light_wakeup.wait())
                    await asyncio.wait({forward, wakeup}, return_when=asyncio.FIRST_COMPLETED)
                    woken = wakeup.done()
                    wakeup.cancel()
                    continue
                nested_tokens += claim.num_tokens
                future = self.preemption.offer(claim, loop)
                if future is None:  # the heavy forward ended meanwhile: an ordinary batch
                    outcome = await asyncio.to_thread(self.run_batch, claim)
                else:  # nested, or after the forward if offered too late: counted by the loop
                    outcome = await future
                await self._finish(claim, outcome, full_claim=False)
        finally:
            if registration.maybe:
                await registration.set(False)

    async def _claim(self, token_budget: int | None = None, *, delay_s: float = 0.0,
                     until: asyncio.Future | None = None, lanes: Lanes = "both",
                     bulk_forward: bool = False) -> Claim | None:
        """A batch of up to ``token_budget`` tokens (None: nothing queued), claimed after
        ``delay_s`` or as soon as ``until`` (the forward in flight) ends, whichever is first:
        the delay comes from the average forward, and a short batch after long ones (a one-word
        call after heavy work) must not wait out the long ones' delay (it measured ~60 ms)."""
        if delay_s > 0:
            stopped = asyncio.ensure_future(self.stopping.wait())
            try:  # SIGTERM: stop waiting, claim nothing new
                await asyncio.wait({stopped} | ({until} if until is not None else set()),
                                   timeout=delay_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
            if self.stopping.is_set():
                return None
        start = time.perf_counter()
        full = lanes != "light"
        try:
            claim = await self.queue.consumer.claim(token_budget or self.budget.tokens, lanes=lanes,
                                                    on_stop=getattr(self.observer, "observe_claim_stop", None),
                                                    after_isolated=self.isolated_at if full else (),
                                                    bulk_forward=bulk_forward)
        except REDIS_ERRORS as exc:  # Redis down or restarting: wait, then claim again
            log.warning("claim failed: %s; retrying", exc)
            if self.observer:
                self.observer.observe_error("redis")
            await asyncio.sleep(REDIS_RETRY_S)
            return None
        claim_s = time.perf_counter() - start
        self.prefetch.claimed(claim_s)
        if claim is not None:
            self.leases.held.add(claim.batch_id)
            if full:
                shard = self.queue.shard_of_batch(claim.batch_id)
                if any(e.attempt >= self.isolate_attempt for e in claim.entries):
                    self.isolated_at.add(shard)
                else:
                    self.isolated_at.discard(shard)
        if self.observer:
            self.observer.observe_claim(claim_s)
        return claim

    async def _drained(self) -> bool:
        stats = await self.queue.stats.read()  # a shard it cannot read may still hold work
        return not stats.unreadable_shards and stats.queued_entries == 0 and stats.inflight_items == 0

    # -- compute (runs in a thread) -----------------------------------------------------------

    def run_batch(self, claim: Claim) -> BatchOutcome:
        return self.runner.run(claim)  # failures, retries, device errors: workers/runner.py

    def run_heavy(self, claim: Claim) -> BatchOutcome:
        """run_batch, with light batches offered meanwhile run between its steps. Its forward_s
        leaves their seconds out: each is timed in its own outcome, and counted twice the
        forward seconds added up past the wall clock (24.6 s in 20 s on one CPU worker)."""
        outcome = self.preemption.heavy(lambda: self.run_batch(claim))
        nested_s = self.preemption.nested_s  # this forward's: the next starts after we return
        return dataclasses.replace(outcome, forward_s=max(0.0, outcome.forward_s - nested_s),
                                   nested=self.preemption.nested_runs, nested_s=nested_s)
