"""The gateway's side of a model's sharded queue: each request goes whole to one shard (its items
stay together, one script), and its reply, notice and cancel mark are found there by its id.

The shard is the less loaded by queued tokens of two shards picked at random. Loads are read in
the background (one GET per shard every ``LOAD_REFRESH_S``) and bumped locally by each enqueue,
so the pick costs no round trip; two random choices stay balanced on such stale loads where "the
least loaded" would send every gateway to the same shard.
enqueue, collect and cancel are Queue's, run on the request's shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import redis.exceptions

from tokq.queue.priority import DEFAULT_PRIORITY, check_priority
from tokq.queue.shard import Enqueued, Queue, QueueFull, RequestCancelled
from tokq.tasks import stop_tasks

if TYPE_CHECKING:
    from tokq.queue.sharded import ShardedQueue

LOAD_REFRESH_S = 0.1
LOAD_READ_TIMEOUT_S = 0.5  # a shard's load read not answered by then: left out of the picks
SHARD_COUNT_REFRESH_S = 5.0  # how often a gateway records its shard count (ShardedQueue)


class ShardLoads:
    """Each shard's queued tokens, as last read plus what this process enqueued since, and
    whether Redis answered for it: what ``pick`` chooses by."""

    def __init__(self, sharded: ShardedQueue, rng: random.Random) -> None:
        self._sharded = sharded
        self._rng = rng
        num_shards = sharded.num_shards
        self.tokens = [0] * num_shards
        self.unreachable = [False] * num_shards  # its last load read or enqueue failed
        self._since_read = [0] * num_shards  # tokens enqueued since the last read began
        self._read_at = 0.0
        self._task: asyncio.Task | None = None
        self._count_at = -SHARD_COUNT_REFRESH_S

    def pick(self) -> int:
        """The less loaded of two random shards (by queued tokens, as last read + enqueued),
        among those Redis answered for last; all of them if none did."""
        num_shards = self._sharded.num_shards
        if num_shards == 1:
            return 0
        reachable = [i for i in range(num_shards) if not self.unreachable[i]]
        candidates = reachable or range(num_shards)
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if self.tokens[a] <= self.tokens[b] else b

    def add(self, index: int, tokens: int) -> None:
        """``tokens`` enqueued on shard ``index`` by this process."""
        self.tokens[index] += tokens
        self._since_read[index] += tokens

    def maybe_refresh(self) -> None:
        """Start a background read of every shard's load, at most every LOAD_REFRESH_S."""
        if self._sharded.num_shards == 1:
            return
        if time.monotonic() - self._read_at >= LOAD_REFRESH_S and (
                self._task is None or self._task.done()):
            self._read_at = time.monotonic()
            self._task = asyncio.create_task(self.refresh())

    async def refresh(self) -> None:
        sharded = self._sharded
        with contextlib.suppress(Exception):  # stale loads only skew the pick a little
            self._since_read = [0] * sharded.num_shards
            # Each read bounded: a node that stops answering without a reset would hold its GET
            # for the client's retries of the socket timeout (~15 s in a cluster), and with it
            # every shard's update.
            values = await asyncio.gather(*(asyncio.wait_for(sharded.redis.get(k.tokens), LOAD_READ_TIMEOUT_S)
                                            for k in sharded.shard_keys()), return_exceptions=True)
            for i, value in enumerate(values):
                # A shard Redis does not answer for (its node down) is left out of the picks.
                self.unreachable[i] = isinstance(value, Exception)
                if not self.unreachable[i]:  # plus what this process enqueued while GETs ran
                    self.tokens[i] = int(value or 0) + self._since_read[i]
            if time.monotonic() - self._count_at >= SHARD_COUNT_REFRESH_S:
                self._count_at = time.monotonic()
                await sharded.record_shard_count()

    async def close(self) -> None:
        await stop_tasks(self._task)


class Producer:
    """Enqueue, collect, cancel and forget requests, each on the shard it was given."""

    def __init__(self, sharded: ShardedQueue, rng: random.Random) -> None:
        self._sharded = sharded
        self.loads = ShardLoads(sharded, rng)
        self._shard_of_request: dict[str, int] = {}
        # Called with the number of enqueues each round trip to a shard carries (metrics).
        self.observe_enqueues: Callable[[int], None] | None = None
        self._enqueue_hold_s = 0.0

    # -- each shard's enqueue pipelining (tokq.redis.pipeline) --------------------------------
    @property
    def enqueue_hold_s(self) -> float:
        """tokq.redis.pipeline's ``hold_s`` on every shard (the gateway sets it; 0: never hold)."""
        return self._enqueue_hold_s

    @enqueue_hold_s.setter
    def enqueue_hold_s(self, seconds: float) -> None:
        self._enqueue_hold_s = seconds
        for queue in self._sharded.shards_made():
            queue.pipeliner.hold_s = seconds

    def tune(self, queue: Queue) -> None:
        """A new shard's pipeliner set up as every other's (ShardedQueue.shard calls it)."""
        queue.pipeliner.observe = self._observe_enqueues
        queue.pipeliner.hold_s = self._enqueue_hold_s

    def _observe_enqueues(self, num_requests: int) -> None:
        if self.observe_enqueues is not None:
            self.observe_enqueues(num_requests)

    # -- requests -----------------------------------------------------------------------------
    def shard_of_request(self, request_id: str) -> int | None:
        return self._shard_of_request.get(request_id)

    def reply_key(self, request_id: str) -> str:
        return self._sharded.shard(self._shard_of_request.get(request_id, 0)).keys.reply(request_id)

    async def enqueue(self, request_id: str, items: Sequence[tuple[int, bytes]], *,
                      timeout_ms: int, gateway_id: str,
                      priority: str = DEFAULT_PRIORITY) -> Enqueued:
        """Queue the request on one shard; its completion notice comes on that shard's
        ``notice_channel(gateway_id)``. Every enqueue must end in ``collect`` or ``cancel``.
        ``priority``: one of tokq.queue.PRIORITIES (ValueError otherwise, nothing queued)."""
        check_priority(priority)
        self.loads.maybe_refresh()
        index = self.loads.pick()
        # Recorded before the script runs: a call cancelled mid-enqueue is still cancelled
        # on the shard that may have queued it.
        self._shard_of_request[request_id] = index
        shard = self._sharded.shard(index)
        try:
            enqueued = await shard.enqueue(request_id, items, timeout_ms=timeout_ms,
                                           notice_channel=shard.keys.notice_channel(gateway_id),
                                           priority=priority)
        except (ValueError, QueueFull, RequestCancelled):  # nothing queued or to cancel: else kept for good
            self._shard_of_request.pop(request_id, None)
            raise
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            self.loads.unreachable[index] = True  # till a load read reaches it again
            raise
        self.loads.add(index, sum(t for t, _ in items))
        return enqueued

    async def collect(self, request_id: str) -> dict[int, bytes]:
        index = self._shard_of_request.get(request_id, 0)
        raw = await self._sharded.shard(index).collect(request_id)
        self._shard_of_request.pop(request_id, None)
        return raw

    async def cancel(self, request_id: str, *, enqueue_answered: bool = True) -> bool:
        index = self._shard_of_request.pop(request_id, 0)
        return await self._sharded.shard(index).cancel(request_id, enqueue_answered=enqueue_answered)

    def forget(self, request_id: str) -> None:
        """Drop a request's shard without touching Redis (rejected whole, or its results came
        in the completion notice: nothing left to collect)."""
        self._shard_of_request.pop(request_id, None)
