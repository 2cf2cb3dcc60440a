"""A worker beside a stream of redos to isolate (attempt >= isolate_attempt, put at the heavy
lane's front after each of its claims, as requeue.lua does): after a claim that took one, its
next full claim reads light work first (workers/loop.py, ``after_isolated``), so light work waits
one claim at most, and each redo still goes alone. In process, a real Redis and the bundled model;
the redos are written into the heavy lane directly (two lease expiries each would take seconds)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from queue_support import QUEUE, enqueue_ids, open_queue, wait_for

from tokq.config import QueueConfig, WorkerConfig
from tokq.queue.claim_rule import isolate_attempt_for
from tokq.queue.wire import encode_body, format_entry
from tokq.workers.worker import Worker

pytestmark = pytest.mark.slow

NUM_REDOS = 8
ISOLATE = isolate_attempt_for(QueueConfig().max_attempts)
IDS = np.array([101, 7592, 2088, 999, 102])


@pytest.fixture(scope="module")
def engine():
    from tokq.workers.engine import Engine

    return Engine.load(None, device="cpu", name=QUEUE)


async def _push_redo(q, request_id: str) -> None:
    """A live request's item redone ``ISOLATE`` times, at the heavy lane's front."""
    k, now_ms = q.keys, int(time.time() * 1000)
    await q.redis.hset(k.reply(request_id), mapping={"n": 1, "ch": k.notice_channel("test")})
    raw = format_entry(len(IDS), now_ms, request_id, 0, now_ms + 60_000, ISOLATE, encode_body(IDS))
    await q.redis.lpush(k.heavy, raw)
    await q.redis.incrby(k.tokens, len(IDS))


async def _answered(q, request_id: str) -> bool:
    return bool(await q.redis.hexists(q.keys.reply(request_id), "0"))


async def test_light_work_and_a_stream_of_redos_to_isolate_alternate(redis_url, engine, monkeypatch):
    name = engine.info.queue_name
    async with open_queue(redis_url, queue=name) as q, open_queue(redis_url, queue=name) as client:
        await q.redis.flushdb()
        worker = Worker(engine, q, WorkerConfig(token_budget=512), QueueConfig(), worker_id="redos")
        real_claim = worker.queue.consumer.claim
        claims: list[tuple[list[str], bool]] = []  # each full claim: its request ids, after_isolated
        first_wave = [f"light{i}" for i in range(30)]
        second_wave = [f"late{i}" for i in range(10)]
        redos = [f"redo{i}" for i in range(NUM_REDOS)]
        second_wave_before = []  # the index of the first claim after the second wave was queued
        pushed = [1]  # redos put in the heavy lane so far

        async def recording_claim(token_budget, **kwargs):
            claim = await real_claim(token_budget, **kwargs)
            if kwargs.get("lanes") != "light" and claim is not None:
                claims.append(([e.request_id for e in claim.entries], 0 in kwargs["after_isolated"]))
                if pushed[0] < NUM_REDOS:  # the next redo at the front, as a requeue puts it
                    await _push_redo(q, redos[pushed[0]])
                    pushed[0] += 1
                if len(claims) == 4:
                    for request_id in second_wave:
                        await enqueue_ids(client, request_id, [IDS])
                    second_wave_before.append(len(claims))
            return claim
        monkeypatch.setattr(worker.queue.consumer, "claim", recording_claim)
        for request_id in first_wave:
            await enqueue_ids(client, request_id, [IDS])
        await _push_redo(q, redos[0])
        run = asyncio.create_task(worker.run())
        for request_id in first_wave + second_wave + redos:
            await wait_for(lambda: _answered(q, request_id), 60, f"{request_id}'s answer")
        worker.stop()
        await asyncio.wait_for(run, 30)

    took_redo = [any(r.startswith("redo") for r in ids) for ids, _ in claims]
    for ids, redo in zip((ids for ids, _ in claims), took_redo):
        assert not redo or len(ids) == 1  # a redo to isolate goes alone
    # The worker asks for light work first exactly after a claim that took a redo.
    assert [after for _, after in claims] == [False] + took_redo[:-1]
    assert took_redo[0] and set(claims[1][0]) == set(first_wave)  # light work waits one claim
    late = [n for n, (ids, _) in enumerate(claims) if set(ids) & set(second_wave)]
    assert late and late[0] <= second_wave_before[0] + 1 and len(set(late)) == len(late)
    assert sum(took_redo) == NUM_REDOS
