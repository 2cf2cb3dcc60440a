"""Error mapping (gateway/errors.py): real Redis refusals are retryable UNAVAILABLE, and no caller
ever reads a host:port or an exception's text; those go to the log under a correlation id."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import grpc
import pytest
import redis
import redis.asyncio as aioredis
import redis.exceptions

from tokq.redis.connection import connect
from tokq.gateway.errors import (UNAVAILABLE_MESSAGE, InvalidArgument, Unavailable, from_result_code,
                                 to_status)
from tokq.queue.shard import Queue, QueueFull
from tokq.redis.embedded import EmbeddedRedis

ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+|localhost|:\d{2,5}\b")


@pytest.fixture
def own_redis():
    """A server these tests may break (read-only, out of memory, busy) without touching others'."""
    with EmbeddedRedis() as server:
        yield server


def assert_retryable(exc: BaseException) -> None:
    code, message = to_status(exc)
    assert code == grpc.StatusCode.UNAVAILABLE, (code, message)
    assert message.startswith(UNAVAILABLE_MESSAGE)
    assert not ADDRESS.search(message) and str(exc) not in message


async def enqueue_one(url: str) -> None:
    client = connect(url)
    try:
        await Queue(client, "errors-test").enqueue("r1", [(3, b"body")], timeout_ms=1000, notice_channel="c")
    finally:
        await client.aclose()


async def test_readonly_replica_is_unavailable(own_redis):
    sync = redis.Redis.from_url(own_redis.url)
    sync.config_set("masterauth", own_redis.password)
    sync.replicaof("127.0.0.1", own_redis.port)  # itself: enough to make it a read-only replica
    with pytest.raises(redis.exceptions.RedisError) as err:
        await enqueue_one(own_redis.url)
    assert isinstance(err.value, redis.exceptions.ReadOnlyError)
    assert_retryable(err.value)
    sync.replicaof("NO", "ONE")


async def test_out_of_memory_is_unavailable(own_redis):
    sync = redis.Redis.from_url(own_redis.url)
    sync.set("filler", "x" * 100_000)
    sync.config_set("maxmemory", 1)
    sync.config_set("maxmemory-policy", "noeviction")
    with pytest.raises(redis.exceptions.RedisError) as err:
        await enqueue_one(own_redis.url)
    assert isinstance(err.value, redis.exceptions.OutOfMemoryError)
    assert_retryable(err.value)


async def test_busy_script_is_unavailable(own_redis):
    sync = redis.Redis.from_url(own_redis.url)
    sync.config_set("busy-reply-threshold", 50)
    spinning = threading.Thread(target=lambda: _spin(own_redis.url), daemon=True)
    spinning.start()
    try:
        deadline = time.monotonic() + 20
        while True:  # until Redis answers BUSY: a sleep cannot tell that the script has started
            try:
                await asyncio.to_thread(sync.ping)
            except redis.exceptions.RedisError as exc:
                if "busy" in str(exc).lower():
                    break
                raise
            assert time.monotonic() < deadline, "the spinning script never made Redis busy"
            await asyncio.sleep(0.05)
        with pytest.raises(redis.exceptions.RedisError) as err:
            await enqueue_one(own_redis.url)
        assert "busy" in str(err.value).lower(), repr(err.value)
        assert_retryable(err.value)
    finally:
        for _ in range(50):
            try:
                sync.script_kill()
                break
            except redis.exceptions.ResponseError:
                await asyncio.sleep(0.05)
        spinning.join(5)


def _spin(url: str) -> None:
    try:
        redis.Redis.from_url(url).eval("while true do end", 0)
    except redis.exceptions.RedisError:
        pass  # killed by the test


def test_loading_and_lost_connections_are_unavailable():
    # LOADING (a restarted Redis reading its dump) as redis-py's own parser makes it.
    from redis._parsers import _RESP2Parser

    loading = _RESP2Parser(socket_read_size=65536).parse_error("LOADING Redis is loading the dataset in memory")
    assert isinstance(loading, redis.exceptions.BusyLoadingError)
    assert_retryable(loading)
    assert_retryable(redis.exceptions.ConnectionError("Error 111 connecting to 10.1.2.3:6379."))
    assert_retryable(redis.exceptions.TimeoutError("Timeout reading from 10.1.2.3:6379"))
    assert_retryable(ConnectionResetError(104, "Connection reset by peer"))
    # a lost answer, as the queue client reports it
    assert to_status(Unavailable(UNAVAILABLE_MESSAGE))[0] == grpc.StatusCode.UNAVAILABLE


async def test_unreachable_redis_is_unavailable_without_its_address():
    from tokq.redis.embedded import free_port

    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    with pytest.raises(redis.exceptions.ConnectionError) as err:
        await client.ping()
    await client.aclose()
    assert "127.0.0.1" in str(err.value)
    assert_retryable(err.value)


def test_internal_errors_carry_a_correlation_id_not_the_exception(caplog):
    caplog.set_level(logging.ERROR, logger="tokq.gateway.errors")
    code, message = to_status(RuntimeError("secret detail at 10.0.0.7:6379"))
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in message and not ADDRESS.search(message)
    cid = re.search(r"\[([0-9a-f]{8})\]", message).group(1)
    logged = [r.getMessage() for r in caplog.records]
    assert any(cid in line and "secret detail at 10.0.0.7:6379" in line for line in logged)
    # a worker's INTERNAL reply (its exception text) is logged, not shown
    err = from_result_code("INTERNAL", "RuntimeError: CUDA error at /opt/model.py:12")
    assert err.code == grpc.StatusCode.INTERNAL and "CUDA" not in err.message
    assert re.search(r"\[[0-9a-f]{8}\]", err.message)


def test_caller_errors_keep_their_status_and_message():
    assert to_status(InvalidArgument("bad")) == (grpc.StatusCode.INVALID_ARGUMENT, "bad")
    code, message = to_status(QueueFull(10, 5, 12))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "cap of 12" in message
    assert to_status(TimeoutError())[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert from_result_code("DEADLINE_EXCEEDED", "late").message == "late"
    assert from_result_code("INVALID_ARGUMENT", "token id 99999 >= vocab").code == (
        grpc.StatusCode.INVALID_ARGUMENT)
    assert from_result_code("NOT_A_CODE", "x").code == grpc.StatusCode.INTERNAL
