"""The worker under faults, in process with a real Redis and the real bundled model: a forward
that hangs (an injected block in front of the real engine) and an idle worker woken by a work
notice instead of a poll."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from queue_support import QUEUE, open_queue, wait_for

from tokq.config import QueueConfig, WorkerConfig
from tokq.queue.wire import decode_result, encode_body
from tokq.workers import wake as wake_module
from tokq.workers import worker as worker_module
from tokq.workers.worker import EXIT_HUNG, Worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    from tokq.workers.engine import Engine

    return Engine.load(None, device="cpu", name=QUEUE)


class HangingEngine:
    """The real engine, except that once ``hang`` is set its forward blocks until ``release``
    (a wedged device or driver, as seen from the worker)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.hang = threading.Event()
        self.release = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def embed(self, batch):
        if self.hang.is_set():
            self.entered.set()
            self.release.wait(60)
        return self._engine.embed(batch)



def _check(redis_url: str, worker_id: str) -> int:
    return subprocess.run([sys.executable, "-m", "tokq.cli", "worker", "--check", "--worker-id",
                           worker_id, "--redis-url", redis_url, "--served-model-name", QUEUE],
                          capture_output=True, timeout=120).returncode


async def test_a_hung_forward_makes_the_worker_give_up_and_its_batch_is_redone(redis_url, engine):
    qcfg = QueueConfig(lease_ms=1_000)
    # A 3 s heartbeat TTL: the --check subprocesses' start-up competes for the CPUs, and a
    # shorter TTL could lapse meanwhile (the hang is found by hung_forward_ms, not the beat).
    wcfg = WorkerConfig(token_budget=256, heartbeat_ms=1_000, hung_forward_ms=1_500)
    hanging = HangingEngine(engine)
    exits: list[int] = []
    ids = [[101, 7592, 2088, 102], [101, 2204, 2851, 102]]
    name = engine.info.queue_name  # its model fingerprint included, as `--check` names it
    async with open_queue(redis_url, lease_ms=1_000, queue=name) as q, \
            open_queue(redis_url, lease_ms=1_000, queue=name) as q2:
        hung = Worker(hanging, q, wcfg, qcfg, worker_id="hung", exit_process=exits.append)
        hung_run = asyncio.create_task(hung.run())
        heartbeat = q.keys.heartbeat("hung")
        await wait_for(lambda: q.redis.exists(heartbeat), 60, "the first heartbeat")
        assert await asyncio.to_thread(_check, redis_url, "hung") == 0

        hanging.hang.set()
        await q2.enqueue("r", [(len(t), encode_body(t)) for t in ids], timeout_ms=60_000,
                         notice_channel=q.keys.notice_channel("test"))
        await asyncio.to_thread(hanging.entered.wait, 30)

        async def gave_up():
            return bool(exits)
        await wait_for(gave_up, 60, "the hung worker to give up")
        assert exits == [EXIT_HUNG] and not hung.healthy
        assert not await q.redis.exists(heartbeat)
        # Nor does it answer for its leases any more: requeue may take them at their next check.

        async def worker_channel_gone():
            return (await q.redis.execute_command("PUBSUB", "SHARDNUMSUB", q.worker_channel))[1] == 0
        await wait_for(worker_channel_gone, 30, "the hung worker to leave its worker channel")
        assert await q.redis.zscore(q.keys.workers, "hung") is None
        assert await asyncio.to_thread(_check, redis_url, "hung") == 1

        # Its lease is no longer renewed: a healthy worker redoes the batch.
        healthy = Worker(engine, q2, WorkerConfig(token_budget=256, heartbeat_ms=200), qcfg,
                         worker_id="healthy")
        healthy_run = asyncio.create_task(healthy.run())
        reply = q.keys.reply("r")
        await wait_for(lambda: _complete(q, reply, len(ids)), 60, "the redo")
        results = await q.collect("r")
        vectors = [decode_result(results[i]).vector for i in range(len(ids))]
        from tokq.batch import PackedBatch

        want = engine.embed(PackedBatch.pack([np.array(t) for t in ids]))
        np.testing.assert_allclose(np.stack(vectors), want, atol=1e-5)
        assert decode_result(results[0]).ok and (await q.stats()).counters["requeued"] == 2

        hanging.release.set()  # the forward returns at last; the worker had stopped claiming
        healthy.stop()
        await asyncio.wait_for(asyncio.gather(hung_run, healthy_run), 60)
        assert hung.loop.num_batches == 1


async def _complete(q, reply: str, n: int) -> bool:
    return await q.redis.hlen(reply) >= n + 3


async def test_an_idle_worker_is_woken_by_a_woken_not_a_poll(redis_url, engine, monkeypatch):
    # With the fallback poll an hour away, only the notice can make the worker claim.
    monkeypatch.setattr(wake_module, "IDLE_FALLBACK_S", 3600.0)
    qcfg = QueueConfig()
    async with open_queue(redis_url, queue=engine.info.queue_name) as q:
        worker = Worker(engine, q, WorkerConfig(token_budget=256), qcfg, worker_id="idle")
        run = asyncio.create_task(worker.run())
        await wait_for(lambda: q.redis.exists(q.keys.heartbeat("idle")), 60, "the first heartbeat")
        await asyncio.sleep(0.5)  # idle now: its first claim found nothing
        for n in range(3):  # each request arrives at an empty queue, so each sends a notice
            await q.enqueue(f"r{n}", [(3, encode_body([101, 2000 + n, 102]))], timeout_ms=60_000,
                            notice_channel=q.keys.notice_channel("test"))
            reply = q.keys.reply(f"r{n}")
            await wait_for(lambda: _complete(q, reply, 1), 30, "the notice to wake the worker")
            assert decode_result((await q.collect(f"r{n}"))[0]).ok
        # While it lives it listens on its worker channel, so requeue never takes its leases
        # early (tokq.queue.shard.Queue.worker_channel).
        assert await q.redis.execute_command("PUBSUB", "SHARDNUMSUB", q.worker_channel) == [
            q.worker_channel.encode(), 1]
        # stop() is seen at the next wake-up (within IDLE_FALLBACK_S in service, an hour here).
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run


async def test_a_missed_woken_costs_at_most_the_fallback_poll(redis_url, engine):
    qcfg = QueueConfig()
    async with open_queue(redis_url, queue=engine.info.queue_name) as q:
        worker = Worker(engine, q, WorkerConfig(token_budget=256), qcfg, worker_id="deaf")
        run = asyncio.create_task(worker.run())
        await wait_for(lambda: q.redis.exists(q.keys.heartbeat("deaf")), 60, "the first heartbeat")
        # Queue an item behind an entry that keeps the queue non-empty, so no notice is sent.
        await q.redis.set(q.keys.tokens, 1)
        await q.enqueue("r", [(3, encode_body([101, 2000, 102]))], timeout_ms=60_000,
                        notice_channel=q.keys.notice_channel("test"))
        await q.redis.incrby(q.keys.tokens, -1)
        await wait_for(lambda: _complete(q, q.keys.reply("r"), 1), 30, "the fallback claim")
        assert decode_result((await q.collect("r"))[0]).ok
        worker.stop()
        await asyncio.wait_for(run, 30)


class SlowEngine:
    """The real engine, its warm-up and each forward made slower by a fixed wait."""

    def __init__(self, engine, warmup_s: float, forward_s: float) -> None:
        self._engine, self.warmup_s, self.forward_s = engine, warmup_s, forward_s

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def warmup(self, num_tokens: int) -> None:
        time.sleep(self.warmup_s)
        self._engine.warmup(num_tokens)

    def embed(self, batch):
        time.sleep(self.forward_s)
        return self._engine.embed(batch)


async def test_the_hung_threshold_is_at_least_20x_the_warm_up_forward(redis_url, engine):
    # --hung-forward-ms below what this device's forwards take is raised to HUNG_FACTOR x the
    # warm-up forward: a slow device is not taken for a hung one.
    slow = SlowEngine(engine, warmup_s=0.2, forward_s=0.3)
    exits: list[int] = []
    ids = [[101, 7592, 102]]
    name = engine.info.queue_name
    async with open_queue(redis_url, queue=name) as q:
        worker = Worker(slow, q, WorkerConfig(token_budget=256, heartbeat_ms=200, hung_forward_ms=100),
                        QueueConfig(), worker_id="slow", exit_process=exits.append)
        run = asyncio.create_task(worker.run())
        await wait_for(lambda: q.redis.exists(q.keys.heartbeat("slow")), 60, "the first heartbeat")
        assert worker.hung_after_s >= worker_module.HUNG_FACTOR * 0.2
        await q.enqueue("r", [(len(t), encode_body(t)) for t in ids], timeout_ms=60_000,
                        notice_channel=q.keys.notice_channel("test"))
        await wait_for(lambda: _complete(q, q.keys.reply("r"), len(ids)), 60, "the answer")
        assert exits == [] and worker.healthy  # a 0.3 s forward, 3x --hung-forward-ms: not hung
        worker.stop()
        await asyncio.wait_for(run, 60)
