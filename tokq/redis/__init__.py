"""Redis clients: connections (connection), pipelined script runs (pipeline), sharded pub/sub
(pubsub) and the embedded server for `tokq up` and the tests (embedded).

redis-py internals
------------------
tokq uses redis-py (and hiredis) below their documented API in the places listed here. Tested
with redis-py 8.1.0 and hiredis 3.5.0, and with redis-py 8.0.0 and hiredis 3.2.0 (what redis-py 8
asks for); pyproject.toml allows redis-py 8.x and hiredis 3.x from those. redis-py 7.4 lacks
ClusterNode.get_encoder and the asyncio PubSub's ssubscribe. ``REDIS_PY_INTERNALS`` below
holds the same names, with the calls tokq makes; tests/redis/test_redis_py_internals.py checks
each one against the installed redis-py, and the behaviours named here. After a redis-py
upgrade, run that test, then the rest of tests/redis/, tests/queue/ and tests/cluster/.

Each line: the name, where tokq uses it (module:function, in tokq/redis/ unless a path is given),
and why.

Connections (connection.py):

- ``redis.asyncio.connection.AbstractConnection._connect`` -- connection:_connect_retried
  overrides it: a connect that times out is tried again. redis-py's connect() calls it and only
  afterwards turns a builtin TimeoutError into its own, which the retry policy does not retry.
- ``redis.connection.AbstractConnection._connect`` -- connection:_connect_retried_sync: the same
  for the blocking client of the cluster-mode probe (_cluster_enabled).
- ``redis.asyncio.connection.AbstractConnection._send_packed_command`` -- connection:_guarded
  overrides it: a send on a connection closed under it is a ConnectionError (retried), not an
  AttributeError or uvloop's RuntimeError. send_packed_command calls it only when the
  connection has a socket timeout (connect() and the cluster clients set one).
- ``redis.asyncio.connection.AbstractConnection._writer`` -- connection:_guarded: None, or a
  closing transport, means the connection was closed under the command.
- ``redis.asyncio.connection.ConnectionPool.connection_class`` -- connection:_guard_pool: set
  after from_url (which picks the class by URL scheme); the pool reads it per new connection.
- ``redis.connection.ConnectionPool.connection_class`` -- connection:_cluster_enabled: the same
  for the blocking probe's pool.
- ``redis.connection.parse_url`` -- connection:check_redis (is a password given),
  embedded:redact_url, tokq/config.py:_redis_url_problem: redis-py's own parse of a Redis URL.

Cluster client (connection.py: BoundedRedisCluster, _AnyNodeCommandsParser):

- ``redis._parsers.AsyncCommandsParser`` -- connection:_AnyNodeCommandsParser subclasses it:
  COMMAND's table is read from any node that answers, not only the default node.
- ``redis._parsers.AsyncCommandsParser.initialize`` -- connection:_AnyNodeCommandsParser
  overrides it. redis-py calls it with a node (RedisCluster.initialize) and without one (a
  command missing from the table).
- ``redis._parsers.AsyncCommandsParser.commands`` -- connection:_AnyNodeCommandsParser: an empty
  table is read again.
- ``redis._parsers.AsyncCommandsParser.node`` -- connection:_AnyNodeCommandsParser sets it: the
  node COMMAND and COMMAND GETKEYS go to.
- ``redis.asyncio.cluster.RedisCluster.commands_parser`` -- connection:BoundedRedisCluster
  replaces it with _AnyNodeCommandsParser.
- ``redis.asyncio.cluster.RedisCluster.connection_kwargs`` -- connection:BoundedRedisCluster:
  its "connection_class" becomes the guarded class (RedisCluster takes no connection class).
- ``redis.asyncio.cluster.RedisCluster.nodes_manager`` -- connection:BoundedRedisCluster,
  pubsub:ShardedSubscriber._by_server: the slot map and the nodes.
- ``redis.asyncio.cluster.RedisCluster._initialize`` -- connection:BoundedRedisCluster
  execute_command and pipeline: the slot map is read before a command picks its node.
- ``redis.asyncio.cluster.RedisCluster.ERRORS_ALLOW_RETRY`` -- connection:_retry relies on it
  holding TimeoutError: a cluster command that timed out is sent again after the slot map is
  read again (a failover), which the idempotent queue scripts make safe.
- ``redis.asyncio.cluster.ClusterPipeline.execute`` -- connection:BoundedRedisCluster.pipeline
  wraps it on each pipeline: bounded like a command, the slot map read first.
- ``redis.asyncio.cluster.NodesManager.connection_kwargs`` -- connection:BoundedRedisCluster:
  nodes found later are made from it, so its "connection_class" becomes the guarded class.
- ``redis.asyncio.cluster.NodesManager.startup_nodes`` -- connection:BoundedRedisCluster: the
  nodes made before that, their connection class set.
- ``redis.asyncio.cluster.NodesManager.default_node`` -- connection:_AnyNodeCommandsParser makes
  it the first node that answers (keyless commands go there).
- ``redis.asyncio.cluster.NodesManager.nodes_cache`` -- connection:_AnyNodeCommandsParser: the
  nodes to try.
- ``redis.asyncio.cluster.NodesManager.move_node_to_end_of_cached_nodes`` --
  connection:_AnyNodeCommandsParser: a node that did not answer is tried last next time.
- ``redis.asyncio.cluster.NodesManager.initialize`` -- pubsub:ShardedSubscriber._by_server: the
  slot map read again (a failover's new primary) before channels are subscribed again.
- ``redis.asyncio.cluster.ClusterNode.server_type`` -- connection:_AnyNodeCommandsParser:
  primaries are tried first.
- ``redis.asyncio.cluster.ClusterNode.name`` -- connection:_AnyNodeCommandsParser,
  pubsub:ShardedSubscriber._by_server: a node's host:port.
- ``redis.asyncio.cluster.ClusterNode.execute_command`` -- connection:_AnyNodeCommandsParser:
  PING one node.
- ``redis.asyncio.cluster.ClusterNode.connection_class`` -- connection:BoundedRedisCluster sets
  it; pubsub:ShardedSubscriber._open makes a subscription's connection with it.
- ``redis.asyncio.cluster.ClusterNode.connection_kwargs`` -- pubsub:ShardedSubscriber._open:
  the node's address, credentials, TLS and timeouts.
- ``redis.asyncio.cluster.ClusterNode.get_encoder`` -- pubsub:ShardedSubscriber._open.
- ``redis.cluster.PRIMARY`` -- connection:_AnyNodeCommandsParser: a node's server_type.
- ``redis.exceptions.RedisClusterException.__cause__`` -- gateway/errors.py:
  is_retryable_redis_error: when no node answers, redis-py raises "Redis Cluster cannot be
  connected" from the last node's error, which says whether waiting can help.

Sharded pub/sub (pubsub.py):

- ``redis.asyncio.client.PubSub`` -- pubsub:ShardedSubscriber._open makes one on
  _OneConnection, a stand-in pool: PubSub asks its pool for get_encoder(), get_connection()
  and release(connection) (re_auth_callback too, only with a streaming credential provider,
  which tokq never sets), and hands push_handler_func to the connection's parser.
- ``redis.asyncio.client.PubSub.connection`` -- pubsub:ShardedSubscriber._read reads that
  connection directly.
- ``redis.asyncio.connection.ConnectionPool.connection_kwargs`` --
  pubsub:ShardedSubscriber._by_server (the address, for the logs) and _open.
- ``redis.asyncio.connection.ConnectionPool.get_encoder`` -- pubsub:ShardedSubscriber._open.
- ``redis.asyncio.connection.AbstractConnection.read_response`` -- pubsub:ShardedSubscriber._read
  (timeout, disconnect_on_error=False, push_request=True: None once the timeout passes with
  nothing to read), pipeline:ScriptPipeliner._round_trip.
- ``redis.crc.key_slot`` -- pubsub:ShardedSubscriber._open: one SSUBSCRIBE per slot.
- ``redis.utils.str_if_bytes`` -- pubsub: a message's kind.
- ``redis.backoff.ExponentialBackoff.compute`` -- connection:_connect_retried,
  pubsub:ShardedSubscriber._heal: backoff waited by tokq itself, not by a Retry.

Pipelined script runs (pipeline.py):

- ``hiredis.pack_command`` -- pipeline:pack_command: EVALSHA packed in C. bytes, str, int and
  float are packed as redis-py packs them; any other type is a TypeError.
- ``redis.asyncio.connection.ConnectionPool.get_connection`` -- pipeline:ScriptPipeliner
  _round_trip: a connection held across round trips, taken without arguments.
- ``redis.asyncio.connection.ConnectionPool.release`` -- pipeline:ScriptPipeliner._give_back.
- ``redis.asyncio.connection.AbstractConnection.send_packed_command`` --
  pipeline:ScriptPipeliner._round_trip: one write per round trip, check_health=False.
- ``redis.asyncio.connection.AbstractConnection.disconnect`` -- pipeline:ScriptPipeliner
  _round_trip (nowait=True): a reply may be left unread.
- ``redis.asyncio.connection.AbstractConnection.socket_timeout`` -- pipeline:ScriptPipeliner:
  None while the connection is held (one asyncio.timeout per round trip), restored before it
  goes back to the pool.
- ``redis.asyncio.connection.AbstractConnection.retry`` -- pipeline:ScriptPipeliner._round_trip:
  a lost round trip is retried by the connection's own policy.
- ``redis.asyncio.retry.Retry.call_with_retry`` -- pipeline:ScriptPipeliner._round_trip (do,
  fail), fail called with the error alone.

Scripts (tokq/queue/scripts.py):

- ``redis.commands.core.AsyncScript.sha`` -- tokq/queue/scripts.py:Scripts.sha: EVALSHA's name
  for a script (the pipeline sends it).
- ``redis.commands.core.AsyncScript.script`` -- tokq/queue/scripts.py:Scripts.run: the source
  EVAL sends when the server lost the script.
"""

from __future__ import annotations

from typing import NamedTuple


class Internal(NamedTuple):
    """One redis-py (or hiredis) name tokq relies on beyond the documented API."""

    name: str  # importable: a module, then its attributes
    # How it is called, by tokq or by redis-py on tokq's override: (positional count, keywords)
    # per call form. Empty: not called (an attribute, a class tokq subclasses).
    calls: tuple[tuple[int, tuple[str, ...]], ...] = ()
    instance: bool = False  # set on instances (checked on one), not on the class


_NO_ARGS = ((0, ()),)
_ONE_ARG = ((1, ()),)

# The names in the module doc, in its order (a test keeps the two the same).
REDIS_PY_INTERNALS: tuple[Internal, ...] = (
    # Connections
    Internal("redis.asyncio.connection.AbstractConnection._connect", _NO_ARGS),
    Internal("redis.connection.AbstractConnection._connect", _NO_ARGS),
    Internal("redis.asyncio.connection.AbstractConnection._send_packed_command", _ONE_ARG),
    Internal("redis.asyncio.connection.AbstractConnection._writer", instance=True),
    Internal("redis.asyncio.connection.ConnectionPool.connection_class", instance=True),
    Internal("redis.connection.ConnectionPool.connection_class", instance=True),
    Internal("redis.connection.parse_url", _ONE_ARG),
    # Cluster client
    Internal("redis._parsers.AsyncCommandsParser", _NO_ARGS),
    Internal("redis._parsers.AsyncCommandsParser.initialize", ((1, ()), (0, ()))),
    Internal("redis._parsers.AsyncCommandsParser.commands", instance=True),
    Internal("redis._parsers.AsyncCommandsParser.node", instance=True),
    Internal("redis.asyncio.cluster.RedisCluster.commands_parser", instance=True),
    Internal("redis.asyncio.cluster.RedisCluster.connection_kwargs", instance=True),
    Internal("redis.asyncio.cluster.RedisCluster.nodes_manager", instance=True),
    Internal("redis.asyncio.cluster.RedisCluster._initialize", instance=True),
    Internal("redis.asyncio.cluster.RedisCluster.ERRORS_ALLOW_RETRY"),
    Internal("redis.asyncio.cluster.ClusterPipeline.execute", ((0, ("raise_on_error",)), (0, ()))),
    Internal("redis.asyncio.cluster.NodesManager.connection_kwargs", instance=True),
    Internal("redis.asyncio.cluster.NodesManager.startup_nodes", instance=True),
    Internal("redis.asyncio.cluster.NodesManager.default_node", instance=True),
    Internal("redis.asyncio.cluster.NodesManager.nodes_cache", instance=True),
    Internal("redis.asyncio.cluster.NodesManager.move_node_to_end_of_cached_nodes", _ONE_ARG),
    Internal("redis.asyncio.cluster.NodesManager.initialize", _NO_ARGS),
    Internal("redis.asyncio.cluster.ClusterNode.server_type", instance=True),
    Internal("redis.asyncio.cluster.ClusterNode.name", instance=True),
    Internal("redis.asyncio.cluster.ClusterNode.execute_command", _ONE_ARG),
    Internal("redis.asyncio.cluster.ClusterNode.connection_class", instance=True),
    Internal("redis.asyncio.cluster.ClusterNode.connection_kwargs", instance=True),
    Internal("redis.asyncio.cluster.ClusterNode.get_encoder", _NO_ARGS),
    Internal("redis.cluster.PRIMARY"),
    Internal("redis.exceptions.RedisClusterException.__cause__"),
    # Sharded pub/sub
    Internal("redis.asyncio.client.PubSub", ((0, ("connection_pool", "push_handler_func")),)),
    Internal("redis.asyncio.client.PubSub.connection", instance=True),
    Internal("redis.asyncio.connection.ConnectionPool.connection_kwargs", instance=True),
    Internal("redis.asyncio.connection.ConnectionPool.get_encoder", _NO_ARGS),
    Internal("redis.asyncio.connection.AbstractConnection.read_response",
             ((0, ("timeout", "disconnect_on_error", "push_request")), (0, ()))),
    Internal("redis.crc.key_slot", _ONE_ARG),
    Internal("redis.utils.str_if_bytes", _ONE_ARG),
    Internal("redis.backoff.ExponentialBackoff.compute", _ONE_ARG),
    # Pipelined script runs
    Internal("hiredis.pack_command", _ONE_ARG),
    Internal("redis.asyncio.connection.ConnectionPool.get_connection", _NO_ARGS),
    Internal("redis.asyncio.connection.ConnectionPool.release", _ONE_ARG),
    Internal("redis.asyncio.connection.AbstractConnection.send_packed_command",
             ((1, ("check_health",)),)),
    Internal("redis.asyncio.connection.AbstractConnection.disconnect", ((0, ("nowait",)), (0, ()))),
    Internal("redis.asyncio.connection.AbstractConnection.socket_timeout", instance=True),
    Internal("redis.asyncio.connection.AbstractConnection.retry", instance=True),
    Internal("redis.asyncio.retry.Retry.call_with_retry", ((2, ()),)),
    # Scripts
    Internal("redis.commands.core.AsyncScript.sha", instance=True),
    Internal("redis.commands.core.AsyncScript.script", instance=True),
)
