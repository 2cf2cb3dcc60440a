"""A worker claiming from several queue shards (QueueConfig.queue_shards) registers as idle, and
as pre-emptible, in each shard's set; a notice takes it out of one shard's set only. It leaves
every shard's set once it has work (idle) or its heavy forward ends (pre-emptible): still
registered, it would take those shards' notices from the workers waiting for them (an idle
worker would find that work only at its next poll; a worker in a heavy forward would not be told
of light work). So must a registration whose answer was lost (it may have reached Redis). In
process, with a real Redis and the real bundled model; the order is forced with events
(tests/gated_engine.py)."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from gated_engine import GatedEngine
from queue_support import QUEUE, answered_vectors, enqueue_ids, wait_for

from tokq.config import QueueConfig, WorkerConfig
from tokq.redis.connection import close_client, connect
from tokq.queue.sharded import ShardedQueue
from tokq.workers.worker import Worker

pytestmark = pytest.mark.slow

SHARDS = 2
HEAVY_IDS = [np.concatenate([[101], np.random.default_rng(11).integers(1000, 20000, 148), [102]])]
LIGHT_IDS = [np.array([101, 7592, 102])]


@pytest.fixture(scope="module")
def engine():
    from tokq.workers.engine import Engine

    return Engine.load(None, device="cpu", name=QUEUE)


@contextlib.asynccontextmanager
async def sharded(redis_url: str, name: str, shards: int = SHARDS):
    client = connect(redis_url)
    try:
        yield ShardedQueue(client, name, QueueConfig(queue_shards=shards))
    finally:
        await close_client(client)


async def _in_sets(queue: ShardedQueue, set_name: str) -> list[bool]:
    """Per shard: is this client's batch prefix in that shard's ``idle`` or ``preemptible`` set?"""
    return [bool(await queue.redis.sismember(getattr(queue.shard(i).keys, set_name), queue.shard(i).batch_prefix))
            for i in range(queue.claim_shards)]


async def _answer_heavy_and_stop(gated: GatedEngine, client: ShardedQueue, worker: Worker, run) -> None:
    """Let the held heavy forward go; its request is answered (through shard 0); stop the worker."""
    gated.go.set()
    got = await answered_vectors(client.shard(0), "heavy", len(HEAVY_IDS))
    assert got.shape == (1, gated.info.hidden_size)
    worker.stop()
    await asyncio.wait_for(run, 30)


async def _in_every_set(queue: ShardedQueue, set_name: str) -> bool:
    return all(await _in_sets(queue, set_name))


def _answer_lost(mark):
    """``mark`` (a queue's mark_idle or mark_preemptible) whose registrations reach Redis and
    then lose their answer: the connection drops after the command ran."""
    async def registered_unheard(flag: bool) -> None:
        await mark(flag)
        if flag:
            raise RedisConnectionError("connection lost after the command ran")
    return registered_unheard


def _worker(gated: GatedEngine, queue: ShardedQueue, exits: list[int]) -> Worker:
    return Worker(gated, queue, WorkerConfig(token_budget=512), QueueConfig(queue_shards=queue.claim_shards),
                  worker_id="sharded", exit_process=exits.append)


@pytest.mark.parametrize("answers_lost", [False, True], ids=["answered", "answers_lost"])
async def test_woken_through_one_shard_it_leaves_every_shard_s_idle_set_before_its_forward(
        redis_url, engine, monkeypatch, answers_lost):
    """``answers_lost``: every idle registration reaches Redis but its answer is lost (the
    connection drops after the command ran): the worker cannot tell whether it is registered,
    so once it has work it withdraws anyway and takes no other shard's notice while busy."""
    gated = GatedEngine(engine)
    gated.finish.set()
    exits: list[int] = []
    async with sharded(redis_url, engine.info.queue_name) as q, \
            sharded(redis_url, engine.info.queue_name) as client:
        worker = _worker(gated, q, exits)
        if answers_lost:
            monkeypatch.setattr(q.consumer, "mark_idle", _answer_lost(q.consumer.mark_idle))
        run = asyncio.create_task(worker.run())

        await wait_for(lambda: _in_every_set(q, "idle"), 60, "the worker to register idle on every shard")
        await enqueue_ids(client.shard(0), "heavy", HEAVY_IDS)  # pops it from shard 0's set: 'work'
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)
        # Busy: in no idle set (before, it stayed in shard 1's, taking that shard's notices).
        assert await _in_sets(q, "idle") == [False, False]
        await _answer_heavy_and_stop(gated, client, worker, run)
    assert exits == []


async def test_a_heavy_forward_ending_after_a_light_wakeup_leaves_every_shard_s_pre_emptible_set(
        redis_url, engine, monkeypatch):
    """The last 'light' wake-up of a heavy forward (through shard 0) took the worker out of
    shard 0's set only; the forward ends before it registers again, and it must still leave
    shard 1's."""
    gated = GatedEngine(engine)
    exits: list[int] = []
    async with sharded(redis_url, engine.info.queue_name) as q, \
            sharded(redis_url, engine.info.queue_name) as client:
        worker = _worker(gated, q, exits)
        forwards: list[asyncio.Task] = []
        real_preempt_while, real_finish = worker.loop._preempt_while, worker.loop._finish

        async def preempt_while(forward, **kwargs):
            forwards.append(forward)
            await real_preempt_while(forward, **kwargs)

        async def finish(claim, outcome, **kwargs):
            if forwards and claim.num_tokens == sum(map(len, LIGHT_IDS)):
                await asyncio.wait({forwards[-1]})  # the heavy forward ends first
            await real_finish(claim, outcome, **kwargs)
        monkeypatch.setattr(worker.loop, "_preempt_while", preempt_while)
        monkeypatch.setattr(worker.loop, "_finish", finish)
        run = asyncio.create_task(worker.run())
        await wait_for(lambda: q.redis.exists(q.keys.heartbeat("sharded")), 60, "the first heartbeat")

        await enqueue_ids(client.shard(0), "heavy", HEAVY_IDS)
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)

        await wait_for(lambda: _in_every_set(q, "preemptible"), 30, "the worker to register as pre-emptible")
        await enqueue_ids(client.shard(0), "light", LIGHT_IDS)  # pops it from shard 0's set: 'light'

        async def offered():
            return worker.loop.preemption.waiting is not None
        await wait_for(offered, 30, "the light batch to be offered to the heavy forward")
        assert await _in_sets(q, "preemptible") == [False, True]
        gated.go.set()
        gated.finish.set()
        light = await answered_vectors(client.shard(0), "light", len(LIGHT_IDS))
        heavy = await answered_vectors(client.shard(0), "heavy", len(HEAVY_IDS))
        assert worker.loop.num_preemptions == 1 and light.shape[0] == 1 and heavy.shape[0] == 1
        # Answered after the pre-empting task ended: registered nowhere now.
        assert await _in_sets(q, "preemptible") == [False, False]
        worker.stop()
        await asyncio.wait_for(run, 30)
    assert exits == []


async def test_a_pre_emptible_registration_whose_answer_was_lost_is_withdrawn_when_the_forward_ends(
        redis_url, engine, monkeypatch):
    """The same for the pre-emptible sets: a heavy forward's registration reaches Redis, its
    answer is lost; the forward ends with the worker in no pre-emptible set."""
    gated = GatedEngine(engine)
    exits: list[int] = []
    async with sharded(redis_url, engine.info.queue_name) as q, \
            sharded(redis_url, engine.info.queue_name) as client:
        worker = _worker(gated, q, exits)
        monkeypatch.setattr(q.consumer, "mark_preemptible", _answer_lost(q.consumer.mark_preemptible))
        run = asyncio.create_task(worker.run())
        await wait_for(lambda: q.redis.exists(q.keys.heartbeat("sharded")), 60, "the first heartbeat")
        await enqueue_ids(client.shard(0), "heavy", HEAVY_IDS)
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)

        await wait_for(lambda: _in_every_set(q, "preemptible"), 30,
                       "the worker's registration to reach every shard")
        gated.go.set()
        gated.finish.set()
        heavy = await answered_vectors(client.shard(0), "heavy", len(HEAVY_IDS))
        assert heavy.shape[0] == 1
        # Withdrawn before the heavy batch's ack (the pre-empting task ends first).
        assert await _in_sets(q, "preemptible") == [False, False]
        worker.stop()
        await asyncio.wait_for(run, 30)
    assert exits == []


async def test_a_failed_registration_returns_only_once_every_shard_has_answered(redis_url):
    """One shard's command fails at once while another's is still out: the failure is raised
    only after that one has answered, so a withdrawal sent next cannot overtake it."""
    async with sharded(redis_url, QUEUE) as q:
        slow_done = asyncio.Event()

        async def fails(idle: bool) -> None:
            raise RedisConnectionError("shard 0 unreachable")

        async def slow(idle: bool) -> None:
            await asyncio.sleep(0.3)
            slow_done.set()
        q.shard(0).mark_idle = fails
        q.shard(1).mark_idle = slow
        with pytest.raises(RedisConnectionError, match="shard 0"):
            await q.consumer.mark_idle(True)
        assert slow_done.is_set()


async def test_a_notice_popping_a_lost_registration_while_the_next_is_out_still_leads_to_a_withdrawal(
        redis_url, engine, monkeypatch):
    """One shard. The first idle registration lands and its answer is lost; work arrives while
    the second is out, its notice popping the first, and the second lands after: the worker is
    in the set again though a notice was read. It must still withdraw before its forward."""
    gated = GatedEngine(engine)
    gated.finish.set()
    exits: list[int] = []
    async with sharded(redis_url, engine.info.queue_name, shards=1) as q, \
            sharded(redis_url, engine.info.queue_name, shards=1) as client:
        worker = _worker(gated, q, exits)
        real_mark = q.consumer.mark_idle
        registrations = 0

        async def mark_idle(idle: bool) -> None:
            nonlocal registrations
            if not idle:
                return await real_mark(idle)
            registrations += 1
            if registrations == 1:
                await real_mark(idle)
                raise RedisConnectionError("connection lost after the command ran")
            if registrations == 2:  # the work's notice pops the first registration meanwhile
                await enqueue_ids(client.shard(0), "heavy", HEAVY_IDS)

                async def notice_read():
                    return worker.wake.idle.wakeups == 1
                await wait_for(notice_read, 30, "the worker to read the work's notice")
            await real_mark(idle)
        monkeypatch.setattr(q.consumer, "mark_idle", mark_idle)
        run = asyncio.create_task(worker.run())
        assert await asyncio.to_thread(gated.heavy_entered.wait, 60)
        assert registrations == 2
        assert await _in_sets(q, "idle") == [False]
        await _answer_heavy_and_stop(gated, client, worker, run)
    assert exits == []


async def test_an_idle_worker_registers_on_the_shards_a_raised_count_adds(redis_url, engine):
    """Idle on its one shard when a gateway starts with 2: it registers on both at its next wait
    (before, it stayed in shard 0's set alone until a notice came, so every request that filled
    shard 1 woke every idle worker through that shard's work channel, not one)."""
    gated = GatedEngine(engine)
    exits: list[int] = []
    async with sharded(redis_url, engine.info.queue_name, shards=1) as q, \
            sharded(redis_url, engine.info.queue_name) as gateway:
        worker = _worker(gated, q, exits)
        run = asyncio.create_task(worker.run())
        await wait_for(lambda: _in_every_set(q, "idle"), 60, "the worker to register idle")
        await gateway.record_shard_count()

        async def on_both() -> bool:
            return q.claim_shards == SHARDS and await _in_every_set(q, "idle")
        await wait_for(on_both, 5, "the worker to register idle on the new shard too")
        worker.stop()
        await asyncio.wait_for(run, 30)
    assert exits == []
