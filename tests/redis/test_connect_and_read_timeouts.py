"""Connect timeouts are retried; read timeouts are not, but on a Redis Cluster (tokq/redis/connection.py).

A first connect slower than CONNECT_TIMEOUT_S (a loaded machine, a busy Redis slow to accept)
is tried again by the connection itself: nothing was sent on it yet. A command whose answer does
not come within the socket timeout fails to the caller, run once: it may have run, and the
caller decides. On a Redis Cluster, redis-py's cluster client resends it itself, up to three
tries: the README's promise for a silent cluster node. Real servers; the slow connect is the
socket connect step made slow, the silent node a proxy in front of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
import redis
import redis.asyncio as aioredis
from tokq.testing.fault_proxy import FaultProxy

import tokq.redis.connection
from tokq.redis.connection import (CONNECT_ATTEMPTS, CONNECT_TIMEOUT_S, connect, connect_pubsub,
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
    monkeypatch.setattr(tokq.redis.connection, "_cluster_by_url", {})
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
    monkeypatch.setattr(tokq.redis.connection, "SOCKET_TIMEOUT_S", 0.5)
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



def _cluster_client_proxied(monkeypatch, cluster, key: str):
    """tokq's cluster client (connect(), its settings untouched but a 0.5 s socket timeout),
    its links to the node owning ``key`` going through a proxy (redis-py's address_remap).
    Returns (client, proxy, the node's port)."""
    monkeypatch.setattr(tokq.redis.connection, "SOCKET_TIMEOUT_S", 0.5)
    owner = cluster.owner_port(key)
    proxy = FaultProxy(cluster.node_url(owner)).start()
    from_url = tokq.redis.connection.BoundedRedisCluster.from_url.__func__

    def via_proxy(cls, url, **kwargs):
        remap = lambda address: ("127.0.0.1", proxy.port) if address[1] == owner else address
        return from_url(cls, url, address_remap=remap, **kwargs)

    monkeypatch.setattr(tokq.redis.connection.BoundedRedisCluster, "from_url", classmethod(via_proxy))
    return connect(cluster.url, cluster="yes"), proxy, owner


def _value_on_node(cluster, port: int, key: str) -> int:
    with contextlib.closing(redis.Redis.from_url(cluster.node_url(port))) as direct:
        return int(direct.get(key))


@pytest.mark.redis_kinds("cluster")
async def test_a_silent_cluster_node_is_tried_three_times_then_reported(redis_url, redis_cluster,
                                                                       monkeypatch):
    # The README's UNAVAILABLE row: a Redis Cluster's node that stops answering is reported
    # after the cluster client's three tries (each re-reads the slot map first: a silent
    # primary may have been failed over), never a hang.
    client, proxy, owner = _cluster_client_proxied(monkeypatch, redis_cluster, "silent")
    loop = asyncio.get_running_loop()
    try:
        # connected through the proxy (counts are relative: on a loaded machine this first
        # command too may outlast the 0.5 s timeout and be resent)
        first = await client.incr("silent")
        proxy.stall()
        start = loop.time()
        with pytest.raises(redis.exceptions.TimeoutError):
            await asyncio.wait_for(client.incr("silent"), 30)
        elapsed = loop.time() - start
    finally:
        proxy.stall(False)
        await client.aclose()
        proxy.close()
    tries = 3 * tokq.redis.connection.SOCKET_TIMEOUT_S
    assert tries <= elapsed < tries + 6  # three socket timeouts (one would be a third of it)
    # The first try ran; the later ones, on new connections, may stop at the silent handshake.
    assert first + 1 <= _value_on_node(redis_cluster, owner, "silent") <= first + 3


@pytest.mark.redis_kinds("cluster")
async def test_a_timed_out_command_is_sent_again_on_a_cluster(redis_url, redis_cluster,
                                                               monkeypatch):
    # Unlike the standalone client (the test above it), redis-py's cluster client resends a
    # command whose answer timed out (RedisCluster.ERRORS_ALLOW_RETRY): the command runs
    # twice, which the queue scripts' idempotency makes safe (tokq/redis/connection.py's _retry).
    client, proxy, owner = _cluster_client_proxied(monkeypatch, redis_cluster, "resent")
    try:
        first = await client.incr("resent")  # 1, or more if resent on a loaded machine
        proxy.hold_next(b"INCR")  # this connection's answers withheld; a new one answers
        assert await asyncio.wait_for(client.incr("resent"), 30) == first + 2
    finally:
        await client.aclose()
        proxy.close()
    assert _value_on_node(redis_cluster, owner, "resent") == first + 2


@pytest.mark.redis_kinds("standalone")
async def test_a_refused_connect_is_reported_in_a_fraction_of_a_second(redis_url):
    # The README's UNAVAILABLE row: a Redis that refuses connections (down, nothing on its port)
    # is reported after three quick tries, not after any timeout.
    from tokq.redis.embedded import free_port

    client = connect(f"redis://127.0.0.1:{free_port()}/0", cluster="no")  # nothing listens there
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            await asyncio.wait_for(client.get("a"), 30)
    finally:
        await client.aclose()
    assert loop.time() - start < 1.0  # ~0.1 s; an unanswered connect takes ~1.6 s
