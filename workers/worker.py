"""The worker loop: claim a batch up to the token budget -> pack -> forward -> ack.

The forward runs in a thread (torch releases the GIL), so while it runs the event loop claims
the next batch, renews the leases in hand, requeues crashed workers' leases and beats the
heartbeat: the device never waits on Redis, and Redis never waits on the device.

An idle worker does not poll: it registers as idle and waits on its owner channel, where
enqueue and requeue wake one idle worker when the queue stops being empty (and a claim that
leaves work wakes the next, so a burst spreads); the queue's work channel gets the notice when no
worker is registered. It claims at least every IDLE_FALLBACK_S in case a notice was missed.

Heavy work cannot hold light work back: while a heavy batch's forward runs (``is_heavy``: more tokens
than ``tokq.queue.claim_rule.preempt_budget``, half of them from the heavy lane or more) the worker is registered as pre-emptible; light work that
arrives tells it 'light', it claims that work light-only and the forward thread runs it nested
between two steps of the heavy forward's layers (workers/preempt.py). Either batch is leased, renewed
and acknowledged like any other: a crash redoes both. A heavy forward stops taking nested batches
once they hold ``preempt_budget`` tokens, and a light lane longer than that is left to full
batches (tokq/queue/claim_rule.py): a backlog becomes full batches, not many small nested ones.

A forward that runs far past its expected time (a hung device) makes the worker give up: its
heartbeat goes, its leases are no longer renewed (so its batches are redone elsewhere) and the
process exits non-zero for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable

import redis.exceptions

from tokq.tasks import cancel_and_wait, raise_if_cancelled
from tokq.queue.claim_rule import Lanes, is_heavy_batch, preempt_budget
from tokq.config import QueueConfig, WorkerConfig
from tokq.latency_goal import max_forward_ms
from tokq.queue.shard import Claim, Queue
from tokq.queue.sharded import ShardedQueue
from tokq.redis.pubsub import ShardedSubscriber
from tokq.workers.budget import default_budget, fit_budget, timer
from tokq.workers.preempt import Preemption
from tokq.workers.runner import BatchOutcome, BatchRunner

log = logging.getLogger("tokq.worker")

# An idle worker waits for a work notice, but claims at least this often: a missed notice
# (a reconnect) costs at most this long.
IDLE_FALLBACK_S = 0.5
REDIS_RETRY_S = 0.2
ACK_ATTEMPTS = 10
# Any Redis failure, -READONLY after a failover or -OOM included: wait and retry, never exit.
_REDIS_ERRORS = (redis.exceptions.RedisError, OSError)
BUDGET_REFRESH_S = 1.0
# The requeue chore calls this long after a lease's deadline (Redis and host clocks tick apart).
EXPIRY_SLACK_S = 0.005
# A forward is hung past max(hung_forward_ms, HUNG_FACTOR x the warm-up forward at the full
# budget); the process then exits with EXIT_HUNG.
HUNG_FACTOR = 20.0
EXIT_HUNG = 3


# The next claim starts at PREFETCH_AT of the expected forward time, less PREFETCH_CLAIMS
# expected claim round trips.
PREFETCH_AT = 0.8
PREFETCH_CLAIMS = 2.0


def _ewma(avg: float, value: float, weight: float = 0.2) -> float:
    return value if avg == 0.0 else (1 - weight) * avg + weight * value


def is_heavy(claim: Claim, preempt_budget: int) -> bool:
    """A forward worth pre-empting: more tokens than a light-only claim, at least half of them
    from the heavy lane. A batch of mostly light work is not pre-empted: light work arriving
    meanwhile waits for the next batch, so under ordinary traffic batches stay full
    (pre-empting every batch over the light-only budget cut the service's batches from ~38
    items to ~5 and its throughput by 40%; one with any heavy item, to ~15)."""
    return is_heavy_batch([e.num_tokens for e in claim.entries], claim.num_heavy, preempt_budget)


class OutageLog:
    """A failure that recurs while it lasts, logged once, and once more when it works again:
    with one shard's node out, a chore fails at every round for as long as the node is out."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failing = False

    def failed(self, exc: BaseException) -> None:
        if not self.failing:
            log.warning("%s failed: %s (not logged again until it works)", self.what, exc)
        self.failing = True

    def worked(self) -> None:
        if self.failing:
            self.failing = False
            log.warning("%s works again", self.what)


class Registration:
    """The worker's place in one kind of wake-up set on every shard it claims from: ``idle`` (a
    'work' notice may pick it) or ``preemptible`` (a 'light' one may, while a heavy forward
    runs). A notice pops it out of that one shard's set only (lua/lib/wake.lua): with several
    shards it may stay in the others' (so may a registration whose answer was lost) until it
    withdraws; else, busy, it would take those shards' notices from the workers waiting."""

    def __init__(self, queue: ShardedQueue | Queue, kind: str) -> None:
        self.queue = queue
        self.kind = kind
        self.registered = False  # in every claimed shard's set, as far as this worker knows
        self.maybe = False  # possibly in some shard's set: withdraw before that matters
        self.notices = 0  # notices of this kind read (Worker._read_notices)
        self._outage = OutageLog(f"{kind} registration")

    def noticed(self) -> None:
        """A notice of this kind was read: the shard that sent it holds this worker no more."""
        self.registered = False
        self.maybe = self.maybe and self.queue.claim_shards > 1
        self.notices += 1

    async def set(self, on: bool) -> bool:
        """Register (``on``) or withdraw; True if a notice was read meanwhile."""
        read, was_maybe = self.notices, self.maybe
        try:
            await getattr(self.queue.consumer, f"mark_{self.kind}")(on)
            # A notice read meanwhile took this worker out of a set: not registered. (Believing
            # itself registered, it would hear no more notices: enqueue.lua tells only the
            # workers in the set.) It may be in a set still: another shard's, or this one's if
            # the notice popped an earlier registration whose answer was lost and this one
            # landed after it.
            self.registered = on and self.notices == read
            self.maybe = on and (self.registered or was_maybe or self.queue.claim_shards > 1)
            self._outage.worked()
        except _REDIS_ERRORS as exc:
            # Not registered, or registered with its answer lost: taken for maybe registered,
            # withdrawn later (idle: before the forward; pre-emptible: as the forward ends).
            # Meanwhile work waits for a claim. With one shard's node down this fails at every
            # wait (the other shards' sets are still written): logged once per outage.
            self._outage.failed(exc)
            self.maybe = self.maybe or on
        return self.notices != read


def default_worker_id(device="cpu") -> str:
    """hostname-device ("gpu-node-3-cuda0"): the same after a restart, so the worker's metric
    series (label ``worker``) carry on instead of a new set per process. Workers sharing one
    device on one host need their own --worker-id."""
    return f"{socket.gethostname()}-{str(device).replace(':', '')}"


class Worker:
    def __init__(self, engine, queue: ShardedQueue | Queue, config: WorkerConfig, queue_config: QueueConfig,
                 worker_id: str | None = None, observer=None,
                 exit_process: Callable[[int], object] = os._exit) -> None:
        self.engine = engine
        if isinstance(queue, Queue):  # one unsharded queue
            queue = ShardedQueue.of(queue)
        self.queue = queue
        self.config = config
        self.queue_config = queue_config
        self.worker_id = worker_id or default_worker_id(engine.device)
        self.observer = observer
        self.runner = BatchRunner(engine, observer=observer, exit=exit_process)
        self.token_budget = config.token_budget or default_budget(engine.device.type)
        # Where token_budget came from: "set" (--token-budget), "published" (tokq profile
        # --apply), "default" or "fitted" (the default cut to the latency goal at start).
        self.budget_source = "set" if config.token_budget else "default"
        # What a published budget replaced, served again if it is withdrawn (fitted once idle
        # when it never was: a worker started then would fit it, and the fleet should agree).
        self._unpublished = (self.token_budget, self.budget_source)
        self._refit = False
        self._fitted = False  # the default was timed once: it is not timed again
        self._held: set[str] = set()  # batch ids whose leases we renew
        self._stop = asyncio.Event()
        self.num_batches = 0
        self._forward_s_avg = 0.0  # moving averages that time the prefetching claim
        self._claim_s_avg = 0.0
        self._exit_process = exit_process  # os._exit: a hung forward thread cannot be joined
        self.healthy = True
        self.hung_after_s = config.hung_forward_ms / 1000
        self._forward_since: float | None = None  # monotonic start of the running forward
        self._notices = ShardedSubscriber(queue.redis, label="work notices")
        self._subscribed = False
        self._beat_lock = asyncio.Lock()  # a beat in flight must not outlive a give-up
        self._idle = Registration(queue, "idle")  # withdrawn before each forward
        self._preemptible = Registration(queue, "preemptible")  # while a heavy forward runs
        self._reader: asyncio.Task | None = None  # _read_notices, the subscription's one reader
        self._work_notice = asyncio.Event()  # a notice came (read by _read_notices only)
        self._light_notice = asyncio.Event()  # a 'light' notice came
        self.preemption = Preemption(lambda claim: self.run_batch(claim))
        self.num_preemptions = 0

    def stop(self) -> None:
        """Stop claiming; the batches in hand are finished and acknowledged."""
        self._stop.set()

    # -- the loop -----------------------------------------------------------------------------

    async def run(self, *, burst: bool = False) -> None:
        await self._refresh_budget_at_start()
        start = time.perf_counter()
        await asyncio.to_thread(self.engine.warmup, self.token_budget)
        self.hung_after_s = max(self.hung_after_s, HUNG_FACTOR * (time.perf_counter() - start))
        if self.budget_source == "default" and self.config.latency_goal_ms:
            await self._fit_default_budget()
            await self._refresh_budget_at_start()  # one published meanwhile wins
        start = time.perf_counter()
        if captured := await asyncio.to_thread(self.engine.capture_graphs, self.token_budget):
            log.info("captured %d CUDA graphs of short-query batch shapes in %.1f s", captured,
                     time.perf_counter() - start)
        await self._subscribe()  # before the first claim, so no notice falls in between
        chores = [asyncio.create_task(c) for c in (self._renew_leases(), self._requeue_expired(),
                                                   self._heartbeat(), self._watch_budget(),
                                                   self._watch_forward(), self._read_notices())]
        self._reader = chores[-1]
        try:
            await self._loop(burst)
        finally:
            await cancel_and_wait(chores)  # again until they end: tokq/tasks.py
            await self._notices.aclose()
            with contextlib.suppress(Exception):
                await self.queue.consumer.forget_worker(self.worker_id)

    async def _loop(self, burst: bool) -> None:
        next_claim: asyncio.Task | None = asyncio.create_task(self._claim())
        heavy = False  # the last batch was heavy: the claim after it read the heavy lane only
        while next_claim is not None:
            claim = await next_claim
            next_claim = None
            if claim is not None and self._idle.maybe:
                await self._idle.set(False)
            if claim is None:
                if self._stop.is_set() or (burst and await self._drained()):
                    break
                if heavy:  # light work may wait, left to the light-only claims: claim it now
                    heavy = False
                    next_claim = asyncio.create_task(self._claim())
                    continue
                if self._refit:  # idle, no forward running: the engine is free to time one
                    self._refit = False
                    if self._idle.maybe:  # busy for seconds: new work must wake another worker
                        await self._idle.set(False)
                    await self._fit_default_budget()
                await self._wait_for_work()
                next_claim = asyncio.create_task(self._claim())
                continue
            self._forward_since = time.monotonic()
            heavy = is_heavy(claim, self.preempt_budget)
            run = self.run_heavy if heavy else self.run_batch
            if heavy:
                self.preemption.arm()  # before the thread starts: the pre-empting claim may be first
            forward = asyncio.create_task(asyncio.to_thread(run, claim))
            preempting = asyncio.create_task(self._preempt_while(forward)) if heavy else None
            if not self._stop.is_set():
                # Overlap the next claim with the end of this forward: late enough that it
                # takes what arrived meanwhile (fuller batches), early enough that the device
                # does not wait on Redis. Beside a heavy forward, from the heavy lane only: light
                # work arriving meanwhile runs inside it, rather than ride in the next one.
                next_claim = asyncio.create_task(self._claim(
                    delay_s=self._prefetch_delay_s(), until=forward, lanes="heavy" if heavy else "both"))
            try:
                outcome = await forward
            except BaseException:  # cancelled or failed: the leases in hand are left to expire
                if preempting is not None:
                    preempting.cancel()
                raise
            if preempting is not None:
                await preempting  # its light batches are acknowledged first
            self._forward_since = None
            # The forward's wall time, nested batches in it: the next claim aims at its end.
            self._forward_s_avg = _ewma(self._forward_s_avg, outcome.forward_s + outcome.nested_s)
            if outcome.nested:  # only batches that ran inside it: one offered too late ran after
                self.num_preemptions += outcome.nested
                if self.observer:
                    self.observer.observe_preemption(outcome.nested)
            await self._finish(claim, outcome)

    async def _finish(self, claim: Claim, outcome: BatchOutcome, *, full_claim: bool = True) -> None:
        """Acknowledge ``claim`` and observe its batch. ``full_claim``: claimed up to the token
        budget (not a light-only pre-empting claim)."""
        await self._ack(claim, outcome)
        self._held.discard(claim.batch_id)
        self.num_batches += 1
        if self.observer:
            # Only full claims count in the fill ratio, whose alert reads "fewer workers would
            # carry this traffic": a pre-empting claim takes the light work that landed during a
            # heavy forward, often one query, however busy the worker (counted, a saturated
            # worker under mixed load read a mean fill of 0.066).
            budget = self.token_budget if full_claim else 0
            if outcome.seqlens:  # else no forward completed (every item refused or failed)
                self.observer.observe_batch(outcome.seqlens, token_budget=budget,
                                            forward_s=outcome.forward_s, graphed=outcome.graphed)
            for _ in range(outcome.num_failed):
                self.observer.observe_error("item")

    @property
    def preempt_budget(self) -> int:
        """Tokens of a pre-empting (light-only) claim; a batch of more is heavy."""
        return preempt_budget(self.token_budget, self.queue_config.light_tokens)

    async def _preempt_while(self, forward: asyncio.Task) -> None:
        """While a heavy forward runs: registered as pre-emptible, claim light work on each
        'light' notice and hand it to the forward thread, which runs it nested; acknowledge it.
        Until the nested batches hold preempt_budget tokens: light work past that waits for the
        next batch, as light work past a light-only claim's budget does (a backlog)."""
        loop = asyncio.get_running_loop()
        noticed = False  # woken by a 'light' notice: claim at once, register again after
        nested_tokens = 0
        try:
            while (not forward.done() and self.healthy and not self._stop.is_set()
                   and nested_tokens < self.preempt_budget):
                if not self._preemptible.registered and not noticed:
                    # Registered before the claim: no notice falls between. After a notice
                    # (which took this worker out of the set) the claim goes first, one round
                    # trip sooner; registering and this claim follow it, so nothing is missed.
                    # A notice read meanwhile is cleared below, and took this worker out of the
                    # set: should its work go elsewhere, register again rather than wait unheard.
                    noticed = await self._preemptible.set(True)
                after_notice, noticed = noticed, False
                self._light_notice.clear()
                claim = await self._claim(self.preempt_budget, lanes="light")
                if claim is None:
                    if after_notice:  # its work went elsewhere: register, claim again, wait
                        continue
                    notice = asyncio.create_task(self._light_notice.wait())
                    await asyncio.wait({forward, notice}, return_when=asyncio.FIRST_COMPLETED)
                    noticed = notice.done()
                    notice.cancel()
                    continue
                nested_tokens += claim.num_tokens
                future = self.preemption.offer(claim, loop)
                if future is None:  # the heavy forward ended meanwhile: an ordinary batch
                    outcome = await asyncio.to_thread(self.run_batch, claim)
                else:  # nested, or after the forward if offered too late: counted by the loop
                    outcome = await future
                await self._finish(claim, outcome, full_claim=False)
        finally:
            if self._preemptible.maybe:
                await self._preemptible.set(False)

    async def _ack(self, claim: Claim, outcome: BatchOutcome) -> None:
        for attempt in range(ACK_ATTEMPTS):
            try:
                await self.queue.consumer.ack(claim.batch_id, outcome.results)
                return
            except _REDIS_ERRORS as exc:
                log.warning("ack of batch %s failed (%s), attempt %d", claim.batch_id, exc, attempt + 1)
                if self.observer:
                    self.observer.observe_error("redis")
                await asyncio.sleep(REDIS_RETRY_S)
        # Give up: the lease expires and another worker redoes the batch (acks are idempotent).
        log.error("batch %s not acknowledged; it will be redone after its lease", claim.batch_id)

    async def _subscribe(self) -> None:
        try:
            # Every shard's work channel, and this process's owner channels: while it lives,
            # they tell requeue not to take its leases early (tokq.queue.shard.Queue.owner_channel).
            # A node that cannot be reached costs only its shards' channels, which the
            # subscriber subscribes again in the background (tokq.redis.pubsub); claims still
            # happen every IDLE_FALLBACK_S meanwhile.
            await self._notices.subscribe(*self.queue.consumer.work_channels(), *self.queue.consumer.owner_channels())
            self._subscribed = True
        except _REDIS_ERRORS as exc:
            log.warning("work-notice subscription failed: %s", exc)
            self._subscribed = False

    async def _read_notices(self) -> None:
        """The one reader of the subscription, busy or idle: a notice wakes the idle wait, a
        'light' one also the pre-empting claim of a heavy forward."""
        while self.healthy:  # a worker that gave up stays off its owner channels
            raise_if_cancelled()
            if not self._subscribed:
                await self._subscribe()
                if not self._subscribed:
                    await asyncio.sleep(IDLE_FALLBACK_S)
                    continue
            try:
                notice = await self._notices.get_message(timeout=IDLE_FALLBACK_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a lost or closed subscription: subscribe again
                log.warning("work-notice subscription lost: %s", exc)
                self._subscribed = False
                continue
            if notice is None:
                continue
            # Picked out of the idle or pre-emptible set (lua/lib/wake.lua): it registers
            # again before its next wait.
            if notice[1] == b"work":
                self._idle.noticed()
            elif notice[1] == b"light":
                self._preemptible.noticed()
                self._light_notice.set()
            self._work_notice.set()

    async def _wait_for_work(self) -> None:
        """Until a notice arrives or IDLE_FALLBACK_S pass. Notices that came while busy are
        taken at once: one claim answers all of them."""
        if not self._idle.registered:
            await self._idle.set(True)
        if not self._work_notice.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._work_notice.wait(), timeout=IDLE_FALLBACK_S)
        self._work_notice.clear()

    def _prefetch_delay_s(self) -> float:
        return max(0.0, PREFETCH_AT * self._forward_s_avg - PREFETCH_CLAIMS * self._claim_s_avg)

    async def _claim(self, token_budget: int | None = None, *, delay_s: float = 0.0,
                     until: asyncio.Future | None = None, lanes: Lanes = "both") -> Claim | None:
        """A batch of up to ``token_budget`` tokens (None: nothing queued), claimed after
        ``delay_s`` or as soon as ``until`` (the forward in flight) ends, whichever is first:
        the delay comes from the average forward, and a short batch after long ones (a one-word
        call after heavy work) must not wait out the long ones' delay (it measured ~60 ms)."""
        if delay_s > 0:
            stopped = asyncio.ensure_future(self._stop.wait())
            try:  # SIGTERM: stop waiting, claim nothing new
                await asyncio.wait({stopped} | ({until} if until is not None else set()),
                                   timeout=delay_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
            if self._stop.is_set():
                return None
        start = time.perf_counter()
        try:
            claim = await self.queue.consumer.claim(token_budget or self.token_budget, lanes=lanes,
                                                    on_stop=getattr(self.observer, "observe_claim_stop", None))
        except _REDIS_ERRORS as exc:  # Redis down or restarting: wait, then claim again
            log.warning("claim failed: %s; retrying", exc)
            if self.observer:
                self.observer.observe_error("redis")
            await asyncio.sleep(REDIS_RETRY_S)
            return None
        claim_s = time.perf_counter() - start
        self._claim_s_avg = _ewma(self._claim_s_avg, claim_s)
        if claim is not None:
            self._held.add(claim.batch_id)
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

    # -- chores -------------------------------------------------------------------------------

    async def _every(self, period_s: float | Callable[[], float], chore) -> None:
        """``chore`` again and again, ``period_s`` apart (a callable: asked after each round);
        its failures logged once per outage."""
        outage = OutageLog(chore.__name__)
        while True:
            try:
                await chore()
                outage.worked()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis blips must not kill the worker
                outage.failed(exc)
            raise_if_cancelled()
            await asyncio.sleep(period_s() if callable(period_s) else period_s)

    async def _renew_leases(self) -> None:
        period_s = self.queue_config.lease_ms / 3000

        async def renew_one(batch_id: str) -> None:
            # Bounded by the period: a silent node (3 x 5 s on a cluster) must not hold up the
            # next round's renewals on the others past their lease.
            if not await asyncio.wait_for(self.queue.consumer.renew(batch_id), period_s) and batch_id in self._held:
                # Requeued already (we stalled past the lease): another worker may redo it;
                # our ack still counts once, the first answer wins.
                log.warning("lease of batch %s expired before it finished", batch_id)

        async def renew():
            # Every held batch at once: one shard's node out (refusing, or silent) failed the
            # round at its batch, and the batches after it on healthy shards went unrenewed
            # until another worker redid them (a queue bug hunt).
            held = list(self._held if self.healthy else ())
            failed = [r for r in await asyncio.gather(*map(renew_one, held), return_exceptions=True)
                      if isinstance(r, BaseException)]
            for error in failed:
                if not isinstance(error, Exception):
                    raise error  # cancelled
            if failed:
                raise failed[0]  # logged once per outage by _every
        await self._every(period_s, renew)

    async def _requeue_expired(self) -> None:
        """Every half lease, and as soon as the earliest lease is due a check (half a lease
        before its deadline): a lease that missed a renewal is redone then if its owner's
        process is gone (its owner channel has no subscriber), else when it expires."""
        period_s = self.queue_config.lease_ms / 2000

        def wait_s() -> float:
            next_ms = self.queue.consumer.next_expiry_ms
            return period_s if next_ms is None else min(period_s, next_ms / 1000 + EXPIRY_SLACK_S)
        await self._every(wait_s, self.queue.consumer.requeue_expired)

    async def _heartbeat(self) -> None:
        period_ms = self.config.heartbeat_ms

        async def beat():
            status = {"worker": self.worker_id, "model": self.engine.info.name,
                      "device": str(self.engine.device), "token_budget": self.token_budget,
                      "budget_source": self.budget_source, "batches": self.num_batches}
            async with self._beat_lock:
                if not self.healthy:
                    return
                # Times on the Redis clock (in the script): hosts' clocks may disagree.
                await self.queue.shard(0).heartbeat(self.worker_id, status, ttl_ms=3 * period_ms,
                                                    forget_after_ms=10 * period_ms)
            if self.observer:
                self.observer.heartbeat()
                self.observer.set_budget(self.token_budget)
        await self._every(period_ms / 1000, beat)

    async def _watch_forward(self) -> None:
        """Give up when the running forward is hung: stop vouching for this process (heartbeat
        gone, leases left to expire so the batches are redone elsewhere), then exit."""
        period_s = min(1.0, self.hung_after_s / 4)
        while True:
            await asyncio.sleep(period_s)
            since = self._forward_since
            if since is None or time.monotonic() - since <= self.hung_after_s:
                continue
            async with self._beat_lock:
                self.healthy = False
            self._held.clear()
            log.error("forward running for %.1f s (hung past %.1f s): giving up; exiting %d",
                      time.monotonic() - since, self.hung_after_s, EXIT_HUNG)
            if self.observer:
                self.observer.observe_error("hung")
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.queue.consumer.forget_worker(self.worker_id), timeout=2.0)
            if self._reader is not None:  # no read may be in flight on a connection closed under it
                await cancel_and_wait(self._reader)
            with contextlib.suppress(Exception):  # its owner channels go: leases redone sooner
                await asyncio.wait_for(self._notices.aclose(), timeout=2.0)
            self._exit_process(EXIT_HUNG)
            self.stop()  # only reached when exit_process returns (tests)
            return

    async def _fit_default_budget(self) -> None:
        """No budget set or published: cut the device's default to the latency goal
        (workers/budget.py). Timed after the warm-up, whose first forward pays one-time
        costs."""
        self._fitted = True
        default = default_budget(self.engine.device.type)
        fit = await asyncio.to_thread(fit_budget, timer(self.engine.warmup), default,
                                      max_forward_ms(self.config.latency_goal_ms))
        (log.info if fit.fits else log.warning)("%s; p99 goal %d ms", fit.describe(),
                                                self.config.latency_goal_ms)
        self._unpublished = (fit.budget, "fitted" if fit.budget != default else "default")
        if self.budget_source != "published":  # one published while the fit ran wins
            self.token_budget, self.budget_source = self._unpublished

    async def _refresh_budget_at_start(self) -> None:
        try:
            await self._refresh_budget()
        except _REDIS_ERRORS as exc:  # Redis not up yet, or shard 0's node out: serve meanwhile
            log.warning("reading the shard count and budget failed, read again every %.0f s: %s",
                        BUDGET_REFRESH_S, exc)

    async def _refresh_budget(self) -> None:
        # Also the shards in use: gateways may have raised (or lowered) the shard count.
        before = self.queue.claim_shards
        if await self.queue.refresh_shard_count() != before:
            self._subscribed = False  # listen for work on the new shards too
            # and register on them at the next wait: else their work wakes every idle worker
            self._idle.registered = False
        if self.config.token_budget:
            return
        published = await self.queue.shard(0).get_budget()
        if published is not None and published > 0:
            if published != self.token_budget or self.budget_source != "published":
                log.info("token budget %d -> %d (published)", self.token_budget, published)
                self.token_budget = published
                self.budget_source = "published"
        elif self.budget_source == "published":  # withdrawn (deleted, or not a positive count)
            budget, source = self._unpublished
            log.info("published budget withdrawn: token budget %d -> %d (%s)", self.token_budget,
                     budget, source)
            self.token_budget, self.budget_source = budget, source
            self._refit = not self._fitted and bool(self.config.latency_goal_ms)

    async def _watch_budget(self) -> None:
        await self._every(BUDGET_REFRESH_S, self._refresh_budget)
