"""Connect timeouts are retried, read timeouts are not (tokq/connection.py).

A first connect slower than CONNECT_TIMEOUT_S (a loaded machine, a busy Redis slow to accept)
is tried again by the connection itself: nothing was sent on it yet. A command whose answer does
not come within the socket timeout fails to the caller, run once: it may have run, and the
caller decides. Real servers; the slow connect is the socket connect step made slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
import redis
import redis.asyncio as aioredis
from fault_proxy import FaultProxy

import tokq.connection
from tokq.connection import (CONNECT_ATTEMPTS, CONNECT_TIMEOUT_S, connect, connect_pubsub,
                             is_cluster)

pytestmark = pytest.mark.redis_kinds("standalone", "cluster")


def _first_connect_to_each_address_slow(monkeypatch) -> list:
    """asyncio's connect (what redis-py's asyncio connections use) takes longer than the connect
    timeout the first time for each address, as the accept of a loaded server may; the slowed
    addresses are listed."""
    open_connection = asyncio.open_connection
    slowed = []

    async def slow_first(*args, **kwargs):
        address = (kwargs.get("host"), kwargs.get("port"))
        if address not in slowed:
            slowed.append(address)
            await asyncio.sleep(CONNECT_TIMEOUT_S * 10)  # cut off by the connect timeout
        return await open_connection(*args, **kwargs)

    monkeypatch.setattr(asyncio, "open_connection", slow_first)
    return slowed


@pytest.mark.parametrize("make", [connect, connect_pubsub], ids=["connect", "connect_pubsub"])
async def test_a_connect_that_times_out_once_is_tried_again(redis_url, monkeypatch, make):
    client = make(redis_url)
    slowed = _first_connect_to_each_address_slow(monkeypatch)
    try:
        # In a cluster: the slot map's read, then the connects to the nodes owning the keys.
        for key in ("a", "b", "c", "d"):
            assert await client.set(key, b"v")
            assert await client.get(key) == b"v"
    finally:
        await client.aclose()
    assert slowed  # the slow connect was met (and outlived)


@pytest.mark.redis_kinds("standalone")
async def test_a_connect_that_never_completes_fails_in_bounded_time(redis_url, monkeypatch):
    client = connect(redis_url)

    async def never(*args, **kwargs):
        await asyncio.sleep(3600)

    monkeypatch.setattr(asyncio, "open_connection", never)
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        with pytest.raises(redis.exceptions.TimeoutError, match="connecting"):
            await asyncio.wait_for(client.get("a"), 30)
    finally:
        await client.aclose()
    # CONNECT_ATTEMPTS tries of CONNECT_TIMEOUT_S each and short backoffs (~1.6 s), not more
    elapsed = loop.time() - start
    assert CONNECT_ATTEMPTS * CONNECT_TIMEOUT_S <= elapsed < CONNECT_ATTEMPTS * CONNECT_TIMEOUT_S + 2


def test_the_cluster_mode_probe_retries_a_connect_that_times_out(redis_url, monkeypatch, request):
    monkeypatch.setattr(tokq.connection, "_cluster_by_url", {})
    slowed = []

    class SlowFirstConnect(socket.socket):  # what redis-py's blocking connections connect with
        def connect(self, address):
            if not slowed:
                slowed.append(address)
                raise socket.timeout("timed out")  # as a connect past its timeout does
            return super().connect(address)

    monkeypatch.setattr(socket, "socket", SlowFirstConnect)
    assert is_cluster(redis_url) is (request.node.callspec.params["redis_url"] == "cluster")
    assert slowed


@pytest.mark.redis_kinds("standalone")
async def test_a_command_whose_answer_times_out_is_not_sent_again(redis_url, monkeypatch):
    # The retry policy retries connection errors, not timeouts: the command may have run (here
    # it did, its answer withheld), so it fails to the caller, run once. Retried, it would run
    # again on a new connection, and answer.
    monkeypatch.setattr(tokq.connection, "SOCKET_TIMEOUT_S", 0.5)
    proxy = FaultProxy(redis_url).start()
    client = connect(proxy.url, cluster="no")
    try:
        assert await client.ping()  # connected: only the command's answer can be late
        proxy.hold_next(b"INCR")
        with pytest.raises(redis.exceptions.TimeoutError, match="reading"):
            await client.incr("runs")
        async with contextlib.aclosing(aioredis.Redis.from_url(redis_url)) as direct:
            assert await direct.get("runs") == b"1"
    finally:
        await client.aclose()
        proxy.close()
