"""Workers on a real Redis in front of a gated engine (tests/gated_engine.py), for the tests of
what runs nested in a heavy or batch-class forward: a test builds and starts workers on a rig,
enqueues work, opens the engine's gates and checks which forwards ran inside which."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest
from queue_support import QUEUE, enqueue_ids, open_queue, wait_for

from tokq.config import QueueConfig, WorkerConfig
from tokq.queue.wire import encode_body
from tokq.workers.worker import Worker

TOKEN_BUDGET = 512  # every worker's: a pre-emption budget of gated_engine.HEAVY_TOKENS


def fp32_engine():
    """The bundled model on the CPU in fp32: vectors are compared with each request embedded
    alone at atol 1e-5, and bf16 ("auto" with AVX512-BF16) differs with the batch an item rides in."""
    from tokq.workers.engine import Engine

    return Engine.load(None, device="cpu", dtype="float32", name=QUEUE)


def token_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """One sequence of ``n`` token ids: [CLS], n - 2 random word pieces, [SEP]."""
    return np.concatenate([[101], rng.integers(1000, 20000, n - 2), [102]])


async def enqueue_batch_class(queue, request_id: str, seqs) -> None:
    """Enqueue one batch-class request of these token-id sequences (a minute's deadline)."""
    await queue.enqueue(request_id, [(len(s), encode_body(s)) for s in seqs], timeout_ms=60_000,
                        notice_channel=queue.keys.notice_channel("test"), priority="batch")


def offered(worker: Worker):
    """For wait_for: a batch waits in ``worker``'s pre-emption slot, offered to its forward."""
    async def waiting() -> bool:
        return worker.loop.preemption.waiting is not None
    return waiting


def hold_heavy_checkpoint(monkeypatch, gated, worker: Worker, number: int, what: str) -> None:
    """The heavy forward's own ``number``-th checkpoint (at ``gated.depth`` 1) holds until a
    batch (``what``) is offered to it; nested forwards' checkpoints run as they are."""
    from tokq.workers import preempt

    real_checkpoint = preempt.current_checkpoint
    calls = 0

    def held_checkpoint():
        inner = real_checkpoint()
        if inner is preempt.no_checkpoint:
            return inner

        def checkpoint():
            nonlocal calls
            if gated.depth == 1:  # the heavy forward's own checkpoints
                calls += 1
                if calls == number:
                    deadline = time.monotonic() + 20
                    while worker.loop.preemption.waiting is None:
                        assert time.monotonic() < deadline, f"{what} was never offered"
                        time.sleep(0.005)
            inner()
        return checkpoint

    monkeypatch.setattr(preempt, "current_checkpoint", held_checkpoint)


class WorkerRig:
    """Two connections to one queue, ``q`` (the workers') and ``client`` (the test's), the
    workers started on them, and the exit codes they asked for (none in a passing test)."""

    def __init__(self, q, client, queue_config: QueueConfig) -> None:
        self.q, self.client, self.queue_config = q, client, queue_config
        self.exits: list[int] = []  # a forward held past hung_forward_ms must not end pytest
        self.runs: dict[str, asyncio.Task] = {}

    def worker(self, engine, worker_id: str, *, queue=None, observer=None) -> Worker:
        """A worker of ``engine`` on ``queue`` (``q`` by default), not yet started."""
        return Worker(engine, queue or self.q, WorkerConfig(token_budget=TOKEN_BUDGET), self.queue_config,
                      worker_id=worker_id, observer=observer, exit_process=self.exits.append)

    async def start(self, worker: Worker) -> None:
        """Runs ``worker`` and waits for its first heartbeat."""
        self.runs[worker.worker_id] = asyncio.create_task(worker.run())
        await wait_for(lambda: self.q.redis.exists(self.q.keys.heartbeat(worker.worker_id)), 60,
                       "the first heartbeat")

    async def stop(self, worker: Worker) -> None:
        """Stops ``worker`` and waits for its run to end (its batches finished and acknowledged)."""
        worker.stop()
        await asyncio.wait_for(self.runs.pop(worker.worker_id), 30)

    async def kill(self, worker: Worker) -> None:
        """Stops ``worker`` dead: its task cancelled, its subscription closed (a crash, as Redis
        sees it), its leases left to expire."""
        run = self.runs.pop(worker.worker_id)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    async def registered(self) -> bool:
        """The worker on ``q`` is in the pre-emptible set (runs a heavy forward, unnoticed)."""
        return await self.q.redis.sismember(self.q.keys.preemptible, self.q.batch_prefix)

    async def offer_during_heavy(self, worker: Worker, entered: threading.Event, heavy: tuple[str, list],
                                 light: tuple[str, list], *, batch_class: bool = False) -> None:
        """Enqueues the ``heavy`` (request id, sequences), batch-class with ``batch_class``; once its
        forward reaches the engine's gate (``entered``) and ``worker`` registers as pre-emptible,
        enqueues the ``light`` one and waits until it is offered to that forward."""
        (heavy_id, heavy_seqs), (light_id, light_seqs) = heavy, light
        await (enqueue_batch_class if batch_class else enqueue_ids)(self.client, heavy_id, heavy_seqs)
        assert await asyncio.to_thread(entered.wait, 60)
        await wait_for(self.registered, 30, f"the worker in {heavy_id}'s forward to register as pre-emptible")
        await enqueue_ids(self.client, light_id, light_seqs)
        await wait_for(offered(worker), 30, f"{light_id} to be claimed and offered to {heavy_id}'s forward")


@contextlib.asynccontextmanager
async def worker_rig(redis_url: str, engine, **queue_config):
    """A WorkerRig on ``engine``'s queue, its connections made with ``queue_config`` (lease_ms=...);
    a worker still running at the end (its test failed) is cancelled."""
    name = engine.info.queue_name
    async with open_queue(redis_url, queue=name, **queue_config) as q, \
            open_queue(redis_url, queue=name, **queue_config) as client:
        rig = WorkerRig(q, client, QueueConfig(**queue_config))
        try:
            yield rig
        finally:
            for run in rig.runs.values():
                run.cancel()
