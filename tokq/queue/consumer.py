"""The workers' side of a model's sharded queue: claims from the shards in use, in rotation, and a
worker's place on each of them (wake-up sets, worker and work channels, its registry entry).

Claims go round the shards, starting after the shard that served the last batch, so no non-empty
shard waits more than S-1 claims; still one budget-bounded batch from one shard per claim. A
batch id starts with its shard (``<shard>.<id>``): ack and renew go there.
claim, renew, ack, requeue_expired, mark_idle, mark_preemptible and forget_worker are Queue's,
run on the batch's shard or on every shard claimed from.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

import redis.exceptions

from tokq.queue.claim_rule import Lanes
from tokq.queue.shard import Claim, Queue
from tokq.queue.wire import Entry

if TYPE_CHECKING:
    from tokq.queue.sharded import ShardedQueue


class Consumer:
    """What a worker does on a model's queue, over ``ShardedQueue.claim_shards`` shards."""

    def __init__(self, sharded: ShardedQueue, rng: random.Random) -> None:
        self._sharded = sharded
        self._next_claim = rng.randrange(sharded.num_shards)  # where the rotation goes on

    def _claimed(self) -> list[Queue]:
        return [self._sharded.shard(i) for i in range(self._sharded.claim_shards)]

    async def claim(self, token_budget: int, *, lookahead: int | None = None,
                    lanes: Lanes = "both", on_stop: Callable[[str], object] | None = None,
                    after_isolated: Collection[int] = (), bulk_forward: bool = False) -> Claim | None:
        """One batch from the next non-empty shard in rotation; None when all are empty. A
        shard whose node is down (failing over) is passed over, so the others keep being
        served; a claim that may have run there is redone when its lease expires. Raises
        only when every shard failed. ``on_stop``: as Queue.claim's, for each shard asked;
        ``after_isolated``: the shards whose claim is Queue.claim's ``after_isolated``;
        ``bulk_forward``: as Queue.claim's."""
        n = self._sharded.claim_shards
        errors: list[Exception] = []
        for step in range(n):
            index = (self._next_claim + step) % n
            try:
                claim = await self._sharded.shard(index).claim(token_budget, lookahead=lookahead,
                                                               lanes=lanes, on_stop=on_stop,
                                                               after_isolated=index in after_isolated,
                                                               bulk_forward=bulk_forward)
            except redis.exceptions.RedisError as exc:
                errors.append(exc)
                continue
            if claim is not None:
                self._next_claim = (index + 1) % n
                return claim
        if len(errors) == n:
            raise errors[-1]
        return None

    async def renew(self, batch_id: str) -> bool:
        return await self._sharded.shard(self._sharded.shard_of_batch(batch_id)).renew(batch_id)

    async def ack(self, batch_id: str, results: Sequence[tuple[Entry, bytes]], *,
                  partial: bool = False) -> None:
        await self._sharded.shard(self._sharded.shard_of_batch(batch_id)).ack(batch_id, results,
                                                                             partial=partial)

    async def requeue_expired(self) -> tuple[int, int]:
        """Every shard's expired leases redone; a shard whose node is out does not stop the
        others' (its error is raised once they have all run)."""
        done = await _on_every_shard(q.requeue_expired() for q in self._claimed())
        return sum(r for r, _ in done), sum(f for _, f in done)

    @property
    def next_expiry_ms(self) -> int | None:
        """Ms until the earliest lease on any shard is due a check, as the last requeue saw it."""
        known = [q.next_expiry_ms for q in self._claimed() if q.next_expiry_ms is not None]
        return min(known, default=None)

    def worker_channels(self) -> list[str]:
        """Every claimed shard's worker channel (Queue.worker_channel) of this process."""
        return [q.worker_channel for q in self._claimed()]

    def work_channels(self) -> list[str]:
        """The channels an idle worker listens on: every shard it claims from."""
        return [q.keys.work_channel for q in self._claimed()]

    async def mark_idle(self, idle: bool) -> None:
        """Queue.mark_idle on every claimed shard."""
        await _on_every_shard(q.mark_idle(idle) for q in self._claimed())

    async def mark_preemptible(self, preemptible: bool) -> None:
        """Queue.mark_preemptible on every claimed shard."""
        await _on_every_shard(q.mark_preemptible(preemptible) for q in self._claimed())

    async def forget_worker(self, worker_id: str) -> None:
        """The worker's heartbeat and registry entry gone (on shard 0's keys, as heartbeats are),
        and this process out of every claimed shard's wake-up sets."""
        await self._sharded.shard(0).forget_worker(worker_id)
        others = self._claimed()[1:]
        await asyncio.gather(*(q.mark_idle(False) for q in others),
                             *(q.mark_preemptible(False) for q in others))


async def _on_every_shard(commands) -> list:
    """Run one command per shard at once and return their answers; raise the first failure only
    once every shard has answered: returning earlier, a later command (a cancel) could
    overtake one still out, and one shard's node out would stop the others' work midway."""
    results = await asyncio.gather(*commands, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
