"""Queries claimed beside batch-class work do not wait for the bulk forward (workers/loop.py
``split_interactive``): the claim's interactive entries run first, as their own forward, and are
answered at once (a partial ack, the lease kept); then the batch-class part runs, pre-emptible.
In process, with a real Redis and the real bundled model; the order is forced with events."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from gated_engine import HEAVY_TOKENS, GatedEngine
from gated_worker import enqueue_batch_class, fp32_engine, token_ids, worker_rig
from queue_support import answered_vectors, enqueue_ids, wait_for

from tokq.batch import PackedBatch
from tokq.queue.shard import REPLY_META_FIELDS, parse_notices
from tokq.queue.wire import decode_result
from tokq.redis.pubsub import ShardedSubscriber

pytestmark = pytest.mark.slow


LIGHT_DELAY_S = 0.3  # each light forward's extra time: the bulk part's queue time must count it


@pytest.fixture(scope="module")
def engine():
    return fp32_engine()


class SlowLightEngine(GatedEngine):
    def embed(self, batch):
        if batch.num_tokens <= HEAVY_TOKENS:
            time.sleep(LIGHT_DELAY_S)
        return super().embed(batch)


async def _timing(q, request_id: str) -> tuple[float, float]:
    """Item 0's (queue_ms, inference_ms), read once answered."""
    await wait_for(lambda: q.redis.hexists(q.keys.reply(request_id), "0"), 60, f"{request_id}'s answer")
    result = decode_result(await q.redis.hget(q.keys.reply(request_id), "0"))
    return result.queue_ms, result.inference_ms


async def start_behind_bulk(rig, gated, bulk_ids, queries: dict):
    """A worker on ``gated``, started once the bulk work and then the queries are queued: its
    first claim takes the queries, then the bulk work."""
    await enqueue_batch_class(rig.client, "bulk", bulk_ids)
    for rid, seqs in queries.items():
        await enqueue_ids(rig.client, rid, seqs)
    worker = rig.worker(gated, "bulk")
    await rig.start(worker)
    return worker


async def _notified(pubsub) -> list[str]:
    ids = []
    while (message := await pubsub.get_message(timeout=0.3)) is not None:
        ids += [request_id for request_id, _ in parse_notices(message[1])]
    return ids


async def test_queries_claimed_beside_bulk_work_are_answered_before_its_forward(redis_url, engine):
    gated = SlowLightEngine(engine)
    rng = np.random.default_rng(31)
    bulk_ids = [token_ids(rng, 100) for _ in range(2)]
    queries = {f"q{i}": [token_ids(rng, 20)] for i in range(2)}
    async with worker_rig(redis_url, engine) as rig:
        q, client = rig.q, rig.client
        pubsub = ShardedSubscriber(client.redis)
        await pubsub.subscribe(client.keys.notice_channel("test"))
        worker = await start_behind_bulk(rig, gated, bulk_ids, queries)

        # The bulk part's forward is held at the engine's gate, pre-emptible ...
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)
        assert await rig.registered()
        # ... and the queries it was claimed with are answered and notified already.
        for rid in queries:
            assert await q.redis.hlen(q.keys.reply(rid)) == 1 + len(REPLY_META_FIELDS)
        assert sorted(await _notified(pubsub)) == sorted(queries)
        assert not await q.redis.hexists(q.keys.reply("bulk"), "0")
        stats = await q.stats()
        assert stats.inflight_items == 4  # one lease for all four items, held for the bulk part
        assert stats.counters["acked"] == 2

        query_queue_ms, _ = await _timing(q, "q0")  # answered while the bulk part is held
        gated.go.set()
        gated.finish.set()
        bulk_queue_ms, _ = await _timing(q, "bulk")
        # Enqueued before the queries, the bulk work also waited for their forward and its ack.
        assert bulk_queue_ms - query_queue_ms >= LIGHT_DELAY_S * 1000
        got = {rid: await answered_vectors(client, rid, 1) for rid in queries}
        got["bulk"] = await answered_vectors(client, "bulk", len(bulk_ids))
        assert await _notified(pubsub) == ["bulk"]  # each request notified once
        query_n, bulk_n = 2 * 20, sum(map(len, bulk_ids))
        assert query_n <= HEAVY_TOKENS < bulk_n
        assert gated.log == [("start", query_n), ("end", query_n), ("start", bulk_n), ("end", bulk_n)]
        for rid, seqs in (*queries.items(), ("bulk", bulk_ids)):
            np.testing.assert_allclose(got[rid], engine.embed(PackedBatch.pack(seqs)), atol=1e-5)
        assert worker.loop.num_batches == 2  # two forwards counted
        stats = await q.stats()
        assert (stats.inflight_items, stats.queued_entries) == (0, 0)
        assert stats.counters["acked"] == 4 and stats.counters.get("failed", 0) == 0
        assert stats.counters["batches"] == 1  # one claim, one lease
        await pubsub.aclose()
        await rig.stop(worker)
        assert rig.exits == []


def test_interactive_work_beside_batch_work_splits_from_it():
    from tokq.queue.shard import Claim
    from tokq.queue.wire import format_entry, parse_entry
    from tokq.workers.loop import is_heavy, split_interactive

    def entry(tokens, index):
        return parse_entry(format_entry(tokens, 0, "r", index, 60_000, 0, b"x"))

    def claim(light, heavy, batch, *, repeated=False):
        entries = tuple(entry(n, i) for i, n in enumerate([*light, *heavy, *batch]))
        return Claim("b-1", 0, entries, num_heavy=-1 if repeated else len(heavy),
                     num_batch=-1 if repeated else len(batch))

    interactive, bulk = split_interactive(claim([20, 20], [], [200, 300]))
    assert [e.num_tokens for e in interactive.entries] == [20, 20] and interactive.num_batch == 0
    assert [e.num_tokens for e in bulk.entries] == [200, 300] and (bulk.num_heavy, bulk.num_batch) == (0, 2)
    assert interactive.batch_id == bulk.batch_id == "b-1"  # one lease
    # Heavy interactive work splits too, its part pre-emptible as any heavy batch.
    interactive, bulk = split_interactive(claim([20], [400], [200]))
    assert [e.num_tokens for e in interactive.entries] == [20, 400] and (interactive.num_heavy, interactive.num_batch) == (1, 0)
    assert [e.num_tokens for e in bulk.entries] == [200] and (bulk.num_heavy, bulk.num_batch) == (0, 1)
    assert is_heavy(interactive, preempt_budget=128) and is_heavy(bulk, preempt_budget=128)
    assert split_interactive(claim([20, 20], [], [])) is None  # no batch work
    assert split_interactive(claim([], [], [200, 300])) is None  # no interactive work
    assert split_interactive(claim([20], [], [200], repeated=True)) is None


async def test_a_heavy_query_claimed_beside_bulk_work_is_answered_before_its_forward(redis_url, engine):
    rng = np.random.default_rng(37)
    bulk_ids = [token_ids(rng, 150) for _ in range(2)]
    queries = {"light": [token_ids(rng, 20)], "heavy": [token_ids(rng, 150)]}  # heavy lane: over 128 tokens
    query_n, bulk_n = 20 + 150, 2 * 150
    gated = GatedEngine(engine, gate_above=bulk_n - 1)  # the bulk part's forward only
    async with worker_rig(redis_url, engine) as rig:
        q, client = rig.q, rig.client
        worker = await start_behind_bulk(rig, gated, bulk_ids, queries)
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)
        for rid in queries:  # answered while the bulk part is held at its gate
            assert await q.redis.hexists(q.keys.reply(rid), "0"), rid
        assert not await q.redis.hexists(q.keys.reply("bulk"), "0")
        gated.go.set()
        gated.finish.set()
        got = {rid: await answered_vectors(client, rid, 1) for rid in queries}
        got["bulk"] = await answered_vectors(client, "bulk", len(bulk_ids))
        assert query_n > HEAVY_TOKENS  # the interactive part ran pre-emptible, as its own forward
        assert gated.log == [("start", query_n), ("end", query_n), ("start", bulk_n), ("end", bulk_n)]
        for rid, seqs in (*queries.items(), ("bulk", bulk_ids)):
            np.testing.assert_allclose(got[rid], engine.embed(PackedBatch.pack(seqs)), atol=1e-5)
        stats = await q.stats()
        assert (stats.inflight_items, stats.queued_entries) == (0, 0) and stats.counters["batches"] == 1
        await rig.stop(worker)
        assert rig.exits == []
