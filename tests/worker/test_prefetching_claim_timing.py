"""The prefetching claim (workers/loop.py) starts at a fraction of the average forward time,
or as soon as the forward in flight ends: a short batch after long ones does not leave the
worker waiting out the long ones' delay while new work queues. In process, a real Redis and the
real bundled model; the long history is set directly (minutes), so the bug would be a wait of
tens of seconds, not a timing to measure."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from queue_support import QUEUE, open_queue, wait_for

from tokq.config import QueueConfig, WorkerConfig
from tokq.queue.wire import encode_body
from tokq.workers.loop import PREFETCH_AT
from tokq.workers.worker import Worker

pytestmark = pytest.mark.slow

LONG_FORWARDS_S = 120.0  # the average forward, as if after heavy batches on a slow device


@pytest.fixture(scope="module")
def engine():
    from tokq.workers.engine import Engine

    return Engine.load(None, device="cpu", name=QUEUE)



async def test_work_after_a_short_forward_does_not_wait_for_the_long_forwards_delay(redis_url, engine):
    name = engine.info.queue_name
    async with open_queue(redis_url, queue=name) as q, open_queue(redis_url, queue=name) as client:
        worker = Worker(engine, q, WorkerConfig(token_budget=512), QueueConfig(), worker_id="prefetch")
        run = asyncio.create_task(worker.run())
        await wait_for(lambda: q.redis.exists(q.keys.heartbeat("prefetch")), 60, "the first heartbeat")
        ids = np.array([101, 7592, 102])

        async def call(request_id: str) -> None:
            await client.enqueue(request_id, [(len(ids), encode_body(ids))], timeout_ms=600_000,
                                 notice_channel=client.keys.notice_channel("test"))

            async def answered():
                return await q.redis.hlen(q.keys.reply(request_id)) >= 4  # the item + n, ch, t
            # Far less than the delay the long forwards set (PREFETCH_AT x LONG_FORWARDS_S).
            await wait_for(answered, 30, f"the answer to {request_id}")

        await call("first")
        worker.loop.prefetch.forward_s = LONG_FORWARDS_S
        assert worker.loop.prefetch.delay_s() > 0.5 * PREFETCH_AT * LONG_FORWARDS_S
        for i in range(3):  # each forward's prefetching claim waits for that forward only
            await call(f"after-long-{i}")
        worker.stop()
        await asyncio.wait_for(run, 30)
        assert (await q.stats()).counters["acked"] == 4
