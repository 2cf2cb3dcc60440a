"""The queue's event totals exported as counters (tokq_queue_*_total) only grow by new events,
summed over shards: a shard whose node restarted empty (no persistence, before a failover) must
not pull the sum down, which Prometheus reads as a reset of the whole sum and then counts the
rest of it again as new events (rate() showed 16.7 expired/s for five minutes with none)."""

from __future__ import annotations

from queue_support import items

from tokq.config import QueueConfig
from tokq.redis.connection import connect
from tokq.queue.sharded import ShardedQueue


async def test_a_shard_whose_totals_vanish_does_not_pull_the_sum_down(redis_url):
    client = connect(redis_url)
    q = ShardedQueue(client, "counter-reset", QueueConfig(queue_shards=2))
    try:
        await client.delete(*(q.shard(i).keys.counters for i in range(2)))

        async def enqueue(first: int, last: int) -> dict[int, int]:
            by_shard = {0: 0, 1: 0}
            for r in range(first, last):
                await q.producer.enqueue(f"r{r}", items(3), timeout_ms=60_000, gateway_id="gw")
                by_shard[q.producer.shard_of_request(f"r{r}")] += 1
            return by_shard

        first = await enqueue(0, 20)
        assert min(first.values()) > 0, first  # both shards hold some
        before = (await q.stats.read()).counters["enqueued"]
        assert before == 20
        await client.delete(q.shard(1).keys.counters)  # shard 1's node came back empty
        after_reset = (await q.stats.read()).counters["enqueued"]
        assert after_reset == 20  # not 20 - shard 1's share
        await enqueue(20, 30)
        assert (await q.stats.read()).counters["enqueued"] == 30  # grew by the 10 new events, no more
        # a replica 1 write behind took over shard 0: the sum holds (it jumped by shard 0's whole
        # history when a fall was read as a restart from zero)
        await client.hincrby(q.shard(0).keys.counters, "enqueued", -1)
        assert (await q.stats.read()).counters["enqueued"] == 30
        await enqueue(30, 34)
        assert (await q.stats.read()).counters["enqueued"] == 34
    finally:
        await q.close()
        await client.aclose()
