"""Priority classes on the queue: the classes' names, the ``priority=`` of an enqueue (an
unknown class refused before anything is queued)."""

from __future__ import annotations

import random

import pytest
from queue_support import CHANNEL, ManualClock, all_keys, items, open_queue

from tokq.queue import PRIORITIES
from tokq.queue.sharded import ShardedQueue


def test_the_classes_are_interactive_and_batch():
    assert PRIORITIES == ("interactive", "batch")


async def test_an_unknown_priority_is_refused_and_queues_nothing(redis_url):
    async with open_queue(redis_url, ManualClock()) as q:
        sharded = ShardedQueue.of(q)
        with pytest.raises(ValueError, match="priority"):
            await sharded.producer.enqueue("r1", items(3), timeout_ms=60_000, gateway_id="gw",
                                           priority="urgent")
        with pytest.raises(ValueError, match="priority"):
            await q.enqueue("r2", items(3), timeout_ms=60_000, channel=CHANNEL, priority="BATCH")
        assert sharded.producer.shard_of_request("r1") is None
        assert await all_keys(q) == set()


async def test_producer_enqueue_takes_each_class(redis_url):
    async with open_queue(redis_url, ManualClock()) as q:
        sharded = ShardedQueue(q.redis, q.keys.queue, q.config, rng=random.Random(1))
        for i, priority in enumerate(PRIORITIES):
            await sharded.producer.enqueue(f"r{i}", items(3), timeout_ms=60_000, gateway_id="gw",
                                           priority=priority)
        await sharded.producer.enqueue("r-default", items(3), timeout_ms=60_000, gateway_id="gw")
        assert (await q.stats()).queued_entries == 3
        await sharded.close()
