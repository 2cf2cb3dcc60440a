"""Enqueues started while one is in flight go to Redis together as one pipeline (tokq.redis.pipeline),
and each caller still gets its own answer or error, on a standalone server and on a cluster."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster
from tokq.testing.fault_proxy import FaultProxy, script_sha
from queue_support import NOTICE_CHANNEL, QUEUE, items, open_queue, stored_entries

from tokq.config import QueueConfig
from tokq.redis.connection import connect
from tokq.redis.pipeline import RELEASE_AFTER_S, pack_command
from tokq.queue.shard import Enqueued, LostAnswer, Queue, QueueFull
from tokq.queue.sharded import ShardedQueue

pytestmark = pytest.mark.redis_kinds("standalone", "cluster")


async def _evalsha_calls(client) -> int:
    """EVALSHA commands Redis ran, summed over every node of a cluster."""
    if isinstance(client, RedisCluster):
        per_node = await client.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
        return sum(v.get("cmdstat_evalsha", {}).get("calls", 0) for v in per_node.values())
    return (await client.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)


async def test_concurrent_enqueues_share_one_pipeline_and_each_gets_its_own_answer(redis_url):
    async with open_queue(redis_url) as q:
        await q.enqueue("warm", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)  # scripts loaded
        pipelines, commands = q.pipeliner.pipelines, q.pipeliner.commands
        requests = {f"r{i}": items(*range(1, i + 2)) for i in range(8)}
        results = await asyncio.gather(*(q.enqueue(rid, its, timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
                                         for rid, its in requests.items()))
        # the first went alone at once; the seven started while it was in flight, together
        assert q.pipeliner.pipelines - pipelines == 2
        assert q.pipeliner.commands - commands == 8
        for (rid, its), enqueued in zip(requests.items(), results):
            assert isinstance(enqueued, Enqueued) and enqueued.request_id == rid
            # every request's own entries, queued whole
            expected = set(stored_entries(enqueued, its))
            assert expected <= set(await q.redis.lrange(q.keys.pending, 0, -1)) | set(
                await q.redis.lrange(q.keys.heavy, 0, -1))
        # the answers are those of one run each: running them again (idempotent) returns the same
        again = [await q.enqueue(rid, its, timeout_ms=60_000, notice_channel=NOTICE_CHANNEL) for rid, its in requests.items()]
        assert again == results


async def test_with_a_hold_a_burst_right_behind_a_round_trip_goes_in_one_and_a_lone_call_at_once(redis_url):
    async with open_queue(redis_url) as q:
        await q.enqueue("warm", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)  # scripts loaded
        q.pipeliner.hold_s = 2.0  # long, so that a slow machine still starts the burst within it
        pipelines, commands = q.pipeliner.pipelines, q.pipeliner.commands
        first = await q.enqueue("first", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        assert (q.pipeliner.pipelines - pipelines, q.pipeliner.commands - commands) == (1, 1)  # at once
        results = await asyncio.gather(*(q.enqueue(f"r{i}", items(i + 1), timeout_ms=60_000,
                                                   notice_channel=NOTICE_CHANNEL) for i in range(5)))
        # started within the hold of the last round trip: r0 waited for the rest, all went together
        # (without a hold: r0 alone, then r1-r4)
        assert (q.pipeliner.pipelines - pipelines, q.pipeliner.commands - commands) == (2, 6)
        assert [r.request_id for r in results] == [f"r{i}" for i in range(5)]
        stats = await q.stats()
        assert isinstance(first, Enqueued) and (stats.queued_entries, stats.queued_tokens) == (7, 1 + 1 + 15)


async def test_a_queue_full_in_a_pipeline_fails_only_its_own_call(redis_url):
    async with open_queue(redis_url, max_queued_tokens=20) as q:
        await q.enqueue("warm", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        pipelines = q.pipeliner.pipelines
        calls = [q.enqueue("first", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL),
                 q.enqueue("small-1", items(3), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL),
                 q.enqueue("too-big", items(30), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL),
                 q.enqueue("small-2", items(4), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL),
                 q.enqueue("bad id:", items(4), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)]
        first, small1, full, small2, bad = await asyncio.gather(*calls, return_exceptions=True)
        # "first" alone, then the three valid ones in one pipeline (the bad id never left)
        assert q.pipeliner.pipelines - pipelines == 2 and isinstance(first, Enqueued)
        assert isinstance(small1, Enqueued) and isinstance(small2, Enqueued)
        assert isinstance(full, QueueFull) and full.request_tokens == 30
        assert isinstance(bad, ValueError)
        assert not await q.redis.exists(q.keys.reply("too-big"))


async def test_a_script_redis_forgot_is_loaded_and_every_call_answered(redis_url):
    async with open_queue(redis_url) as q:
        await q.enqueue("warm", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        await q.redis.script_flush()  # on a cluster: every node
        pipelines = q.pipeliner.pipelines
        results = await asyncio.gather(*(q.enqueue(f"r{i}", items(2), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
                                         for i in range(5)))
        # r0 alone (loads the script), then 4 in a pipeline: each known by then, or run again alone
        assert q.pipeliner.pipelines - pipelines == 2
        assert [r.request_id for r in results] == [f"r{i}" for i in range(5)]
        assert len(await q.redis.lrange(q.keys.pending, 0, -1)) == 6  # each queued once


async def test_a_call_cancelled_by_its_caller_leaves_nothing_and_others_go_on(redis_url):
    """However the cancel falls (before its pipeline left, or after), once the caller sees it
    the enqueue is answered or never sent: the caller's cancel script leaves no reply behind."""
    async with open_queue(redis_url) as q:
        await q.enqueue("warm", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        for n, (yields, dropped) in enumerate((y, d) for y in range(4) for d in range(3)):
            # call 0 goes alone at once; 1 and 2 wait for it and then go together
            calls = [asyncio.ensure_future(q.enqueue(f"c{n}.{i}", items(2), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL))
                     for i in range(3)]
            for _ in range(yields):
                await asyncio.sleep(0)
            calls[dropped].cancel()
            # (redis-py lets a command already sent finish: a lone call may still return)
            with contextlib.suppress(asyncio.CancelledError):
                await calls[dropped]
            await q.cancel(f"c{n}.{dropped}")  # what the gateway does next
            assert not await q.redis.exists(q.keys.reply(f"c{n}.{dropped}"))
            for i, call in enumerate(calls):
                if i != dropped:
                    assert (await call).request_id == f"c{n}.{i}"
                    assert await q.redis.exists(q.keys.reply(f"c{n}.{i}"))


async def test_a_call_cancelled_while_its_pipeline_is_in_flight_returns_after_the_answer(redis_url):
    """A cancel script sent by the caller's clean-up must not overtake its enqueue."""
    async with open_queue(redis_url) as q:
        await q.enqueue("warm", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        pipelines = q.pipeliner.pipelines
        tasks = [asyncio.ensure_future(q.enqueue(f"r{i}", items(2), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL))
                 for i in range(3)]
        while q.pipeliner.pipelines - pipelines < 2:  # r0 alone, then r1 and r2 sent together
            await asyncio.sleep(0)
        tasks[1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        assert await q.redis.exists(q.keys.reply("r1"))  # it ran before the caller went on
        assert await q.cancel("r1")
        assert not await q.redis.exists(q.keys.reply("r1"))
        assert [(await tasks[i]).request_id for i in (0, 2)] == ["r0", "r2"]


async def test_each_shard_pipelines_its_own_enqueues(redis_url):
    client = connect(redis_url)
    try:
        queue = ShardedQueue(client, "m", QueueConfig(queue_shards=4))
        carried = []
        queue.producer.observe_enqueues = carried.append
        await asyncio.gather(*(queue.shard(i).enqueue(f"w{i}", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
                               for i in range(4)))  # scripts loaded on every node
        carried.clear()
        results = await asyncio.gather(*(queue.producer.enqueue(f"r{i}", items(i + 1), timeout_ms=60_000,
                                                                gateway_id="g") for i in range(40)))
        assert sum(carried) == 40 and len(carried) < 40  # some round trips carried several
        shards = {queue.producer.shard_of_request(f"r{i}") for i in range(40)}
        assert len(carried) <= 2 * len(shards)  # per shard: one alone, then the rest together
        for i, r in enumerate(results):
            shard = queue.shard(queue.producer.shard_of_request(f"r{i}"))
            assert r.request_id == f"r{i}" and await client.exists(shard.keys.reply(f"r{i}"))
    finally:
        await client.aclose()


async def test_the_gateway_s_enqueue_hold_reaches_every_shard_made_before_or_after_it_is_set(redis_url):
    client = connect(redis_url)
    try:
        queue = ShardedQueue(client, "m", QueueConfig(queue_shards=4))
        before = queue.shard(0)
        assert before.pipeliner.hold_s == 0  # workers and tests: never hold
        queue.producer.enqueue_hold_s = 0.002
        assert [queue.shard(i).pipeliner.hold_s for i in range(4)] == [0.002] * 4
        assert queue.shard(0) is before
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def _one_connection(redis_url: str, pool_timeout_s: float):
    """A client whose pool holds one connection: what a pipeliner keeps shows as others waiting."""
    client = connect(redis_url, max_connections=1, pool_timeout_s=pool_timeout_s)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.mark.redis_kinds("standalone")
async def test_an_idle_pipeliner_holds_no_connection_of_the_pool(redis_url):
    # One connection in all: every shard's pipeliner and every other command share it, which
    # only works if a pipeliner gives its connection back once it has had nothing to send for
    # RELEASE_AFTER_S (the other commands wait that long in the pool's queue).
    async with _one_connection(redis_url, 2.0) as client:
        queue = ShardedQueue(client, "m", QueueConfig(queue_shards=3))
        for round_ in range(2):
            for i in range(3):
                shard = queue.shard(i)
                results = await asyncio.gather(*(shard.enqueue(f"r{round_}-{i}-{j}", items(1), timeout_ms=60_000,
                                                               notice_channel=NOTICE_CHANNEL) for j in range(3)))
                assert [r.request_id for r in results] == [f"r{round_}-{i}-{j}" for j in range(3)]
                assert (await shard.stats()).queued_entries == 3 * (round_ + 1)  # not through the pipeliner


@pytest.mark.redis_kinds("standalone")
async def test_round_trips_in_quick_succession_keep_one_connection_given_back_once_idle(redis_url):
    # Under load a round trip follows the last within milliseconds: the pipeliner keeps its
    # connection between them instead of a pool checkout each, and gives it back once idle.
    async with _one_connection(redis_url, 0.5) as client:
        pool = client.connection_pool
        get_connection = pool.get_connection
        taken = 0

        async def counted(*args, **kwargs):
            nonlocal taken
            taken += 1
            return await get_connection(*args, **kwargs)

        q = Queue(client, QUEUE)
        await q.enqueue("warm", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)  # scripts loaded
        await asyncio.sleep(4 * RELEASE_AFTER_S)
        pool.get_connection = counted
        pipelines = q.pipeliner.pipelines
        for i in range(10):  # one after another: each its own round trip
            await q.enqueue(f"r{i}", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        assert (q.pipeliner.pipelines - pipelines, taken) == (10, 1)
        await asyncio.sleep(4 * RELEASE_AFTER_S)
        assert (await q.stats()).queued_entries == 11  # the pool's one connection, back in it


@pytest.mark.redis_kinds("standalone")
async def test_a_held_connection_goes_back_when_a_hold_ends_with_nothing_to_send_or_on_close(redis_url):
    async with _one_connection(redis_url, 0.1) as client:
        q = Queue(client, QUEUE)
        await q.enqueue("warm", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        q.pipeliner.hold_s = 4 * RELEASE_AFTER_S  # longer than the linger: its timer fires meanwhile
        await q.enqueue("first", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        held = asyncio.ensure_future(q.enqueue("held", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL))
        await asyncio.sleep(0)
        held.cancel()  # the hold then ends with nothing to send
        with contextlib.suppress(asyncio.CancelledError):
            await held
        await asyncio.sleep(8 * RELEASE_AFTER_S)
        assert (await q.stats()).queued_entries == 2  # the pool's one connection, back in it
        await q.enqueue("again", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        await q.pipeliner.aclose()  # at once, not after the linger
        assert (await q.stats()).queued_entries == 3


@pytest.mark.redis_kinds("standalone")
async def test_a_run_whose_arguments_cannot_be_sent_fails_alone(redis_url):
    async with open_queue(redis_url) as q:
        await q.enqueue("warm", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        first = asyncio.ensure_future(q.enqueue("r0", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL))
        await asyncio.sleep(0)  # out alone: the next ones share the round trip after it
        bad = asyncio.ensure_future(q.pipeliner.run("cancel", [q.keys.reply("x"), q.keys.counters,
                                                              q.keys.cancelled("x")], [object()]))
        rest = [asyncio.ensure_future(q.enqueue(f"r{i}", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL))
                for i in (1, 2)]
        pipelines, cancels = q.pipeliner.pipelines, q.scripts.calls["cancel"]
        with pytest.raises(redis.exceptions.DataError):
            await bad
        assert [e.request_id for e in await asyncio.gather(first, *rest)] == ["r0", "r1", "r2"]
        assert q.pipeliner.pipelines - pipelines == 1  # the three behind r0 went together
        assert q.scripts.calls["cancel"] == cancels  # and the one not sent is not counted as run


@pytest.mark.redis_kinds("standalone")  # the fault proxy stands before one server
async def test_an_answer_lost_for_a_pipeline_is_retried_and_each_call_gets_its_one_run(redis_url):
    proxy = FaultProxy(redis_url).start()
    try:
        async with open_queue(redis_url) as direct, open_queue(proxy.url) as q:
            await q.enqueue("warm", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
            proxy.cut_next(b"pipelined-2")  # the pipeline holding it loses its answers
            pipelines = q.pipeliner.pipelines
            results = await asyncio.gather(*(q.enqueue(f"pipelined-{i}", items(i + 1), timeout_ms=60_000,
                                                       notice_channel=NOTICE_CHANNEL) for i in range(4)))
            assert proxy.cuts == 1 and q.pipeliner.pipelines - pipelines == 2  # 0 alone; 1-3 together
            assert [r.request_id for r in results] == [f"pipelined-{i}" for i in range(4)]
            # 1-3 ran twice (the lost answers, redis-py's retry), each queued once
            stats = await direct.stats()
            assert stats.queued_entries == 5 and stats.queued_tokens == 1 + 1 + 2 + 3 + 4
            again = await asyncio.gather(*(direct.enqueue(f"pipelined-{i}", items(i + 1), timeout_ms=60_000,
                                                          notice_channel=NOTICE_CHANNEL) for i in range(4)))
            assert again == results  # the answers the callers got are those of the first runs
    finally:
        proxy.close()


@pytest.mark.redis_kinds("standalone")
async def test_a_pipeline_whose_every_answer_is_lost_raises_lost_answer_to_each_call(redis_url):
    proxy = FaultProxy(redis_url).start()
    try:
        async with open_queue(proxy.url) as q:
            await q.stats()  # scripts loaded, connection warm
            proxy.cut_rate(1.0, script_sha("enqueue"))
            pipelines = q.pipeliner.pipelines
            outcomes = await asyncio.gather(*(q.enqueue(f"r{i}", items(1), timeout_ms=5_000, notice_channel=NOTICE_CHANNEL)
                                              for i in range(3)), return_exceptions=True)
            assert q.pipeliner.pipelines - pipelines == 2  # r0 alone, then r1 and r2 together
            assert all(isinstance(o, LostAnswer) and "enqueue" in str(o) for o in outcomes), outcomes
            proxy.reset()
            assert (await q.stats()).queued_entries == 3  # they did run; the callers cancel them
            assert all([await q.cancel(f"r{i}") for i in range(3)])
    finally:
        proxy.close()


@contextlib.asynccontextmanager
async def _through_proxy(redis_url: str, socket_timeout: float):
    """A queue whose client talks to Redis through a fault proxy, its scripts loaded."""
    proxy = FaultProxy(redis_url).start()
    client = aioredis.Redis.from_url(proxy.url, socket_timeout=socket_timeout, decode_responses=False)
    try:
        q = Queue(client, QUEUE)
        await q.enqueue("warm", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        yield proxy, q
    finally:
        await client.aclose()
        proxy.close()


@pytest.mark.redis_kinds("standalone")
async def test_a_lone_call_cancelled_while_out_returns_after_its_answer(redis_url):
    # As for a pipeline's calls (above), for a call that went alone: its answer is withheld, it
    # is cancelled meanwhile, and it returns only once the answer came, its connection kept.
    async with _through_proxy(redis_url, socket_timeout=30) as (proxy, q), \
            contextlib.aclosing(aioredis.Redis.from_url(redis_url)) as direct:
        pipelines = q.pipeliner.pipelines
        proxy.pause()
        task = asyncio.ensure_future(q.enqueue("r0", items(2), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL))
        while not await direct.exists(q.keys.reply("r0")):  # it ran; its answer is held
            await asyncio.sleep(0.01)
        assert q.pipeliner.pipelines - pipelines == 1
        task.cancel()
        await asyncio.sleep(0.2)
        assert not task.done()  # waiting for the answer, not gone with the command still out
        proxy.pause(False)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)  # the answer came (the socket timeout is 30 s)
        assert await q.cancel("r0")  # the caller's clean-up, after its enqueue
        assert not await direct.exists(q.keys.reply("r0"))
        assert isinstance(await q.enqueue("after", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL), Enqueued)


@pytest.mark.redis_kinds("standalone")
async def test_closing_waits_for_the_round_trip_in_flight_before_giving_its_connection_back(redis_url):
    # The connection goes back to the pool only once the round trip on it is over: given back
    # before, another command could take it and read this round trip's answer as its own.
    async with _through_proxy(redis_url, socket_timeout=1.0) as (proxy, q), \
            contextlib.aclosing(aioredis.Redis.from_url(redis_url)) as direct:
        proxy.stall()  # its answer withheld: the round trip ends by its timeout
        task = asyncio.ensure_future(q.enqueue("r0", items(2), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL))
        while not await direct.exists(q.keys.reply("r0")):  # it ran; its answer is held
            await asyncio.sleep(0.01)
        closing = asyncio.ensure_future(q.pipeliner.aclose())
        await asyncio.sleep(0.2)
        assert not closing.done()
        await closing
        assert task.done()  # the round trip was over before its connection went back
        with pytest.raises(LostAnswer):
            await task


@pytest.mark.redis_kinds("standalone")
async def test_a_silent_redis_fails_the_round_trip_by_the_socket_timeout_and_the_next_one_works(redis_url):
    # The pipeliner's held connection has no timeout of its own: its round trip's does the job.
    async with _through_proxy(redis_url, socket_timeout=0.5) as (proxy, q):
        proxy.stall()
        outcomes = await asyncio.wait_for(asyncio.gather(
            *(q.enqueue(f"r{i}", items(1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL) for i in range(3)),
            return_exceptions=True), timeout=60)
        assert all(isinstance(o, LostAnswer) for o in outcomes), outcomes
        proxy.stall(False)
        # They ran, unanswered. A fresh connection reads no withheld answer as the next call's:
        # r0 again with two items is refused as a duplicate, where a stale OK would pass.
        with pytest.raises(ValueError, match="already used"):
            await q.enqueue("r0", items(1, 1), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        assert isinstance(await q.enqueue("after", items(2), timeout_ms=60_000, notice_channel=NOTICE_CHANNEL), Enqueued)


def test_commands_are_packed_as_redis_py_packs_them():
    from redis.asyncio.connection import Connection

    args = ("EVALSHA", "ab" * 20, 3, "k1", "{q}:é", b"\x00\r\n\xff", 0, -5, 2 ** 40, 1.5, "", b"",
            memoryview(b"mv"))
    assert pack_command(*args) == b"".join(Connection().pack_command(*args))
    for bad in (True, None, [1], bytearray(b"x")):
        with pytest.raises(redis.exceptions.DataError):
            pack_command("EVALSHA", bad)
