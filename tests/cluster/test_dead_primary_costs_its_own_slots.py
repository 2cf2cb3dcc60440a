"""A dead primary still listed first in a cluster's slot map (its failover under way, or for good
when its replica is gone too) costs only the keys of its own slots.

redis-py's cluster client re-read the command table from the first primary of the slot map on
every (re)initialize, which follows any connection error, and loaded a script on every primary:
while that node was down a tokq process failed every command, on every node. Here the first
listed of 3 primaries is killed (no replicas: nothing takes over, the map keeps listing it) and
the other nodes' keys are used through a fresh client, one connected before, and one that
redis-py reset after (as it does after CLUSTERDOWN, an uncovered slot or 5 MOVEDs).

The cluster is this module's own (a node is killed for good).
"""

from __future__ import annotations

import asyncio

import pytest
import redis
from cluster_support import local_cluster
from queue_support import queue_cycle

from tokq.redis.connection import connect, connect_sync
from tokq.queue.keys import QueueKeys
from tokq.queue.shard import Queue
from tokq.testing.cluster import _slots


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(num_primaries=3, replicas_per_primary=0) as cluster:
        yield cluster


def _first_listed_primary(cluster) -> int:
    with cluster.nodes[0].client(cluster.host) as c:
        return _slots(c)[0][2]  # CLUSTER SLOTS' first entry: what redis-py makes its default node


def _key_on(cluster, port: int, prefix: str) -> str:
    return next(k for k in (f"{{{prefix}{i}}}" for i in range(100_000)) if cluster.owner_port(k) == port)


def _queue_on(cluster, port: int) -> str:
    return next(q for q in (f"q{i}" for i in range(100_000))
                if cluster.owner_port(QueueKeys(q).pending) == port)


@pytest.fixture(scope="module")
def dead(cluster):
    """The cluster with its first listed primary killed, clients connected before: (dead port,
    live port, its URL, a key on a live node, a key on the dead one, [clients connected before],
    the event loop runner they belong to)."""
    first = _first_listed_primary(cluster)
    live = next(p for p in cluster.ports if p != first)
    url = cluster.node_url(live)
    live_key, dead_key = _key_on(cluster, live, "live"), _key_on(cluster, first, "dead")
    with redis.Redis(host=cluster.host, port=live) as c:
        c.set(live_key, b"kept")
    runner = asyncio.Runner()
    before = [connect(url), connect(url)]
    for client in before:  # connected, slot map read
        assert runner.run(client.get(live_key)) == b"kept"
    cluster.kill(first)
    yield first, live, url, live_key, dead_key, before, runner
    for client in before:
        runner.run(client.aclose())
    runner.close()


def _run(dead, coro):
    return dead[-1].run(coro)


def test_a_fresh_client_reaches_the_live_nodes(dead):
    first, live, url, live_key, dead_key, _, _ = dead

    async def check():
        client = connect(url)
        try:
            for _ in range(3):
                assert await client.get(live_key) == b"kept"
            assert await client.ping()  # a keyless command: the default node, a live one now
            pipe = client.pipeline()
            pipe.set(live_key + ":p", b"1").get(live_key + ":p")
            assert await pipe.execute() == [True, b"1"]
            with pytest.raises(redis.exceptions.ConnectionError):  # its own keys do fail
                await client.get(dead_key)
            assert await client.get(live_key) == b"kept"  # and that did not spoil the rest
        finally:
            await client.aclose()

    _run(dead, check())
    client = connect_sync(url)  # the CLIs' blocking client
    try:
        assert client.get(live_key) == b"kept"
    finally:
        client.close()


def test_clients_connected_before_reach_the_live_nodes(dead):
    first, live, url, live_key, dead_key, before, _ = dead

    async def check():
        hit_dead, reset = before
        with pytest.raises(redis.exceptions.ConnectionError):
            await hit_dead.get(dead_key)
        await reset.aclose()  # redis-py's reset: the slot map read again on the next command
        for client in before:
            assert await client.get(live_key) == b"kept"
            assert await client.ping()

    _run(dead, check())


def test_a_queue_on_a_live_node_serves_whose_scripts_were_never_loaded(dead, cluster):
    # No script was ever loaded on this fresh cluster: NOSCRIPT, then the script loaded where it
    # runs (redis-py's SCRIPT LOAD went to every primary, the dead one too).
    first, live, url, *_ = dead
    name = _queue_on(cluster, live)

    async def check():
        client = connect(url)
        try:
            await queue_cycle(Queue(client, name))
        finally:
            await client.aclose()

    _run(dead, check())

