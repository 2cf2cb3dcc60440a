"""A model's queue as S shards, each a ``Queue`` with its own hash tag: which shard holds what,
and how many shards are in use. What uses it goes through one of its sides: ``producer``
(gateways, tokq/queue/producer.py), ``consumer`` (workers, tokq/queue/consumer.py) and
``stats`` (metrics, tokq/queue/stats.py).

One queue is one hash slot, so one Redis core: a claim costs Redis tens of microseconds, which
caps one model's fleet however many nodes a cluster has. S shards land on different nodes.

- Routing: a request goes to the shard its gateway picked (and records by request id), a batch
  to the shard its id starts with (``<shard>.<id>``). Shard 0 is the unsharded queue, and holds
  the model-wide keys (budget, worker registry and heartbeats, shard counts).
- Changing S live loses nothing: every gateway records its S in ``shard_counts`` (last seen,
  ms). Workers claim from the most shards any gateway used within ``SHARD_COUNT_HORIZON_MS``,
  and from an older count's shards while they hold entries or leases (a deadline may outlast
  the horizon, a fleet may be down as long); requests and batches are routed by their ids, not
  by the current S.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from dataclasses import replace

from tokq.config import QueueConfig
from tokq.queue.consumer import Consumer
from tokq.queue.keys import MAX_SHARDS, QueueKeys, shard_queue_name
from tokq.queue.producer import Producer
from tokq.queue.shard import Queue
from tokq.queue.stats import SummedStats

SHARD_COUNT_HORIZON_MS = 3_600_000  # an hour; an older count's shards are claimed till empty


class ShardedQueue:
    """The shards of one model's queue (see the module doc)."""

    def __init__(self, redis, queue: str, config: QueueConfig = QueueConfig(), *,
                 clock=None, rng: random.Random | None = None) -> None:
        if not 1 <= config.queue_shards <= MAX_SHARDS:
            raise ValueError(f"queue_shards must be in 1..{MAX_SHARDS}, got {config.queue_shards}")
        self.redis = redis
        self.name = queue
        self.config = config
        self._clock = clock
        self._shards: dict[int, Queue] = {}
        self._batch_token = secrets.token_hex(8)
        self.num_shards = config.queue_shards  # gateways enqueue to these
        self.claim_shards = config.queue_shards  # workers claim from these (refresh_shard_count)
        rng = rng or random.Random()
        self.consumer = Consumer(self, rng)
        self.producer = Producer(self, rng)
        self.stats = SummedStats(self)

    # -- shards -----------------------------------------------------------------------------
    def shard(self, index: int) -> Queue:
        """The Queue of shard ``index`` (made on first use: any index a batch id names)."""
        if index not in self._shards:
            # Batch ids name their shard; the token keeps them unique across processes.
            queue = Queue(self.redis, shard_queue_name(self.name, index), self.config,
                          clock=self._clock, batch_prefix=f"{index}.{self._batch_token}")
            self.producer.tune(queue)
            self._shards[index] = queue
        return self._shards[index]

    def shards_made(self) -> list[Queue]:
        """Every shard's Queue made so far."""
        return list(self._shards.values())

    @property
    def keys(self) -> QueueKeys:
        """Shard 0's keys: the model-wide ones (budget, workers, heartbeats, shard counts)."""
        return self.shard(0).keys

    def shard_keys(self) -> list[QueueKeys]:
        return [self.shard(i).keys for i in range(self.num_shards)]

    @classmethod
    def of(cls, queue: Queue) -> ShardedQueue:
        """A one-shard ShardedQueue over an existing Queue (its batch ids name no shard: 0)."""
        sharded = cls(queue.redis, queue.keys.queue, replace(queue.config, queue_shards=1))
        sharded._shards[0] = queue
        return sharded

    @staticmethod
    def shard_of_batch(batch_id: str) -> int:
        return int(batch_id.split(".", 1)[0]) if "." in batch_id else 0

    async def close(self) -> None:
        await self.producer.loads.close()
        for queue in self._shards.values():  # their pipeliners' held connections, back now
            await queue.pipeliner.aclose()

    # -- shards in use ----------------------------------------------------------------------
    async def record_shard_count(self) -> None:
        """Tell workers this many shards are in use now (ZADD: the member's time only grows)."""
        now_ms = int(time.time() * 1000)
        await self.redis.zadd(self.keys.shard_counts, {str(self.num_shards): now_ms})

    async def refresh_shard_count(self) -> int:
        """Claim from the most shards any gateway used within the horizon (or this config's,
        if more), and from an older count's shards while they still hold entries or leases;
        forget older counts once they do not. Returns the shard count claimed from."""
        key = self.keys.shard_counts
        cutoff_ms = int(time.time() * 1000) - SHARD_COUNT_HORIZON_MS
        counts = [(int(m), score) for m, score in await self.redis.zrange(key, 0, -1, withscores=True)]
        n = max([self.config.queue_shards, *(c for c, score in counts if score > cutoff_ms)])
        top = max([n, *(c for c, _ in counts)])
        # A deadline may outlast the horizon (a call's may be up to 24 h: max_timeout_ms), and a fleet may
        # be down for longer: dropped at the horizon, such shards' work was never claimed.
        if top > n and await self._hold_work(range(n, top)):
            n = top
        else:  # by score: a count a gateway records again meanwhile stays
            await self.redis.zremrangebyscore(key, 0, cutoff_ms)
        # Shards no longer claimed from: out of their wake-up sets, else this process's id stays
        # there for good. One that fails is claimed from until the next refresh, which tries again.
        retired = range(n, self.claim_shards)
        left = await asyncio.gather(*(self.shard(i).mark_idle(False) for i in retired),
                                    *(self.shard(i).mark_preemptible(False) for i in retired),
                                    return_exceptions=True)
        if any(isinstance(r, BaseException) for r in left):
            n = self.claim_shards
        self.claim_shards = n
        return n

    async def _hold_work(self, shards: range) -> bool:
        """Whether any of ``shards`` holds queued entries or leases (one that cannot be read
        may: True)."""
        answers = await asyncio.gather(*(self.redis.exists(k.pending, k.heavy, k.batch, k.leases)
                                         for k in (self.shard(i).keys for i in shards)),
                                       return_exceptions=True)
        return any(isinstance(a, BaseException) or a > 0 for a in answers)
