"""Queue depth by lane (lua/stats.lua) summed over the shards of a ShardedQueue, on a standalone
server and on a cluster: each lane's entries and tokens equal what its lists hold, on shards
where either interactive lane is the shorter one, beside batch-class work, after claims that drop
dead entries and after redos."""

from __future__ import annotations

import pytest
from queue_support import ManualClock, items

from tokq.config import QueueConfig
from tokq.queue.sharded import ShardedQueue
from tokq.queue.wire import parse_entry
from tokq.redis.connection import close_client, connect

pytestmark = pytest.mark.redis_kinds("standalone", "cluster")


async def _held(q: ShardedQueue) -> dict[str, tuple[int, int]]:
    """Each lane's (entries, tokens) as its lists hold them, over every shard."""
    held = {"light": [0, 0], "heavy": [0, 0], "batch": [0, 0]}
    for i in range(q.num_shards):
        k = q.shard(i).keys
        for lane, key in (("light", k.pending), ("heavy", k.heavy), ("batch", k.batch)):
            entries = [parse_entry(raw) for raw in await q.redis.lrange(key, 0, -1)]
            held[lane][0] += len(entries)
            held[lane][1] += sum(e.num_tokens for e in entries)
    return {lane: tuple(v) for lane, v in held.items()}


async def test_lane_depth_summed_over_shards_matches_the_lists(redis_url):
    client = connect(redis_url)
    clock = ManualClock()
    q = ShardedQueue(client, "lanes-sharded", QueueConfig(queue_shards=3, lease_ms=1_000,
                                                          max_attempts=5), clock=clock)
    try:
        # Shard 0: the light lane shorter by entries; shard 1: the heavy lane; shard 2: light only.
        await q.shard(0).enqueue("s0-l", items(7, 9), timeout_ms=60_000, notice_channel="c")
        await q.shard(0).enqueue("s0-h", items(100, 90, 80), timeout_ms=60_000, notice_channel="c")
        await q.shard(0).enqueue("s0-h2", items(200), timeout_ms=60_000, notice_channel="c")
        for r in range(4):
            await q.shard(1).enqueue(f"s1-l{r}", items(3, 5), timeout_ms=60_000, notice_channel="c")
        await q.shard(1).enqueue("s1-h", items(300), timeout_ms=60_000, notice_channel="c")
        await q.shard(2).enqueue("s2-l", items(11), timeout_ms=500, notice_channel="c")
        # Batch-class work on shards 1 and 2, light and heavy sized alike.
        await q.shard(1).enqueue("s1-b", items(4, 150), timeout_ms=60_000, notice_channel="c", priority="batch")
        await q.shard(2).enqueue("s2-b", items(6), timeout_ms=60_000, notice_channel="c", priority="batch")
        stats = await q.stats.read()
        assert stats.lanes == await _held(q) == {"light": (11, 59), "heavy": (5, 770), "batch": (3, 160)}
        assert stats.queued_tokens == 989 and stats.queued_entries == 19

        # A cancelled request's entries stay queued (and counted) until a claim drops them.
        await q.shard(1).cancel("s1-l0")
        assert (await q.stats.read()).lanes == await _held(q)

        # Claims: expired and orphaned entries dropped, batches leased off both lanes.
        clock.advance(1_000)  # s2-l's deadline passed
        leased = [await q.consumer.claim(120) for _ in range(3)]
        assert any(c is not None for c in leased)
        stats = await q.stats.read()
        assert stats.lanes == await _held(q)
        assert stats.queued_tokens == sum(t for _, t in stats.lanes.values())

        # Redone: the leases expire and their items come back at the front of the heavy lane, or
        # of the batch lane for batch-class items.
        clock.advance(5_000)
        requeued, _ = await q.consumer.requeue_expired()
        assert requeued > 0
        stats = await q.stats.read()
        assert stats.lanes == await _held(q)
        assert stats.queued_tokens == sum(t for _, t in stats.lanes.values())
    finally:
        await close_client(client)
