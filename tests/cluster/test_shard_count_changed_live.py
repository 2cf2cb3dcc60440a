"""Changing a model's queue shard count live (tokq.queue.sharded): what a retired shard still holds is
claimed and counted however long after its count was last recorded, and a process that stops
claiming from it leaves nothing of its own there. Standalone and cluster."""

from __future__ import annotations

import contextlib
import time

import pytest
from queue_support import QUEUE, ManualClock, items, ok_result

from tokq.config import QueueConfig
from tokq.redis.connection import close_client, connect
from tokq.queue.sharded import SHARD_COUNT_HORIZON_MS, ShardedQueue

pytestmark = pytest.mark.redis_kinds("standalone", "cluster")
GW = "gw-test"
LEASE_MS = 1_000


@contextlib.asynccontextmanager
async def sharded(url: str, num_shards: int, clock: ManualClock | None = None):
    client = connect(url)
    q = ShardedQueue(client, QUEUE, QueueConfig(queue_shards=num_shards, lease_ms=LEASE_MS),
                     clock=clock)
    try:
        yield q
    finally:
        await q.close()
        await close_client(client)


async def _age_past_the_horizon(q: ShardedQueue, num_shards: int) -> None:
    """The gateways with ``num_shards`` last recorded it over an hour ago."""
    old_ms = int(time.time() * 1000) - SHARD_COUNT_HORIZON_MS - 1_000
    await q.redis.zadd(q.keys.shard_counts, {str(num_shards): old_ms})


async def _enqueue_on(q: ShardedQueue, shard: int, request_id: str, timeout_ms: int = 60_000) -> None:
    queue = q.shard(shard)
    await queue.enqueue(request_id, items(5), timeout_ms=timeout_ms, notice_channel=queue.keys.notice_channel(GW))


async def test_a_retired_shard_s_work_outlasting_the_horizon_is_still_claimed_and_redone(redis_url):
    """A 4-shard gateway went quiet over an hour ago, its calls (deadlines may be up to 24 h)
    still queued on shards 2 and 3, one claimed by a worker that died. Workers configured for 2
    shards claim from all 4 until those shards hold nothing (before, they dropped them at the
    horizon: the calls hung, the entries and the lease stayed in Redis for good, the gauges left
    them out), then forget the old count."""
    clock = ManualClock()
    async with sharded(redis_url, 4, clock) as gw4, sharded(redis_url, 2, clock) as worker, \
            sharded(redis_url, 4, clock) as dead:
        await _enqueue_on(gw4, 2, "queued", timeout_ms=2 * 3_600_000)
        await _enqueue_on(gw4, 3, "leased", timeout_ms=2 * 3_600_000)
        assert (await dead.shard(3).claim(100)).entries[0].request_id == "leased"
        await gw4.record_shard_count()
        await _age_past_the_horizon(gw4, 4)

        assert await worker.refresh_shard_count() == 4
        stats = await worker.stats.read()
        assert (stats.queued_entries, stats.inflight_items) == (1, 1)
        clock.advance(LEASE_MS + 1)
        assert await worker.consumer.requeue_expired() == (1, 0)
        answered = []
        while (claim := await worker.consumer.claim(100)) is not None:
            answered += [e.request_id for e in claim.entries]
            await worker.consumer.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        assert sorted(answered) == ["leased", "queued"]
        assert list(await gw4.shard(2).collect("queued")) == [0]
        assert list(await gw4.shard(3).collect("leased")) == [0]

        assert await worker.refresh_shard_count() == 2  # empty now: the old count goes
        assert await worker.redis.zrange(worker.keys.shard_counts, 0, -1) == []


async def test_the_event_totals_keep_a_retired_shard_s_counts_once_it_is_no_longer_read(redis_url):
    """The exporter's totals must not fall when a drained retired shard leaves the sum: Prometheus
    takes a fall for a counter reset, and rate() for a burst of every event counted since."""
    async with sharded(redis_url, 4) as gw4, sharded(redis_url, 2) as exporter:
        await gw4.record_shard_count()
        for r in range(3):
            await _enqueue_on(gw4, 3, f"r{r}")
        assert await exporter.refresh_shard_count() == 4
        claim = await exporter.consumer.claim(100)
        await exporter.consumer.ack(claim.batch_id, [(e, ok_result(e)) for e in claim.entries])
        before = (await exporter.stats.read()).counters
        assert before["enqueued"] == before["acked"] == 3
        await _age_past_the_horizon(gw4, 4)
        assert await exporter.refresh_shard_count() == 2
        after = await exporter.stats.read()
        assert after.num_shards == 2 and after.counters == before


async def test_a_worker_leaves_the_wake_up_sets_of_the_shards_it_stops_claiming_from(redis_url):
    """Registered idle and pre-emptible on 4 shards, a worker whose claim count falls to 1 leaves
    shards 1..3's sets (before, its id stayed there for good: nothing withdraws it later)."""
    async with sharded(redis_url, 4) as gw4, sharded(redis_url, 1) as worker:
        await gw4.record_shard_count()
        assert await worker.refresh_shard_count() == 4
        await worker.consumer.mark_idle(True)
        await worker.consumer.mark_preemptible(True)
        await _age_past_the_horizon(gw4, 4)
        assert await worker.refresh_shard_count() == 1

        async def member(shard: int, set_name: str) -> bool:
            queue = worker.shard(shard)
            return bool(await worker.redis.sismember(getattr(queue.keys, set_name), queue.batch_prefix))
        assert [await member(i, "idle") for i in range(4)] == [True, False, False, False]
        assert [await member(i, "preemptible") for i in range(4)] == [True, False, False, False]
