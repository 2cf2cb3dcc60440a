"""Queue depth by lane (lua/stats.lua) and why each claim stopped (lua/claim.lua), on a real
Redis, as the worker exports them: tokq_queue_lane_queued_{entries,tokens}{lane} and
tokq_worker_claim_stops_total{reason}."""

from __future__ import annotations

from prometheus_client import REGISTRY
from queue_support import NOTICE_CHANNEL, ManualClock, items, open_queue

from tokq import metrics
from tokq.queue.sharded import ShardedQueue


async def test_stats_count_each_lane_entries_and_tokens(redis_url):
    async with open_queue(redis_url, ManualClock()) as q:
        await q.enqueue("light", items(10, 20), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        await q.enqueue("heavy", items(150, 100), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        await q.enqueue("light2", items(5), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        stats = await q.stats()
        assert stats.lanes == {"light": (3, 35), "heavy": (2, 250), "batch": (0, 0)}
        assert (stats.queued_entries, stats.queued_tokens) == (5, 285)
        sharded = await ShardedQueue.of(q).stats.read()
        assert sharded.lanes == stats.lanes

        metrics.observe_queue_stats(stats, model="lanes-test")
        sample = REGISTRY.get_sample_value
        assert sample("tokq_queue_lane_queued_tokens", {"model": "lanes-test", "lane": "heavy"}) == 250
        assert sample("tokq_queue_lane_queued_entries", {"model": "lanes-test", "lane": "light"}) == 3
        metrics.forget_queue_stats("lanes-test")
        assert sample("tokq_queue_lane_queued_tokens", {"model": "lanes-test", "lane": "heavy"}) is None


async def test_a_long_lane_s_tokens_are_scaled_from_the_shorter_lane_s_head(redis_url):
    async with open_queue(redis_url, ManualClock()) as q:
        await q.enqueue("heavy", items(*[200] * 1_200), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        await q.enqueue("light", items(*[4] * 30), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)  # 120: light
        stats = await q.stats()
        assert stats.lanes == {"light": (30, 120), "heavy": (1_200, 240_000), "batch": (0, 0)}


async def test_each_claim_reports_why_its_batch_stopped_and_the_worker_counts_it(redis_url):
    worker = metrics.WorkerMetrics("stops-test", "w1")
    async with open_queue(redis_url, ManualClock()) as q:
        for i in range(6):
            await q.enqueue(f"l{i}", items(30), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)  # 180 light
        await q.enqueue("h", items(300), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        # A light-only claim refuses 180 light tokens past its 128: a backlog, no batch.
        assert await q.claim(128, lanes="light", on_stop=worker.observe_claim_stop) is None
        # share min(200, 100) = 100: 3 light, the heavy 300 (400); nothing more fits
        claim = await q.claim(400, on_stop=worker.observe_claim_stop)
        assert claim.num_tokens == 390 and claim.num_heavy == 1 and claim.stop == "full"
        claim = await q.claim(400, on_stop=worker.observe_claim_stop)
        assert claim.num_tokens == 90 and claim.stop == "dry"
        assert await q.claim(400, on_stop=worker.observe_claim_stop) is None  # empty: not counted
    sample = REGISTRY.get_sample_value
    labels = {"model": "stops-test", "worker": "w1"}
    assert [sample("tokq_worker_claim_stops_total", labels | {"reason": r})
            for r in ("backlog", "full", "dry")] == [1, 1, 1]
    worker.close()
    assert sample("tokq_worker_claim_stops_total", labels | {"reason": "dry"}) is None
