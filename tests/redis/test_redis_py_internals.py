"""The redis-py (and hiredis) internals tokq relies on are still there, as tokq uses them, in the
installed versions: each name of tokq.redis.REDIS_PY_INTERNALS exists and takes the arguments
tokq passes (or redis-py passes to tokq's override), the module doc lists the same names, and the
behaviours the doc names hold. A failure here means a redis-py or hiredis upgrade changed one:
review the override named in tokq/redis/__init__.py before widening the pin in pyproject.toml."""

from __future__ import annotations

import importlib
import inspect
import re
import socket

import hiredis
import pytest
import redis
import redis.asyncio as aioredis
import redis.exceptions
from redis._parsers import AsyncCommandsParser
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, NodesManager, RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry as BlockingRetry
from redis.cluster import PRIMARY
from redis.utils import str_if_bytes

import tokq.redis
from tokq.redis import REDIS_PY_INTERNALS, connection, pubsub
from tokq.redis.pipeline import pack_command

# The callables tokq awaits (or that redis-py awaits as tokq's override); every other callable
# in the list is called plainly.
AWAITED = {
    "redis.asyncio.connection.AbstractConnection._connect",
    "redis.asyncio.connection.AbstractConnection._send_packed_command",
    "redis._parsers.AsyncCommandsParser.initialize",
    "redis.asyncio.cluster.ClusterPipeline.execute",
    "redis.asyncio.cluster.NodesManager.initialize",
    "redis.asyncio.cluster.ClusterNode.execute_command",
    "redis.asyncio.connection.AbstractConnection.read_response",
    "redis.asyncio.connection.ConnectionPool.get_connection",
    "redis.asyncio.connection.ConnectionPool.release",
    "redis.asyncio.connection.AbstractConnection.send_packed_command",
    "redis.asyncio.connection.AbstractConnection.disconnect",
    "redis.asyncio.retry.Retry.call_with_retry",
}
NOWHERE = "redis://127.0.0.1:1/0"  # nothing is connected to it: the instances are only looked at


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _instances(owner: str) -> list:
    """Instances of the class named ``owner``, made as tokq makes them (no connection made)."""
    if owner == "redis.asyncio.connection.AbstractConnection":
        return [aioredis.Connection(host="127.0.0.1", port=1),
                aioredis.SSLConnection(host="127.0.0.1", port=1),
                aioredis.UnixDomainSocketConnection(path="/nonexistent")]
    if owner == "redis.asyncio.connection.ConnectionPool":
        return [aioredis.BlockingConnectionPool.from_url(NOWHERE), aioredis.ConnectionPool.from_url(NOWHERE)]
    if owner == "redis.connection.ConnectionPool":
        return [redis.ConnectionPool.from_url(NOWHERE)]
    if owner == "redis._parsers.AsyncCommandsParser":
        return [AsyncCommandsParser()]
    if owner == "redis.asyncio.cluster.RedisCluster":
        return [RedisCluster.from_url(NOWHERE)]
    if owner == "redis.asyncio.cluster.NodesManager":
        return [RedisCluster.from_url(NOWHERE).nodes_manager]
    if owner == "redis.asyncio.cluster.ClusterNode":
        return [ClusterNode("127.0.0.1", 1, PRIMARY)]
    if owner == "redis.asyncio.client.PubSub":
        return [PubSub(connection_pool=aioredis.ConnectionPool.from_url(NOWHERE))]
    if owner == "redis.commands.core.AsyncScript":
        return [aioredis.Redis.from_url(NOWHERE).register_script("return 1"),
                RedisCluster.from_url(NOWHERE).register_script("return 1")]
    raise AssertionError(f"no instance of {owner} to check: add one to _instances")


def _resolve(name: str) -> tuple[object, str, str]:
    """(the object owning the last attribute, its dotted name, the attribute) of ``name``."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, part in enumerate(parts[cut:-1], start=cut):
            assert hasattr(obj, part), f"{'.'.join(parts[:i + 1])} is gone"
            obj = getattr(obj, part)
        return obj, ".".join(parts[:-1]), parts[-1]
    raise AssertionError(f"no module of {name} can be imported")


def _has(instance: object, attr: str) -> bool:
    # A slot redis-py fills later (AsyncCommandsParser.node) is there though unset.
    return hasattr(instance, attr) or any(attr in getattr(k, "__slots__", ()) for k in type(instance).__mro__)


def test_the_module_doc_lists_the_same_names_as_the_list():
    listed = re.findall(r"^- ``([\w.]+)``", tokq.redis.__doc__, flags=re.MULTILINE)
    names = [i.name for i in REDIS_PY_INTERNALS]
    assert len(set(names)) == len(names), "a name twice in REDIS_PY_INTERNALS"
    assert listed == names
    assert AWAITED <= set(names)


@pytest.mark.parametrize("internal", REDIS_PY_INTERNALS, ids=lambda i: i.name)
async def test_each_internal_is_there_and_takes_what_tokq_passes(internal):
    owner, owner_name, attr = _resolve(internal.name)
    if internal.instance:
        assert inspect.isclass(owner)
        for instance in _instances(owner_name):
            assert _has(instance, attr), f"{type(instance).__name__} has no {attr}"
        return
    assert hasattr(owner, attr), f"{internal.name} is gone"
    obj = getattr(owner, attr)
    if not internal.calls:
        return
    assert callable(obj)
    assert inspect.iscoroutinefunction(inspect.unwrap(obj)) == (internal.name in AWAITED), internal.name
    try:
        signature = inspect.signature(obj)
    except ValueError:  # a C function without a signature (hiredis): its behaviour is tested below
        return
    # A function on a class takes the instance first.
    bound = inspect.isclass(owner) and not inspect.isclass(obj) and not isinstance(
        inspect.getattr_static(owner, attr), (staticmethod, classmethod))
    for positional, keywords in internal.calls:
        signature.bind(*[None] * (positional + bound), **dict.fromkeys(keywords))


def test_a_cluster_retries_a_timeout_and_a_connection_error_after_reading_the_slot_map_again():
    assert {redis.exceptions.TimeoutError, redis.exceptions.ConnectionError} <= set(
        RedisCluster.ERRORS_ALLOW_RETRY)


def test_hiredis_packs_as_redis_py_does_and_refuses_other_types():
    args = ("EVALSHA", "a" * 40, 2, b"k\x00\xff", "k\u00e9", 7, -3, 1.5, 0.1, 1e20, 2**64)
    assert hiredis.pack_command(args) == b"".join(aioredis.Connection().pack_command(*args))
    for bad in (True, None, bytearray(b"x"), [1]):
        with pytest.raises(TypeError):
            hiredis.pack_command(("SET", bad))
        with pytest.raises(redis.exceptions.DataError):
            pack_command("SET", bad)


async def test_a_connect_timeout_reaches_the_override_as_a_builtin_timeout():
    calls = []

    class NeverConnects(aioredis.Connection):
        async def _connect(self):
            calls.append(1)
            raise TimeoutError  # what asyncio.timeout raises around the socket connect

    conn = connection._connect_retried(NeverConnects)(host="127.0.0.1", port=1, retry=connection._retry())
    with pytest.raises(redis.exceptions.TimeoutError):  # redis-py's, made after the override gave up
        await conn.connect()
    assert len(calls) == connection.CONNECT_ATTEMPTS


def test_a_blocking_connect_timeout_reaches_the_override_as_a_builtin_timeout():
    calls = []

    class NeverConnects(redis.Connection):
        def _connect(self):
            calls.append(1)
            raise socket.timeout("timed out")

    conn = connection._connect_retried_sync(NeverConnects)(host="127.0.0.1", port=1,
                                                           retry=BlockingRetry(NoBackoff(), 0))
    with pytest.raises(redis.exceptions.TimeoutError):
        conn.connect()
    assert len(calls) == connection.CONNECT_ATTEMPTS


async def test_a_send_on_a_connection_closed_under_it_goes_through_the_guard():
    class ClosedTransport:
        def is_closing(self):
            return True

        def close(self):
            pass

        def writelines(self, data):
            raise AssertionError("written to a closed transport: the guard was not called")

        async def wait_closed(self):
            pass

        def get_extra_info(self, name, default=None):
            return default

    conn = connection._guarded(aioredis.Connection)(host="127.0.0.1", port=1,
                                                    socket_timeout=connection.SOCKET_TIMEOUT_S)
    conn._reader, conn._writer = object(), ClosedTransport()  # connected, then closed under it
    with pytest.raises(redis.exceptions.ConnectionError, match="closed before the send"):
        await conn.send_packed_command(b"*1\r\n$4\r\nPING\r\n", check_health=False)


async def test_a_pool_makes_new_connections_of_the_class_set_after_it_was_made(redis_url):
    client = connection.connect(redis_url, cluster="no")
    try:
        conn = await client.connection_pool.get_connection()
        assert type(conn).__qualname__ == "_guarded.<locals>.SendGuarded"
        await client.connection_pool.release(conn)
    finally:
        await client.aclose()


def test_cluster_nodes_made_now_or_later_get_the_guarded_connection_class():
    client = connection._cluster_client(NOWHERE, max_connections=2)
    guarded = client.connection_kwargs["connection_class"]
    assert guarded.__qualname__ == "_guarded.<locals>.SendGuarded"
    assert isinstance(client.commands_parser, connection._AnyNodeCommandsParser)
    assert all(n.connection_class is guarded for n in client.nodes_manager.startup_nodes.values())
    # As NodesManager.initialize makes a node it finds in the slot map:
    later = ClusterNode("127.0.0.1", 2, PRIMARY, **client.nodes_manager.connection_kwargs)
    assert later.connection_class is guarded
    assert isinstance(later.acquire_connection(), guarded)  # how a node makes its connections
    pipe = client.pipeline(transaction=False)
    assert pipe.execute.__name__ == "bounded_execute"  # a pipeline takes an execute of its own


class _Node:
    """Stands for a ClusterNode: answers COMMAND with a table of one command, or fails."""

    def __init__(self, port: int, fail: bool = False) -> None:
        self.name = f"127.0.0.1:{port}"
        self.server_type = PRIMARY
        self.fail = fail
        self.asked: list[str] = []

    async def execute_command(self, *args):
        self.asked.append(args[0])
        if self.fail:
            raise redis.exceptions.ConnectionError("down")
        return {"GET": {"name": "get", "flags": []}} if args[0] == "COMMAND" else True


async def test_the_cluster_client_reads_the_command_table_through_the_any_node_parser(monkeypatch):
    client = connection._cluster_client(NOWHERE, max_connections=2)
    manager = client.nodes_manager
    dead, alive = _Node(7001, fail=True), _Node(7002)

    async def slot_map_read(*args, **kwargs):  # as NodesManager.initialize leaves it
        manager.nodes_cache = {dead.name: dead, alive.name: alive}
        manager.default_node = dead

    monkeypatch.setattr(NodesManager, "initialize", slot_map_read)
    await client.initialize()  # calls commands_parser.initialize(default node)
    assert not client._initialize
    assert client.commands_parser.node is alive and manager.default_node is alive
    assert client.commands_parser.commands == {"get": {"name": "get", "flags": []}}
    assert list(manager.nodes_cache) == [alive.name, dead.name]  # the dead one tried last
    # A command missing from the table: redis-py calls initialize() without a node.
    with pytest.raises(redis.exceptions.RedisError, match="NOSUCH"):
        await client.commands_parser.get_keys("NOSUCH", "key")
    assert alive.asked == ["COMMAND", "COMMAND"]


async def test_a_cluster_with_no_node_answering_raises_from_the_last_node_s_error():
    client = RedisCluster(host="127.0.0.1", port=_closed_port())
    with pytest.raises(redis.exceptions.RedisClusterException) as raised:
        await client.initialize()
    assert isinstance(raised.value.__cause__, redis.exceptions.ConnectionError)


async def test_pubsub_runs_on_the_stand_in_pool_and_its_connection_reads_as_tokq_reads_it(redis_url):
    client = connection.connect(redis_url, cluster="no")
    pool = client.connection_pool
    source = pubsub._OneConnection(pool.connection_class, pool.connection_kwargs, pool.get_encoder())
    subscription = PubSub(connection_pool=source, push_handler_func=pubsub._pass_message)
    try:
        await subscription.ssubscribe("channel")
        conn = subscription.connection
        assert isinstance(conn, pool.connection_class)
        confirmed = await conn.read_response(timeout=2.0, disconnect_on_error=False, push_request=True)
        assert str_if_bytes(confirmed[0]) == "ssubscribe"
        silent = await conn.read_response(timeout=0.05, disconnect_on_error=False, push_request=True)
        assert silent is None and conn.is_connected  # a quiet connection: nothing, not an error
        await client.spublish("channel", b"data")
        message = await conn.read_response(timeout=2.0, disconnect_on_error=False, push_request=True)
        assert [str_if_bytes(message[0]), message[1], message[2]] == ["smessage", b"channel", b"data"]
    finally:
        await subscription.aclose()  # gives the connection back: _OneConnection closes it
        await client.aclose()
    assert not conn.is_connected
