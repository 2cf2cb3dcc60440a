"""Batch-class work is pre-empted as heavy work is (workers/loop.py is_heavy, workers/preempt.py):
a forward mostly of batch-lane work registers the worker as pre-emptible, and a one-word
interactive request arriving meanwhile runs nested between two of its steps and is answered
first; both batches' vectors are those of the model run alone. In process, with a real Redis and
the real bundled model; the order is forced with events, never by timing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from gated_engine import HEAVY_TOKENS, GatedEngine
from gated_worker import enqueue_batch_class, fp32_engine, token_ids, worker_rig
from queue_support import answered_vectors, open_queue, wait_for

from tokq.batch import PackedBatch
from tokq.queue.wire import encode_body
from tokq.workers.loop import is_heavy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    return fp32_engine()


async def test_a_batch_of_mostly_batch_class_work_is_heavy(redis_url):
    async with open_queue(redis_url) as q:
        def body(n):
            return n, encode_body(np.arange(1, n + 1))

        notice = q.keys.notice_channel("t")
        for i in range(3):  # batch-class requests of light size: 180 batch-lane tokens
            await q.enqueue(f"b{i}", [body(60)], timeout_ms=60_000, notice_channel=notice, priority="batch")
        claim = await q.claim(512)
        assert (claim.num_tokens, claim.num_heavy, claim.num_batch) == (180, 0, 3)
        assert is_heavy(claim, HEAVY_TOKENS)
        assert not is_heavy(claim, 180)  # no more tokens than a light-only claim: not worth it
        for i in range(4):  # 240 light tokens beside 200 of batch work: mostly light
            await q.enqueue(f"l{i}", [body(60)], timeout_ms=60_000, notice_channel=notice)
        await q.enqueue("b-big", [body(200)], timeout_ms=60_000, notice_channel=notice, priority="batch")
        claim = await q.claim(512)
        assert (claim.num_tokens, claim.num_heavy, claim.num_batch) == (440, 0, 1)
        assert not is_heavy(claim, HEAVY_TOKENS)
        await q.enqueue("h", [body(150)], timeout_ms=60_000, notice_channel=notice)
        await q.enqueue("b-more", [body(60)], timeout_ms=60_000, notice_channel=notice, priority="batch")
        await q.enqueue("l-last", [body(50)], timeout_ms=60_000, notice_channel=notice)
        claim = await q.claim(512)  # 50 light, 150 heavy, 60 batch: 210 of 260 not light
        assert (claim.num_tokens, claim.num_heavy, claim.num_batch) == (260, 1, 1)
        assert is_heavy(claim, HEAVY_TOKENS)


async def test_an_interactive_request_runs_inside_a_batch_class_forward_and_is_answered_first(
        redis_url, engine):
    gated = GatedEngine(engine)
    rng = np.random.default_rng(11)
    bulk_ids = [token_ids(rng, 100) for _ in range(2)]
    query_ids = [np.array([101, 7592, 2088, 102])]
    async with worker_rig(redis_url, engine) as rig:
        q, client = rig.q, rig.client
        worker = rig.worker(gated, "bulk")
        await rig.start(worker)

        # the query is interactive: its 'light' wake-up
        await rig.offer_during_heavy(worker, gated.heavy_entered, ("bulk", bulk_ids), ("query", query_ids),
                                     batch_class=True)
        gated.go.set()
        got = {"query": await answered_vectors(client, "query", len(query_ids))}
        assert not await q.redis.hexists(q.keys.reply("bulk"), "0")  # the bulk batch still runs
        gated.finish.set()
        got["bulk"] = await answered_vectors(client, "bulk", len(bulk_ids))
        bulk_n, query_n = sum(map(len, bulk_ids)), sum(map(len, query_ids))
        assert gated.log == [("start", bulk_n), ("start", query_n), ("end", query_n), ("end", bulk_n)]
        for request_id, seqs in (("query", query_ids), ("bulk", bulk_ids)):
            np.testing.assert_allclose(got[request_id], engine.embed(PackedBatch.pack(seqs)), atol=1e-5)
        assert worker.loop.num_preemptions == 1
        stats = await q.stats()
        assert (stats.inflight_items, stats.queued_entries, stats.counters["acked"]) == (0, 0, 3)
        await rig.stop(worker)
        assert rig.exits == []


async def test_a_lost_worker_s_batch_class_forward_is_redone_from_the_batch_lane(redis_url, engine):
    gated = GatedEngine(engine)  # its bulk forward never starts: the worker is lost holding it
    rng = np.random.default_rng(12)
    bulk_ids = [token_ids(rng, 150)]
    async with worker_rig(redis_url, engine, lease_ms=3_000) as rig:
        q2 = rig.client
        lost = rig.worker(gated, "lost")
        await rig.start(lost)
        await enqueue_batch_class(q2, "bulk", bulk_ids)
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)
        await rig.kill(lost)

        redo = rig.worker(engine, "redo", queue=q2)
        await rig.start(redo)

        async def back_in_the_batch_lane():
            return await q2.redis.llen(q2.keys.batch) > 0 or await q2.redis.hexists(q2.keys.reply("bulk"), "0")
        await wait_for(back_in_the_batch_lane, 60, "the lost lease redone")
        got = await answered_vectors(q2, "bulk", len(bulk_ids))
        np.testing.assert_allclose(got, engine.embed(PackedBatch.pack(bulk_ids)), atol=1e-5)
        stats = await q2.stats()
        assert stats.counters["requeued"] == 1 and stats.counters["acked"] == 1
        assert stats.lanes["heavy"] == (0, 0)
        gated.go.set()
        gated.finish.set()
        await rig.stop(redo)
        assert rig.exits == []
