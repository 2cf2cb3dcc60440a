"""A real Redis Cluster (3 primaries + 3 replicas on loopback): the test cluster itself, and
tokq's connections against it from a node that does not own the queue's slot."""

from __future__ import annotations

import asyncio

import pytest
import redis
from queue_support import QUEUE, queue_cycle

from tokq.redis.connection import connect, connect_pubsub, is_cluster
from tokq.queue.keys import QueueKeys
from tokq.queue.shard import Queue
from tokq.testing.cluster import NUM_SLOTS
from tokq.redis.pubsub import ShardedSubscriber


def _non_owner_url(cluster, key: str) -> str:
    owner = cluster.owner_port(key)
    return cluster.node_url(next(p for p in cluster.primary_ports() if p != owner))


def test_cluster_has_three_replicated_primaries_covering_every_slot(redis_cluster, redis_cluster_url):
    primaries = redis_cluster.primary_ports()
    assert len(primaries) == 3
    with redis.Redis.from_url(redis_cluster_url, decode_responses=True) as c:
        slots = c.execute_command("CLUSTER", "SLOTS")
        assert sum(int(end) - int(start) + 1 for start, end, *_ in slots) == NUM_SLOTS
        nodes = c.execute_command("CLUSTER", "NODES")
    # CLUSTER NODES lines: <id> <addr> <flags> <primary id or -> ...
    rows = [line.split() for line in nodes.splitlines()]
    primary_ids = {r[0] for r in rows if "master" in r[2].split(",")}
    replica_of = [r[3] for r in rows if "slave" in r[2].split(",")]
    assert sorted(replica_of) == sorted(primary_ids)  # one replica per primary


def test_mode_is_detected_from_the_server(redis_cluster_url, redis_url):
    assert is_cluster(redis_cluster_url) is True
    assert is_cluster(redis_url) is False
    assert is_cluster(redis_url, "yes") is True  # an explicit setting wins
    with pytest.raises(ValueError, match="redis_cluster"):
        is_cluster(redis_url, "maybe")


async def test_queue_cycle_through_a_node_that_does_not_own_the_slot(redis_cluster):
    keys = QueueKeys(QUEUE)
    url = _non_owner_url(redis_cluster, keys.pending)
    client = connect(url)
    try:
        q = Queue(client, QUEUE)
        await queue_cycle(q)
        assert (await q.stats()).queued_entries == 0
    finally:
        await client.aclose()


async def test_a_plain_client_on_a_cluster_gets_moved(redis_cluster):
    """What the issue saw: without cluster mode, a node that does not own the slot refuses."""
    keys = QueueKeys(QUEUE)
    client = connect(_non_owner_url(redis_cluster, keys.pending), cluster="no")
    try:
        with pytest.raises(redis.exceptions.MovedError):
            await Queue(client, QUEUE).stats()
    finally:
        await client.aclose()


async def test_a_bounded_cluster_client_queues_commands_beyond_its_connections(redis_cluster_url):
    client = connect(redis_cluster_url, max_connections=2)
    try:
        keys = [f"k{i}" for i in range(200)]  # spread over all three primaries
        await asyncio.gather(*(client.set(k, k) for k in keys))
        assert await asyncio.gather(*(client.get(k) for k in keys)) == [k.encode() for k in keys]
    finally:
        await client.aclose()


async def test_a_command_whose_connection_is_closed_just_before_its_send_is_retried(redis_cluster_url):
    """The race redis-py's cluster client has after a connection error: it closes a node's
    free connections in tasks that run later, and a command may take one of them in between.
    The close is injected at that moment (the health check just before the send): the command
    must be sent again on a new connection, not fail with AttributeError."""
    client = connect(redis_cluster_url)
    try:
        await client.set("k", "1")  # a free connection to k's node, then taken again below
        node = client.get_node_from_key("k")
        [connection] = node._free
        closed = []

        async def closed_under_it(*args, **kwargs):
            connection.check_health = check_health
            closed.append(True)
            await connection.disconnect()

        check_health = connection.check_health
        connection.check_health = closed_under_it
        assert await client.get("k") == b"1"
        assert closed == [True]
    finally:
        await client.aclose()


async def test_concurrent_first_calls_go_straight_to_the_slot_owner(redis_cluster, redis_cluster_url):
    """redis-py routes calls made before its slot map is read to one node: they drew MOVED, and
    the slot-map reset after 5 MOVEDs cut other calls' connections mid-flight (a script then
    ran twice). tokq's client reads the slot map first."""
    nodes = [redis.Redis(port=p, decode_responses=True) for p in redis_cluster.ports]
    for n in nodes:
        n.config_resetstat()
    client = connect(redis_cluster_url)
    try:
        keys = [f"k{i}" for i in range(32)]
        await asyncio.gather(*(client.set(k, k) for k in keys))
    finally:
        await client.aclose()
    moved = sum(n.info("errorstats").get("errorstat_MOVED", {}).get("count", 0) for n in nodes)
    for n in nodes:
        n.close()
    assert moved == 0


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
async def test_sharded_subscriber_hears_channels_on_every_node(kind, request):
    url = request.getfixturevalue("redis_cluster_url" if kind == "cluster" else "redis_url")
    channels = [QueueKeys(f"m{i}").notice_channel("gw") for i in range(6)]
    client, sub = connect(url), ShardedSubscriber(connect_pubsub(url))
    try:
        await sub.subscribe(*channels)
        for ch in channels:
            await client.spublish(ch, ch.encode())
        got = []
        for _ in range(50):
            if (msg := await sub.get_message(timeout=0.2)) is not None:
                got.append(msg)
            if len(got) == len(channels):
                break
        assert sorted(got) == sorted((ch.encode(), ch.encode()) for ch in channels)
    finally:
        await sub.aclose()
        await client.aclose()


@pytest.mark.slow
def test_killed_primary_is_replaced_by_its_replica(redis_cluster, redis_cluster_url):
    key = "tokq:{failover}:probe"
    with redis.RedisCluster.from_url(redis_cluster_url) as c:
        c.set(key, b"kept")
        primary = redis_cluster.owner_port(key)
        c.get_node_from_key(key).redis_connection.execute_command("WAIT", 1, 2000)
    replicas = redis_cluster.replica_ports_of(primary)
    assert len(replicas) == 1
    redis_cluster.kill(primary)
    redis_cluster.wait_ok(timeout_s=30)
    assert redis_cluster.owner_port(key) == replicas[0]
    with redis.RedisCluster.from_url(redis_cluster.node_url(replicas[0])) as c:
        assert c.get(key) == b"kept"
