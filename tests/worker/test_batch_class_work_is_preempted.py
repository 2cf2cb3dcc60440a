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
from queue_support import QUEUE, answered_vectors, enqueue_ids, open_queue, wait_for

from tokq.batch import PackedBatch
from tokq.config import QueueConfig, WorkerConfig
from tokq.queue.wire import encode_body
from tokq.workers.loop import is_heavy
from tokq.workers.worker import Worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    from tokq.workers.engine import Engine

    # fp32: vectors are compared with each request embedded alone at atol 1e-5
    return Engine.load(None, device="cpu", dtype="float32", name=QUEUE)


async def _enqueue_batch_class(queue, request_id: str, seqs) -> None:
    await queue.enqueue(request_id, [(len(s), encode_body(s)) for s in seqs], timeout_ms=60_000,
                        notice_channel=queue.keys.notice_channel("test"), priority="batch")


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
    bulk_ids = [np.concatenate([[101], rng.integers(1000, 20000, 98), [102]]) for _ in range(2)]
    query_ids = [np.array([101, 7592, 2088, 102])]
    name = engine.info.queue_name
    async with open_queue(redis_url, queue=name) as q, open_queue(redis_url, queue=name) as client:
        exits: list[int] = []
        worker = Worker(gated, q, WorkerConfig(token_budget=512), QueueConfig(), worker_id="bulk",
                        exit_process=exits.append)
        run = asyncio.create_task(worker.run())
        await wait_for(lambda: q.redis.exists(q.keys.heartbeat("bulk")), 60, "the first heartbeat")

        await _enqueue_batch_class(client, "bulk", bulk_ids)
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)

        async def registered():
            return await q.redis.sismember(q.keys.preemptible, q.batch_prefix)
        await wait_for(registered, 30, "the worker in a batch-class forward to register as pre-emptible")
        await enqueue_ids(client, "query", query_ids)  # interactive: its 'light' wake-up

        async def offered():
            return worker.loop.preemption.waiting is not None
        await wait_for(offered, 30, "the interactive batch to be claimed and offered to the forward")
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
        worker.stop()
        await asyncio.wait_for(run, 30)
        assert exits == []


async def test_a_lost_worker_s_batch_class_forward_is_redone_from_the_batch_lane(redis_url, engine):
    gated = GatedEngine(engine)  # its bulk forward never starts: the worker is lost holding it
    rng = np.random.default_rng(12)
    bulk_ids = [np.concatenate([[101], rng.integers(1000, 20000, 148), [102]])]
    name = engine.info.queue_name
    qcfg = QueueConfig(lease_ms=3_000)
    async with open_queue(redis_url, lease_ms=3_000, queue=name) as q, \
            open_queue(redis_url, lease_ms=3_000, queue=name) as q2:
        exits: list[int] = []
        lost = Worker(gated, q, WorkerConfig(token_budget=512), qcfg, worker_id="lost",
                      exit_process=exits.append)
        lost_run = asyncio.create_task(lost.run())
        await wait_for(lambda: q.redis.exists(q.keys.heartbeat("lost")), 60, "the first heartbeat")
        await _enqueue_batch_class(q2, "bulk", bulk_ids)
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)
        lost_run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await lost_run

        redo = Worker(engine, q2, WorkerConfig(token_budget=512), qcfg, worker_id="redo",
                      exit_process=exits.append)
        redo_run = asyncio.create_task(redo.run())

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
        redo.stop()
        await asyncio.wait_for(redo_run, 30)
        assert exits == []
