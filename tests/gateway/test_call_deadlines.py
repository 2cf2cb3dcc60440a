"""How long the gateway keeps a call: the caller's own deadline (longer or shorter than the
default), and an error answered without waiting for the call's cancel. Real gateway in this
process, real Redis; no worker (nothing is ever answered)."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
import redis
from gateway_support import running_gateway

import tokq.redis.connection
from tokq import Client, TokqError
from tokq.redis.embedded import EmbeddedRedis


def _failed_call(port: int, timeout_s: float) -> tuple[TokqError, float]:
    with Client(f"127.0.0.1:{port}") as client:
        start = time.monotonic()
        with pytest.raises(TokqError) as err:
            client.embed(["no worker answers this"], timeout=timeout_s)
        return err.value, time.monotonic() - start


def test_a_call_deadline_longer_than_the_default_is_kept(redis_url):
    with running_gateway(redis_url, default_timeout_ms=300) as port:
        err, elapsed = _failed_call(port, timeout_s=2.0)
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED, err
    # Before: cut to the 300 ms default ("within the deadline (300 ms)").
    assert elapsed >= 1.5, (elapsed, err)
    assert "(300 ms)" not in str(err), err


def test_a_call_deadline_shorter_than_the_default_is_kept(redis_url):
    with running_gateway(redis_url, default_timeout_ms=60_000) as port:
        err, elapsed = _failed_call(port, timeout_s=0.5)
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert elapsed < 30, elapsed


@pytest.mark.slow
def test_a_redis_that_stops_answering_is_answered_after_one_socket_timeout(monkeypatch):
    """Its enqueue times out; the cancel that follows (a cancel script, which would time out
    too) runs after the answer, not before it: one socket timeout, not two."""
    monkeypatch.setattr(tokq.redis.connection, "SOCKET_TIMEOUT_S", 2.0)
    server = EmbeddedRedis().start()
    try:
        pid = int(redis.Redis.from_url(server.url).info("server")["process_id"])
        with running_gateway(server.url) as port:
            with Client(f"127.0.0.1:{port}") as client:  # the gateway's connections are open
                with pytest.raises(TokqError):
                    client.embed(["warm"], timeout=0.3)
            os.kill(pid, signal.SIGSTOP)
            try:
                err, elapsed = _failed_call(port, timeout_s=30)
            finally:
                os.kill(pid, signal.SIGCONT)
    finally:
        server.close()
    assert err.code == grpc.StatusCode.UNAVAILABLE, err
    assert elapsed < 3.5, elapsed  # before: ~4 s (the enqueue's 2 s, then the cancel's 2 s)


def test_a_call_deadline_is_cut_to_max_timeout_ms(redis_url):
    # A caller's deadline sets how long its entries and reply key may live in Redis (should its
    # gateway die): bounded by the gateway, not by the caller.
    with running_gateway(redis_url, max_timeout_ms=400) as port:
        for timeout_s in (60, None):  # none set: the 30 s default is cut too
            err, elapsed = _failed_call(port, timeout_s=timeout_s)
            assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED, err
            assert "(400 ms)" in str(err) and elapsed < 20, (elapsed, err)


async def test_shutdown_waits_for_the_cancels_started_meanwhile_then_stops_the_rest(redis_url):
    import asyncio

    from tokq.config import GatewayConfig, QueueConfig
    from tokq.redis.connection import connect, connect_pubsub
    from tokq.gateway.embedding import ServedModel
    from tokq.gateway.replies import ReplyRouter
    from tokq.gateway.tokenize import Tokenizer
    from tokq.model.info import ModelInfo
    from tokq.queue.sharded import ShardedQueue

    info = ModelInfo.load()
    client, pubsub = connect(redis_url), connect_pubsub(redis_url)
    queue = ShardedQueue(client, info.queue_name, QueueConfig())
    router = ReplyRouter(pubsub, client, queue.producer.reply_key,  # never started: no call goes through it
                         [k.notice_channel("gw") for k in queue.shard_keys()])
    served = ServedModel(info, Tokenizer(info), queue, router, GatewayConfig(), "gw")
    finished = []

    async def cancel_script(delay_s: float, then=None):
        await asyncio.sleep(delay_s)
        finished.append(delay_s)
        if then is not None:  # starts another one, as a call cancelled by the stop does
            served._track_cancel(asyncio.create_task(cancel_script(then)))

    try:
        served._track_cancel(asyncio.create_task(cancel_script(0.1, then=0.2)))
        stuck = asyncio.create_task(cancel_script(3600))  # a Redis that does not answer
        served._track_cancel(stuck)
        start = asyncio.get_running_loop().time()
        await served.finish_cancels(1.0)
        assert finished == [0.1, 0.2]  # the one started meanwhile was waited for too
        assert stuck.cancelled() and not served._cancels
        assert asyncio.get_running_loop().time() - start < 5

        # None running yet, one call's enqueue still out: cancelled by the stop, it starts its
        # cancel once the enqueue answers, which the shutdown waits for too.
        async def enqueue_answered_late():
            served._enqueuing += 1
            await asyncio.sleep(0.3)
            served._enqueuing -= 1
            served._track_cancel(asyncio.create_task(cancel_script(0.05)))
        late = asyncio.create_task(enqueue_answered_late())
        await asyncio.sleep(0)
        await served.finish_cancels(2.0)
        assert late.done() and finished[-1] == 0.05 and not served._cancels
    finally:
        served.tokenizer.close()
        await queue.close()
        await client.aclose()
        await pubsub.aclose()
