"""A worker: serves one model's queue on one device, from start-up to stop or give-up.

It starts by reading the shard count and budget, warming up (and fitting the default budget to
the latency goal), capturing CUDA graphs and subscribing to its notices; then it runs the claim
loop (workers/loop.py) beside its chores: lease renewals and requeues (workers/leases.py), the
heartbeat (workers/heartbeat.py), the shard count and budget reads (workers/budget.py) and the
notice reader (workers/wake.py).

A forward that runs far past its expected time (a hung device) makes the worker give up: its
heartbeat goes, its leases are no longer renewed (so its batches are redone elsewhere) and the
process exits non-zero for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable

from tokq.config import QueueConfig, WorkerConfig
from tokq.queue.shard import Queue
from tokq.queue.sharded import ShardedQueue
from tokq.tasks import stop_tasks
from tokq.workers.budget import BUDGET_REFRESH_S, TokenBudget
from tokq.workers.chores import REDIS_ERRORS, every
from tokq.workers.heartbeat import Heartbeat
from tokq.workers.leases import Leases
from tokq.workers.loop import ClaimLoop
from tokq.workers.runner import BatchRunner
from tokq.workers.wake import WakeUps

log = logging.getLogger("tokq.worker")

# A forward is hung past max(hung_forward_ms, HUNG_FACTOR x the warm-up forward at the full
# budget); the process then exits with EXIT_HUNG.
HUNG_FACTOR = 20.0
EXIT_HUNG = 3


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
        self.worker_id = worker_id or default_worker_id(engine.device)
        self.observer = observer
        self.healthy = True  # False once it gave up on a hung forward
        self.hung_after_s = config.hung_forward_ms / 1000
        self._exit_process = exit_process  # os._exit: a hung forward thread cannot be joined
        healthy = lambda: self.healthy  # noqa: E731 - read by every part as it runs
        self.budget = TokenBudget(engine, config, queue, queue_config.light_tokens)
        self.leases = Leases(queue.consumer, queue_config.lease_ms, healthy=healthy, observer=observer)
        self.wake = WakeUps(queue, healthy=healthy)
        self.heartbeat = Heartbeat(queue, self.worker_id, config.heartbeat_ms, status=self.status,
                                   budget=self.budget, healthy=healthy, observer=observer)
        self.loop = ClaimLoop(queue, BatchRunner(engine, observer=observer, exit=exit_process),
                              self.budget, self.leases, self.wake, healthy=healthy, observer=observer)

    def stop(self) -> None:
        """Stop claiming; the batches in hand are finished and acknowledged."""
        self.loop.stop()

    def status(self) -> dict:
        """What the heartbeat tells the registry."""
        return {"worker": self.worker_id, "model": self.engine.info.name,
                "device": str(self.engine.device), "token_budget": self.budget.tokens,
                "budget_source": self.budget.source, "batches": self.loop.num_batches}

    async def run(self, *, burst: bool = False) -> None:
        await self._refresh_at_start()
        start = time.perf_counter()
        await asyncio.to_thread(self.engine.warmup, self.budget.tokens)
        self.hung_after_s = max(self.hung_after_s, HUNG_FACTOR * (time.perf_counter() - start))
        if self.budget.source == "default" and self.config.latency_goal_ms:
            await self.budget.fit_default()
            await self._refresh_at_start()  # one published meanwhile wins
        start = time.perf_counter()
        if captured := await asyncio.to_thread(self.engine.capture_graphs, self.budget.tokens):
            log.info("captured %d CUDA graphs of short-query batch shapes in %.1f s", captured,
                     time.perf_counter() - start)
        await self.wake.subscribe()  # before the first claim, so no notice falls in between
        chores = [asyncio.create_task(c) for c in (
            self.leases.renew_held(), self.leases.redo_expired(), self.heartbeat.beat(),
            every(BUDGET_REFRESH_S, self._refresh_shards_and_budget), self._watch_forward())]
        chores.append(self.wake.start_reading())
        try:
            await self.loop.run(burst)
        finally:
            await stop_tasks(chores)  # again until they end: tokq/tasks.py
            await self.wake.close()
            with contextlib.suppress(Exception):
                await self.queue.consumer.forget_worker(self.worker_id)

    async def _refresh_shards_and_budget(self) -> None:
        """The shards in use (gateways may have changed their count), then the budget."""
        await self.wake.follow_shard_count()
        await self.budget.read_published()

    async def _refresh_at_start(self) -> None:
        try:
            await self._refresh_shards_and_budget()
        except REDIS_ERRORS as exc:  # Redis not up yet, or shard 0's node out: serve meanwhile
            log.warning("reading the shard count and budget failed, read again every %.0f s: %s",
                        BUDGET_REFRESH_S, exc)

    async def _watch_forward(self) -> None:
        """Give up when the running forward is hung: stop vouching for this process (heartbeat
        gone, leases left to expire so the batches are redone elsewhere), then exit."""
        period_s = min(1.0, self.hung_after_s / 4)
        while True:
            await asyncio.sleep(period_s)
            since = self.loop.forward_since
            if since is None or time.monotonic() - since <= self.hung_after_s:
                continue
            async with self.heartbeat.lock:
                self.healthy = False
            self.leases.held.clear()
            log.error("forward running for %.1f s (hung past %.1f s): giving up; exiting %d",
                      time.monotonic() - since, self.hung_after_s, EXIT_HUNG)
            if self.observer:
                self.observer.observe_error("hung")
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.queue.consumer.forget_worker(self.worker_id), timeout=2.0)
            await self.wake.stop_reading()
            with contextlib.suppress(Exception):  # its worker channels go: leases redone sooner
                await asyncio.wait_for(self.wake.close(), timeout=2.0)
            self._exit_process(EXIT_HUNG)
            self.stop()  # only reached when exit_process returns (tests)
            return
