"""The worker loop: claim a batch up to the token budget -> pack -> forward -> ack.

The forward runs in a thread (torch releases the GIL), so while it runs the event loop claims
the next batch, renews the leases in hand, requeues crashed workers' leases and beats the
heartbeat: the device never waits on Redis, and Redis never waits on the device.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time

import redis.exceptions

from tokq.config import QueueConfig, WorkerConfig
from tokq.queue import Claim, Queue
from tokq.shards import ShardedQueue
from tokq.workers.runner import BatchOutcome, BatchRunner

log = logging.getLogger("tokq.worker")

DEFAULT_BUDGET = {"cpu": 1024, "cuda": 4096}  # used until `tokq profile --apply` publishes one
IDLE_POLL_S = 0.002
REDIS_RETRY_S = 0.2
ACK_ATTEMPTS = 10
# Any Redis failure, -READONLY after a failover or -OOM included: wait and retry, never exit.
_REDIS_ERRORS = (redis.exceptions.RedisError, OSError)
BUDGET_REFRESH_S = 1.0


# The next claim starts at PREFETCH_AT of the expected forward time, less PREFETCH_CLAIMS
# expected claim round trips.
PREFETCH_AT = 0.8
PREFETCH_CLAIMS = 2.0


def _ewma(avg: float, value: float, weight: float = 0.2) -> float:
    return value if avg == 0.0 else (1 - weight) * avg + weight * value


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Worker:
    def __init__(self, engine, queue: ShardedQueue | Queue, config: WorkerConfig, queue_config: QueueConfig,
                 worker_id: str | None = None, observer=None) -> None:
        self.engine = engine
        if isinstance(queue, Queue):  # one unsharded queue
            queue = ShardedQueue.of(queue)
        self.queue = queue
        self.config = config
        self.queue_config = queue_config
        self.worker_id = worker_id or default_worker_id()
        self.observer = observer
        self.runner = BatchRunner(engine, observer=observer)
        self.budget = config.token_budget or DEFAULT_BUDGET.get(engine.device.type, 1024)
        self._held: set[str] = set()  # batch ids whose leases we renew
        self._stop = asyncio.Event()
        self.num_batches = 0
        self._forward_s_avg = 0.0  # moving averages that time the prefetching claim
        self._claim_s_avg = 0.0

    def stop(self) -> None:
        """Stop claiming; the batches in hand are finished and acknowledged."""
        self._stop.set()

    # -- the loop -----------------------------------------------------------------------------

    async def run(self, *, burst: bool = False) -> None:
        await self._refresh_budget()
        await asyncio.to_thread(self.engine.warmup, self.budget)
        chores = [asyncio.create_task(c) for c in (self._renew_leases(), self._requeue_expired(),
                                                   self._heartbeat(), self._watch_budget())]
        try:
            await self._loop(burst)
        finally:
            for task in chores:
                task.cancel()
            await asyncio.gather(*chores, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.queue.redis.delete(self.queue.keys.heartbeat(self.worker_id))
                await self.queue.redis.zrem(self.queue.keys.workers, self.worker_id)

    async def _loop(self, burst: bool) -> None:
        next_claim: asyncio.Task | None = asyncio.create_task(self._claim())
        while next_claim is not None:
            claim = await next_claim
            next_claim = None
            if claim is None:
                if self._stop.is_set() or (burst and await self._drained()):
                    break
                await asyncio.sleep(IDLE_POLL_S)
                next_claim = asyncio.create_task(self._claim())
                continue
            forward = asyncio.create_task(asyncio.to_thread(self.run_batch, claim))
            if not self._stop.is_set():
                # Overlap the next claim with the end of this forward: late enough that it
                # takes what arrived meanwhile (fuller batches), early enough that the device
                # does not wait on Redis.
                next_claim = asyncio.create_task(self._claim(delay_s=self._prefetch_delay_s()))
            outcome = await forward
            self._forward_s_avg = _ewma(self._forward_s_avg, outcome.forward_s)
            await self._ack(claim, outcome)
            self._held.discard(claim.batch_id)
            self.num_batches += 1
            if self.observer:
                self.observer.observe_batch(outcome.seqlens, budget_tokens=self.budget,
                                            forward_s=outcome.forward_s)
                for _ in range(outcome.num_failed):
                    self.observer.observe_error("item")

    async def _ack(self, claim: Claim, outcome: BatchOutcome) -> None:
        for attempt in range(ACK_ATTEMPTS):
            try:
                await self.queue.ack(claim.batch_id, outcome.results)
                return
            except _REDIS_ERRORS as exc:
                log.warning("ack of batch %s failed (%s), attempt %d", claim.batch_id, exc, attempt + 1)
                if self.observer:
                    self.observer.observe_error("redis")
                await asyncio.sleep(REDIS_RETRY_S)
        # Give up: the lease expires and another worker redoes the batch (acks are idempotent).
        log.error("batch %s not acknowledged; it will be redone after its lease", claim.batch_id)

    def _prefetch_delay_s(self) -> float:
        return max(0.0, PREFETCH_AT * self._forward_s_avg - PREFETCH_CLAIMS * self._claim_s_avg)

    async def _claim(self, delay_s: float = 0.0) -> Claim | None:
        if delay_s > 0:
            with contextlib.suppress(TimeoutError):  # SIGTERM: stop waiting, claim nothing new
                await asyncio.wait_for(self._stop.wait(), timeout=delay_s)
            if self._stop.is_set():
                return None
        start = time.perf_counter()
        try:
            claim = await self.queue.claim(self.budget)
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
        stats = await self.queue.stats()
        return stats.queued_entries == 0 and stats.inflight_items == 0

    # -- compute (runs in a thread) -----------------------------------------------------------

    def run_batch(self, claim: Claim) -> BatchOutcome:
        return self.runner.run(claim)  # failures, retries, device errors: workers/runner.py

    # -- chores -------------------------------------------------------------------------------

    async def _every(self, period_s: float, chore) -> None:
        while True:
            try:
                await chore()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis blips must not kill the worker
                log.warning("%s failed: %s", chore.__name__, exc)
            await asyncio.sleep(period_s)

    async def _renew_leases(self) -> None:
        async def renew():
            for batch_id in list(self._held):
                if not await self.queue.renew(batch_id) and batch_id in self._held:
                    # Requeued already (we stalled past the lease): another worker may redo it;
                    # our ack still counts once, the first answer wins.
                    log.warning("lease of batch %s expired before it finished", batch_id)
        await self._every(self.queue_config.lease_ms / 3000, renew)

    async def _requeue_expired(self) -> None:
        await self._every(self.queue_config.lease_ms / 2000, self.queue.requeue_expired)

    async def _heartbeat(self) -> None:
        keys = self.queue.keys
        period_ms = self.config.heartbeat_ms

        async def beat():
            status = {"worker": self.worker_id, "model": self.engine.info.name,
                      "device": str(self.engine.device), "budget": self.budget,
                      "batches": self.num_batches, "ts": time.time()}
            async with self.queue.redis.pipeline(transaction=False) as pipe:
                pipe.set(keys.heartbeat(self.worker_id), json.dumps(status), px=3 * period_ms)
                now_ms = int(time.time() * 1000)
                pipe.zadd(keys.workers, {self.worker_id: now_ms})
                # Forget workers silent for 10 heartbeats (crashed ones never remove themselves).
                pipe.zremrangebyscore(keys.workers, "-inf", now_ms - 10 * period_ms)
                await pipe.execute()
            if self.observer:
                self.observer.heartbeat()
                self.observer.set_budget(self.budget)
        await self._every(period_ms / 1000, beat)

    async def _refresh_budget(self) -> None:
        # Also the shards in use: gateways may have raised (or lowered) the shard count.
        await self.queue.refresh_shard_count()
        if self.config.token_budget:
            return
        published = await self.queue.get_budget()
        if published and published != self.budget:
            log.info("token budget %d -> %d (published)", self.budget, published)
            self.budget = published

    async def _watch_budget(self) -> None:
        await self._every(BUDGET_REFRESH_S, self._refresh_budget)
