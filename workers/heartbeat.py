"""A worker's heartbeat: its status (model, device, budget, batches) in the model's worker registry
every ``heartbeat_ms``, alive for three periods, on the Redis clock (hosts' clocks may disagree).
Workers register once per model, on shard 0's keys, whatever the shard count. A worker that gave
up (a hung forward, workers/worker.py) beats no more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tokq.queue.sharded import ShardedQueue
from tokq.workers.budget import TokenBudget
from tokq.workers.chores import every


class Heartbeat:
    """``beat()`` runs the heartbeat; ``lock`` is held by each beat, so that a give-up taken
    under it sees no beat in flight after it."""

    def __init__(self, queue: ShardedQueue, worker_id: str, period_ms: int, *,
                 status: Callable[[], dict], budget: TokenBudget, healthy: Callable[[], bool],
                 observer=None) -> None:
        self.queue = queue
        self.worker_id = worker_id
        self.period_ms = period_ms
        self.status = status
        self.budget = budget
        self.healthy = healthy
        self.observer = observer
        self.lock = asyncio.Lock()  # a beat in flight must not outlive a give-up

    async def beat(self) -> None:
        """Chore: a beat every ``period_ms``; silent workers forgotten after ten periods."""
        period_ms = self.period_ms

        async def beat():
            status = self.status()
            async with self.lock:
                if not self.healthy():
                    return
                # Times on the Redis clock (in the script): hosts' clocks may disagree.
                await self.queue.shard(0).heartbeat(self.worker_id, status, ttl_ms=3 * period_ms,
                                                    forget_after_ms=10 * period_ms)
            if self.observer:
                self.observer.heartbeat()
                self.observer.set_budget(self.budget.tokens)
        await every(period_ms / 1000, beat)
