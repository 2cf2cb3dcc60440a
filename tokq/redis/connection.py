"""Redis connections for the gateway and workers: any redis:// or rediss:// URL (TLS, password,
db), a bounded pool, and fail-fast timeouts so an unreachable Redis is reported in seconds
instead of hanging a caller (a connect that times out is tried again: ``_connect_retried``; a
standalone Redis within about two seconds, a cluster's node after the cluster client's own
tries, each re-reading the slot map: ``_retry``).

The same URL may name a standalone server or any node of a Redis Cluster: ``cluster="auto"``
asks the server (``INFO cluster``) once, and in cluster mode the client is redis-py's
``RedisCluster``, which finds the node owning each key's slot and follows MOVED/ASK. The CLIs
ask at start whatever the mode (``check_redis``), so a setting the server contradicts, or a
password it refuses, stops them with one line.

The redis-py internals this module relies on are listed in tokq/redis/__init__.py, with the
versions tested.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

import redis
import redis.asyncio as aioredis
import redis.exceptions
from redis._parsers import AsyncCommandsParser
from redis.asyncio.cluster import ClusterNode, NodesManager, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.cluster import PRIMARY
from redis.connection import parse_url

from tokq.redis.embedded import redact_url

CONNECT_TIMEOUT_S = 0.5
CONNECT_ATTEMPTS = 3  # a connect that times out is tried again, up to this many times in all
SOCKET_TIMEOUT_S = 5.0
ClusterMode = Literal["auto", "yes", "no"]
CLUSTER_MODES = ("auto", "yes", "no")
_PROBE_WAIT_S = 10.0  # a Redis still starting (compose, k8s) or not reachable yet gets this long

_cluster_by_url: dict[str, bool] = {}


_BACKOFF = ExponentialBackoff(cap=0.1, base=0.02)


def _retry() -> Retry:
    # redis-py's default retry backs off for seconds; a refused connection must surface fast.
    # Connection errors are retried (a stale pooled connection after a Redis restart, a reset
    # by a proxy or a failover): the command may already have run with only its answer lost,
    # which is why every queue script is idempotent (tokq.queue.shard). Timeouts are not retried by
    # this policy: a standalone Redis silent for SOCKET_TIMEOUT_S is failed to the caller, not
    # waited on three times. redis-py's cluster client is different: it retries a timeout itself
    # (RedisCluster.ERRORS_ALLOW_RETRY, as many tries as this policy allows) after re-reading the
    # slot map, since a primary that went silent may have been failed over; the scripts'
    # idempotency makes that resend safe, and a silent node costs up to 3 x SOCKET_TIMEOUT_S.
    # (A connect timeout is retried below all this, by the connection itself: _connect_retried.)
    return Retry(_BACKOFF, retries=2, supported_errors=(redis.exceptions.ConnectionError,))


def _connect_retried(base: type[aioredis.Connection]) -> type[aioredis.Connection]:
    """``base`` whose socket connect (TCP, and TLS's handshake) is tried again when it times out,
    up to CONNECT_ATTEMPTS times in all, as the retry policy backs off.

    On a loaded machine (or a busy Redis slow to accept) a first connect can take longer than
    CONNECT_TIMEOUT_S, and redis-py turns that into a redis TimeoutError, which the retry policy
    does not retry (a read timeout must fail: the command may have run). Nothing has been sent
    on a connection still connecting, so trying again is safe; it happens here, below redis-py's
    conversion, where a connect timeout is still told apart from a read timeout. Bounded: a
    Redis that never answers a connect is reported after CONNECT_ATTEMPTS x CONNECT_TIMEOUT_S
    (~1.6 s)."""

    class ConnectRetried(base):
        async def _connect(self) -> None:
            for attempt in range(1, CONNECT_ATTEMPTS + 1):
                try:
                    return await super()._connect()
                except TimeoutError:  # the connect timeout (asyncio.timeout's, or the socket's)
                    if attempt == CONNECT_ATTEMPTS:
                        raise
                await asyncio.sleep(_BACKOFF.compute(attempt))

    return ConnectRetried


def _connect_retried_sync(base: type[redis.Connection]) -> type[redis.Connection]:
    """``_connect_retried`` for redis-py's blocking connections (the cluster-mode probe). For
    rediss:// their TLS handshake runs under the socket timeout, not the connect timeout, so a
    TLS endpoint that accepts and then stays silent costs the probe up to 3 x SOCKET_TIMEOUT_S."""

    class ConnectRetried(base):
        def _connect(self) -> Any:
            for attempt in range(1, CONNECT_ATTEMPTS + 1):
                try:
                    return super()._connect()
                except TimeoutError:  # socket.timeout
                    if attempt == CONNECT_ATTEMPTS:
                        raise
                time.sleep(_BACKOFF.compute(attempt))

    return ConnectRetried


class RedisSetupError(Exception):
    """The Redis URL or the cluster setting cannot work with the server the URL names: a
    one-line, user-facing error (no password in it), for the CLIs to stop on at start."""


def _cluster_enabled(url: str, wait_s: float) -> bool:
    """The server's ``cluster_enabled`` (INFO cluster), asked again ~0.5 s apart for ``wait_s``
    (0: once) while no connection can be made or the server does not answer: a refused connect
    fails at once, a timed-out one only after its tries (~1.6 s), and both mean a server not up
    or not reachable yet. A refused password is not asked again (redis-py's
    AuthenticationError is a ConnectionError)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                  socket_timeout=SOCKET_TIMEOUT_S)
    pool = client.connection_pool
    pool.connection_class = _connect_retried_sync(pool.connection_class)  # the URL scheme's
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                try:
                    server = client.info("server")
                except redis.exceptions.ResponseError:  # an ACL without INFO server: not a Sentinel's
                    server = {}
                if "sentinel" in (server.get("redis_mode"), server.get("server_mode")):  # Redis, Valkey
                    # It answers INFO and PING, so it passed for a standalone server, and every
                    # queue command then failed (EVALSHA: unknown command).
                    raise RedisSetupError(
                        f"Redis at {redact_url(url)} is a Sentinel (INFO: mode sentinel), which "
                        "holds no data: give --redis-url (TOKQ_REDIS_URL) the primary it names "
                        "(SENTINEL get-master-addr-by-name NAME)")
                return bool(client.info("cluster").get("cluster_enabled"))
            except redis.exceptions.AuthenticationError:
                raise
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                if time.monotonic() + 0.5 >= deadline:
                    raise
                time.sleep(0.5)
    finally:
        client.close()


def is_cluster(url: str, mode: ClusterMode = "auto") -> bool:
    """Whether ``url`` names a Redis Cluster node: ``mode`` yes/no says so, ``auto`` asks the
    server once (``cluster_enabled:1`` in INFO cluster) and remembers the answer per URL."""
    if mode not in CLUSTER_MODES:
        raise ValueError(f"redis_cluster must be one of {', '.join(CLUSTER_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode == "yes"
    if url not in _cluster_by_url:
        _cluster_by_url[url] = _cluster_enabled(url, _PROBE_WAIT_S)
    return _cluster_by_url[url]


def check_redis(url: str, mode: ClusterMode = "auto") -> bool:
    """Whether ``url`` names a cluster node, asked of the server at start, raising
    RedisSetupError where the answer shows a setting that cannot work: a refused password,
    ``mode`` yes against a standalone server (every command would fail), ``mode`` no against a
    cluster node (every key of a slot it does not own: MOVED, CROSSSLOT); with ``auto``, which
    needs the answer, also a server that does not answer within ~10 s. With yes or no, a server
    that is not up yet (asked once) or does not let INFO be run (an ACL, a proxy) leaves the
    setting unchecked: tokq starts and its commands wait for the server, as after any outage."""
    where = redact_url(url)
    explicit = mode in ("yes", "no")
    try:
        enabled = _cluster_enabled(url, 0 if explicit else _PROBE_WAIT_S)
    except redis.exceptions.AuthenticationError as exc:
        if not parse_url(url).get("password"):
            raise RedisSetupError(f"Redis at {where} asks for a password, and --redis-url (TOKQ_REDIS_URL) "
                                  "has none: redis://:PASSWORD@HOST:PORT/DB") from None
        raise RedisSetupError(f"Redis at {where} refused the password (or user) of --redis-url "
                              f"(TOKQ_REDIS_URL): {exc}") from None
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        if explicit:
            return mode == "yes"
        raise RedisSetupError(f"Redis at {where} (--redis-url, TOKQ_REDIS_URL) did not answer: {exc} "
                              "(--redis-cluster auto asks it at start whether it is a cluster "
                              "node)") from None
    except redis.exceptions.ResponseError as exc:
        if explicit:
            return mode == "yes"
        raise RedisSetupError(f"Redis at {where} refused INFO cluster ({exc}): set --redis-cluster "
                              "(TOKQ_REDIS_CLUSTER) to yes or no") from None
    if mode == "yes" and not enabled:
        raise RedisSetupError(f"--redis-cluster yes (TOKQ_REDIS_CLUSTER), but the Redis at {where} is not "
                              "a cluster node (INFO cluster: cluster_enabled:0): use auto or no")
    if mode == "no" and enabled:
        raise RedisSetupError(f"--redis-cluster no (TOKQ_REDIS_CLUSTER), but the Redis at {where} is a "
                              "cluster node (INFO cluster: cluster_enabled:1), whose slots a plain "
                              "client cannot follow (MOVED, CROSSSLOT): use auto or yes")
    if mode == "auto":
        _cluster_by_url[url] = enabled
    return enabled


def check_redis_or_exit(url: str, mode: ClusterMode = "auto") -> bool:
    """``check_redis`` for a CLI: a RedisSetupError is click's error (one line, exit status 1)."""
    import click

    try:
        return check_redis(url, mode)
    except RedisSetupError as exc:
        raise click.ClickException(str(exc)) from None


def _guarded(base: type[aioredis.Connection]) -> type[aioredis.Connection]:
    """``base`` whose connect timeouts are retried (``_connect_retried``) and whose send fails
    with a ConnectionError on a connection closed under it.

    After a connection error on a node, redis-py's cluster client closes that node's free
    connections in tasks that run later; a command that took one of them from the pool in
    between finds it closed mid-send and raised AttributeError (``_writer`` is None), which
    reached callers as INTERNAL. One whose transport was closed while it sat in the pool (the same
    close tasks, before they clear ``_writer``): asyncio's loop drops what is written to it (the
    read then fails), uvloop raises RuntimeError, INTERNAL again. As a ConnectionError the
    command (never sent) is retried."""

    class SendGuarded(_connect_retried(base)):
        async def _send_packed_command(self, command: Any) -> None:
            if self._writer is None or self._writer.is_closing():
                raise redis.exceptions.ConnectionError("connection closed before the send")
            await super()._send_packed_command(command)

    return SendGuarded


def _guard_pool(client: aioredis.Redis) -> aioredis.Redis:
    pool = client.connection_pool
    pool.connection_class = _guarded(pool.connection_class)  # the URL scheme's class, guarded
    return client


class _AnyNodeCommandsParser(AsyncCommandsParser):
    """redis-py's key finder (COMMAND's table), made independent of any one node.

    redis-py reads the table from the default node, the first primary of the slot map, on every
    (re)initialize of the client, which follows any connection error; when that read fails the
    initialize fails, and so does every command, on every node. A killed primary stays listed
    until its replica takes over (for good if the replica is gone too): meanwhile a tokq process
    reached none of its shards, not only the dead node's. The table is read once, from the first
    node that answers; each initialize then makes the first node that answers a PING the default
    node (PING and other keyless commands go there, COMMAND GETKEYS too), a node that does not
    moved to the end of redis-py's list so the next initialize tries it last."""

    def __init__(self, nodes_manager: NodesManager) -> None:
        super().__init__()
        self._nodes_manager = nodes_manager

    async def initialize(self, node: ClusterNode | None = None) -> None:
        # Without a node: redis-py met a command missing from the table (a server upgraded
        # under the client): read it again.
        manager = self._nodes_manager
        read_table = node is None or not self.commands
        candidates = [node or manager.default_node, *manager.nodes_cache.values()]
        candidates = [n for n in dict.fromkeys(candidates) if n is not None]
        candidates.sort(key=lambda n: n.server_type != PRIMARY)  # primaries first, in order
        error: Exception | None = None
        for candidate in candidates:
            try:
                if read_table:
                    await super().initialize(candidate)
                else:
                    await candidate.execute_command("PING")
            except redis.exceptions.RedisError as exc:
                error = exc
                manager.move_node_to_end_of_cached_nodes(candidate.name)
                continue
            self.node = manager.default_node = candidate
            return
        if error is None:
            raise redis.exceptions.RedisClusterException("no cluster node known to ask")
        raise error


class BoundedRedisCluster(RedisCluster):
    """redis-py's cluster client raises MaxConnectionsError when a node's pool is used up; the
    gateway runs thousands of concurrent calls, so commands wait for one of
    ``max_connections`` slots instead (as the standalone BlockingConnectionPool does). Its
    connections are guarded (``_guarded``), and no one node's death fails its (re)initialize
    (``_AnyNodeCommandsParser``)."""

    def __init__(self, *args: Any, max_connections: int = 32, **kwargs: Any) -> None:
        super().__init__(*args, max_connections=max_connections, **kwargs)
        self._bound = asyncio.Semaphore(max_connections)
        self.commands_parser = _AnyNodeCommandsParser(self.nodes_manager)
        # redis-py takes no connection class for a cluster: set it where nodes get theirs.
        guarded = _guarded(self.connection_kwargs["connection_class"])
        for node_kwargs in (self.connection_kwargs, self.nodes_manager.connection_kwargs):
            node_kwargs["connection_class"] = guarded
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_class = guarded

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self._bound:
            if self._initialize:
                # redis-py picks a command's node before its own lazy initialize: concurrent
                # first calls (or calls right after a failover reset the slot map) went to the
                # default node, drew MOVED, and the reset that follows 5 MOVEDs closed the
                # connections of commands still in flight. Read the slot map first.
                await self.initialize()
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        async def bounded_execute(*args: Any, **kwargs: Any) -> Any:
            async with self._bound:
                if self._initialize:
                    await self.initialize()
                return await execute(*args, **kwargs)

        pipe.execute = bounded_execute
        return pipe


def _keepalive(url: str) -> dict:
    """TCP keepalive (a peer gone without a reset is noticed) where the URL is TCP: redis-py's
    unix-socket connection takes no such option (a TypeError at connect)."""
    return {} if url.lower().startswith("unix:") else {"socket_keepalive": True}


def _cluster_client(url: str, max_connections: int) -> RedisCluster:
    return BoundedRedisCluster.from_url(
        url,
        max_connections=max_connections,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_keepalive=True,  # a cluster is TCP only
        # Connection errors, timeouts and CLUSTERDOWN are retried after re-reading the slot map
        # (how a failover is followed; see _retry).
        retry=_retry(),
        # While one primary fails over, the slots of the others keep serving.
        require_full_coverage=False,
        decode_responses=False,
    )


def connect(url: str, *, max_connections: int = 32, pool_timeout_s: float = 5.0,
            cluster: ClusterMode = "auto") -> aioredis.Redis | RedisCluster:
    """A binary-safe asyncio client over at most ``max_connections`` connections (per node in
    a cluster): a ``RedisCluster`` where ``url`` names a cluster node, else a ``Redis``."""
    if is_cluster(url, cluster):
        return _cluster_client(url, max_connections)
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        **_keepalive(url),
        retry=_retry(),
        decode_responses=False,
    )
    return _guard_pool(aioredis.Redis(connection_pool=pool))


def connect_pubsub(url: str, cluster: ClusterMode = "auto") -> aioredis.Redis | RedisCluster:
    """A separate client for a long-lived (S)SUBSCRIBE (it holds its connection for good). In
    a cluster, ``client.pubsub()`` is a ClusterPubSub whose SSUBSCRIBE goes to the node that
    owns the channel's slot."""
    if is_cluster(url, cluster):
        return _cluster_client(url, max_connections=4)
    return _guard_pool(aioredis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                               **_keepalive(url), retry=_retry(), decode_responses=False))


def connect_sync(url: str, cluster: ClusterMode = "auto") -> redis.Redis | redis.RedisCluster:
    """A blocking client for one-shot CLI work (liveness check, publishing a budget)."""
    kwargs = dict(socket_connect_timeout=1.0, socket_timeout=2.0)
    if is_cluster(url, cluster):
        return redis.RedisCluster.from_url(url, require_full_coverage=False, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


async def close_client(client: aioredis.Redis | RedisCluster) -> None:
    """Close ``client`` on the way out, its sockets given up where closing one takes longer than
    the connect timeout: redis-py then raises TimeoutError (a loaded host, a Redis that stopped
    reading), and a stop that raised there would skip what follows it and exit non-zero."""
    try:
        await client.aclose()
    except (redis.exceptions.RedisError, OSError) as exc:
        logging.getLogger("tokq.redis.connection").warning("closing a Redis client: %s (its sockets left to the OS)", exc)
