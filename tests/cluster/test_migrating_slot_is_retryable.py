"""A queue's slot moving between two nodes of a real cluster (resharding): a script whose keys
are split between the nodes draws TRYAGAIN until the move ends, redis-py gives up after 16
tries with ClusterError("TTL exhausted."), and the caller is told UNAVAILABLE (retry), not
INTERNAL."""

from __future__ import annotations

import grpc
import pytest
import redis
import redis.exceptions
from queue_support import items

from tokq.redis.connection import connect
from tokq.gateway.errors import UNAVAILABLE_MESSAGE, code_of, to_http, to_status
from tokq.queue.keys import QueueKeys
from tokq.queue.shard import Queue

QUEUE = "migrating"


def test_ttl_exhausted_is_retryable():
    exc = redis.exceptions.ClusterError("TTL exhausted.")
    code, message = to_status(exc)
    assert code == grpc.StatusCode.UNAVAILABLE and message.startswith(UNAVAILABLE_MESSAGE)
    assert to_http(exc)[0] == 503


async def test_a_collect_while_its_slot_migrates_is_unavailable(redis_cluster, redis_cluster_url):
    keys = QueueKeys(QUEUE)
    source = redis_cluster.owner_port(keys.pending)
    target = next(p for p in redis_cluster.primary_ports() if p != source)
    nodes = {p: redis.Redis(host=redis_cluster.host, port=p, decode_responses=True) for p in (source, target)}
    ids = {p: c.execute_command("CLUSTER", "MYID") for p, c in nodes.items()}
    slot = int(nodes[source].execute_command("CLUSTER", "KEYSLOT", keys.pending))
    client = connect(redis_cluster_url)
    try:
        q = Queue(client, QUEUE)
        await q.enqueue("r1", items(3), timeout_ms=10_000, notice_channel=keys.notice_channel("gw"))
        nodes[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
        nodes[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
        # collect's keys: the reply hash (still on the source) and its copy (on neither yet)
        with pytest.raises(redis.exceptions.ClusterError) as err:
            await q.collect("r1")
        assert "TTL exhausted" in str(err.value)
        assert to_status(err.value)[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        for node in nodes.values():
            node.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
            node.close()
        await client.aclose()
    client = connect(redis_cluster_url)
    try:
        assert await Queue(client, QUEUE).collect("r1") == {}  # served again once the move is off
    finally:
        await client.aclose()


async def test_a_cluster_no_node_of_which_answers_is_unavailable_not_internal():
    """redis-py raises RedisClusterException("Redis Cluster cannot be connected ...") from the
    connection error when no node answers (the whole cluster down): retry, as for one node."""
    from tokq.redis.connection import connect
    from tokq.redis.embedded import free_port

    client = connect(f"redis://127.0.0.1:{free_port()}/0", cluster="yes")  # nothing listens there
    with pytest.raises(redis.exceptions.RedisClusterException) as err:
        await client.get("k")
    assert code_of(err.value) == grpc.StatusCode.UNAVAILABLE
    assert code_of(redis.exceptions.RedisClusterException("a bug, no cause")) == grpc.StatusCode.INTERNAL
