"""How a waiting call gets its results (gateway/replies.py, gateway/embedding.py): in the
completion notice itself when they are small (no collect round trip), collected when the notice
names the request only (large results), collected by the poll when the notice was missed, and
what a broken subscription does to waiting calls.
Real Redis, the bundled model's tokenizer and the gateway's ServedModel in this process; the
test answers the queued items itself with known vectors, as a worker would."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from queue_support import wait_for

from tokq.config import GatewayConfig, QueueConfig
from tokq.redis.connection import connect, connect_pubsub
from tokq.queue.wire import encode_ok
from tokq.gateway.embedding import EmbedInput, ServedModel, Timer
from tokq.gateway.replies import ReplyRouter
from tokq.model.info import ModelInfo
from tokq.queue.sharded import ShardedQueue

GATEWAY = "gw-replies"
GATEWAY_CONFIG = GatewayConfig()


@pytest.fixture(scope="module")
def info(bundled_model_dir):
    return ModelInfo.load(bundled_model_dir)


async def _answer(queue, call: asyncio.Task, vector_size: int) -> None:
    """Claim ``call``'s queued inputs and answer them as a worker would: input i with
    ``vector_size`` floats, all i + 1."""
    claim = None

    async def claimed():
        nonlocal claim
        assert not call.done(), call.exception()
        claim = await queue.consumer.claim(4096)
        return claim is not None
    await wait_for(claimed, 20, "the call's inputs to claim")
    await queue.consumer.ack(claim.batch_id, [
        (e, encode_ok(np.full(vector_size, e.index + 1, np.float32), 1.0, 2.0)) for e in claim.entries])


async def _call(redis_url, info, tokenizer, texts, vector_size: int, *, listen: bool = True):
    """One Embed of ``texts`` answered with vectors of ``vector_size`` floats (input i: all i+1).
    ``listen=False``: the router listens on another channel, so the notice never reaches it.
    Returns (vectors, collect scripts run, reply keys left)."""
    client, pubsub = connect(redis_url), connect_pubsub(redis_url)
    queue = ShardedQueue(client, info.queue_name, QueueConfig())
    channels = [k.notice_channel(GATEWAY if listen else "elsewhere") for k in queue.shard_keys()]
    # Listening, the poll is held off: on a loaded machine a poll landing between the answer
    # and its notice collects the results itself, and the notice's delivery goes untested.
    router = ReplyRouter(pubsub, client, queue.producer.reply_key, channels,
                         poll_after_s=3600 if listen else 0.05, poll_every_s=0.05)
    await router.start()
    await router.subscribed.wait()
    try:
        served = ServedModel(info, tokenizer, queue, router, GatewayConfig(), GATEWAY)
        call = asyncio.create_task(served.embed(EmbedInput(texts=texts), Timer(30)))
        await _answer(queue, call, vector_size)
        out = await asyncio.wait_for(call, 20)
        collects = sum(queue.shard(i).scripts.calls["collect"] for i in range(queue.num_shards))
        replies = [k async for k in client.scan_iter(match=queue.producer.reply_key("*"))]
        return [v.tolist() for v in out.vectors], collects, replies
    finally:
        await router.stop()
        await client.aclose()
        await pubsub.aclose()


def test_small_results_come_in_the_notice_without_a_collect(redis_url, info, tokenizer):
    vectors, collects, replies = asyncio.run(_call(redis_url, info, tokenizer, ["a", "bc"], 4))
    assert vectors == [[1.0] * 4, [2.0] * 4]
    assert collects == 0
    assert len(replies) == 1  # kept a short grace for a gateway that missed the notice


def test_large_results_are_collected_after_a_notice_naming_the_request(redis_url, info, tokenizer):
    vectors, collects, replies = asyncio.run(_call(redis_url, info, tokenizer, ["a", "bc"], 10_000))
    assert vectors == [[1.0] * 10_000, [2.0] * 10_000]
    assert collects == 1 and replies == []


def test_a_missed_notice_is_made_up_for_by_the_poll(redis_url, info, tokenizer):
    vectors, collects, replies = asyncio.run(
        _call(redis_url, info, tokenizer, ["a", "bc"], 4, listen=False))
    assert vectors == [[1.0] * 4, [2.0] * 4]
    assert collects == 1 and replies == []


async def _queued(queue, call: asyncio.Task) -> bool:
    assert not call.done(), call.exception()
    return (await queue.stats.read()).queued_entries > 0


async def test_a_broken_subscription_is_restored_under_waiting_calls_or_fails_them_unavailable(
        redis_url, info, tokenizer):
    # The README: a subscription that breaks while calls wait is restored at once when Redis
    # answers (the calls keep waiting and are answered); when its reconnect fails, the waiting
    # calls are answered UNAVAILABLE at once, not at their deadline, and cancelled. The poll is
    # held off here, so only the restored subscription can answer the first call.
    from tokq.testing.fault_proxy import FaultProxy

    from tokq.gateway.errors import Unavailable

    proxy = FaultProxy(redis_url).start()
    client, pubsub = connect(redis_url), connect_pubsub(proxy.url)  # only the subscription proxied
    router = None
    try:
        queue = ShardedQueue(client, info.queue_name, QueueConfig())
        router = ReplyRouter(pubsub, client, queue.producer.reply_key, [k.notice_channel(GATEWAY) for k in queue.shard_keys()],
                             poll_after_s=3600)
        await router.start()
        await asyncio.wait_for(router.subscribed.wait(), 20)
        served = ServedModel(info, tokenizer, queue, router, GATEWAY_CONFIG, GATEWAY)
        call = asyncio.create_task(served.embed(EmbedInput(texts=["through a break"]), Timer(30)))
        await wait_for(lambda: _queued(queue, call), 20, "the call's entry")
        assert await asyncio.to_thread(proxy.drop_connections, b"SUBSCRIBE") == 1

        channel = queue.shard_keys()[0].notice_channel(GATEWAY)

        async def subscribed_again():  # a new link has subscribed, and Redis counts one subscriber
            return (await asyncio.to_thread(proxy.connections, b"SUBSCRIBE") == 1
                    and (await client.execute_command("PUBSUB", "SHARDNUMSUB", channel))[1] == 1)
        await wait_for(subscribed_again, 20, "the subscription to be restored")
        await _answer(queue, call, 4)
        out = await asyncio.wait_for(call, 20)  # by the notice: the poll is an hour away
        assert [v.tolist() for v in out.vectors] == [[1.0] * 4]

        waiting = asyncio.create_task(served.embed(EmbedInput(texts=["left waiting"]), Timer(30)))
        await wait_for(lambda: _queued(queue, waiting), 20, "the call's entry")
        proxy.close()  # the subscriber's Redis is gone: its reconnects are refused
        with pytest.raises(Unavailable, match="lost the connection to Redis"):
            await asyncio.wait_for(waiting, 5)  # its deadline is 30 s away
        async def cancelled():  # (after the answer: the cancel is not waited for)
            return (await queue.stats.read()).counters["cancelled"] == 1
        await wait_for(cancelled, 10, "the call to be cancelled")  # claims drop it
    finally:
        if router is not None:
            await router.stop()
        await client.aclose()
        await pubsub.aclose()
        proxy.close()


async def test_a_notice_that_does_not_parse_costs_nothing_but_itself(redis_url, info, tokenizer,
                                                                       caplog):
    """Logged and dropped by the subscriber's reader: the subscription stays (no resubscribe,
    which would lose the notices published meanwhile) and the next notice answers its call."""
    client, pubsub = connect(redis_url), connect_pubsub(redis_url)
    queue = ShardedQueue(client, info.queue_name, QueueConfig())
    channel = queue.shard_keys()[0].notice_channel(GATEWAY)
    router = ReplyRouter(pubsub, client, queue.producer.reply_key,
                         [k.notice_channel(GATEWAY) for k in queue.shard_keys()], poll_after_s=3600)
    await router.start()

    async def ssubscribes() -> int:
        stats = await client.info("commandstats")
        return int(stats.get("cmdstat_ssubscribe", {}).get("calls", 0))
    try:
        await asyncio.wait_for(router.subscribed.wait(), 20)
        before = await ssubscribes()
        served = ServedModel(info, tokenizer, queue, router, GATEWAY_CONFIG, GATEWAY)
        call = asyncio.create_task(served.embed(EmbedInput(texts=["after a bad notice"]), Timer(30)))
        await wait_for(lambda: _queued(queue, call), 20, "the call's entry")
        await client.spublish(channel, b"99:not a notice")
        await wait_for(lambda: asyncio.sleep(0, "was not handled" in caplog.text), 10,
                       "the bad notice logged")
        await _answer(queue, call, 4)
        out = await asyncio.wait_for(call, 20)  # by its notice: the poll is an hour away
        assert [v.tolist() for v in out.vectors] == [[1.0] * 4]
        assert queue.shard(0).scripts.calls["collect"] == 0
        await asyncio.sleep(0.5)  # a resubscribe (the old way) would have happened by now
        assert await ssubscribes() == before and router.subscribed.is_set()
    finally:
        await router.stop()
        await client.aclose()
        await pubsub.aclose()
