"""Sharded pub/sub: SSUBSCRIBE to shard channels through a standalone Redis or a Redis Cluster
client, with one interface (``ShardedSubscriber``).

A shard channel lives on the node that owns its slot, so a subscription is one connection per
such node (one in all on a standalone Redis), each read by its own task, which hands each
message on at once (to ``on_message``, or into one queue for ``get_message``). (redis-py's
``ClusterPubSub`` reads the nodes one after another, each for the whole timeout, so a notice on
the third node waited up to twice the read timeout: 0.5-1 s for a worker's work wake-up.)

A node that cannot be reached takes only its own channels down: ``on_down`` is told which, and
why, once per outage, and the other nodes' channels keep delivering; the lost channels are
subscribed again in the background, the slot map re-read each time (a failover's new primary is
found), with backoff up to ``RESUBSCRIBE_BACKOFF``'s cap, until they are back (``on_up``). A
connection that breaks is reopened at once (a reset connection, a restarted Redis): only when
that fails are its channels down; either way, what was published meanwhile is lost, which
``on_up`` says. A connection silent for ``PING_AFTER_S`` is pinged, and one that then stays
silent as long again is taken for broken (a node cut off without a reset).

The redis-py internals this module relies on are listed in tokq/redis/__init__.py, with the
versions tested.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.crc import key_slot
from redis.utils import str_if_bytes

from tokq.tasks import raise_if_cancelled

log = logging.getLogger("tokq.redis.pubsub")

PING_AFTER_S = 5.0  # a connection silent this long is pinged; silent as long again: broken
CONFIRM_TIMEOUT_S = 2.0  # a node's confirmations of a (re)subscribe, all of them
RESUBSCRIBE_BACKOFF = ExponentialBackoff(cap=1.0, base=0.1)  # 0.2, 0.4, 0.8, 1, 1, ... s
MAX_BUFFERED = 10_000  # messages read and not yet taken (the node readers wait beyond this)

OnDown = Callable[[list[str], BaseException], None]
OnUp = Callable[[list[str]], None]
OnMessage = Callable[[bytes, bytes], None]


async def _pass_message(message):
    """A published message, handed on as is. redis-py's default handler for RESP3 pushes logs
    each at DEBUG, building ``"..." + str(message)`` first even with DEBUG off: the repr of every
    completion message's bytes (a batch's results) on the gateway's loop."""
    return message


class _OneConnection:
    """What redis-py's ``PubSub`` needs of a pool: a connection made as the client makes its own
    to that server (class, address, credentials, TLS, timeouts), with redis-py's own reconnect
    turned off: a broken connection is reopened by ``ShardedSubscriber``, which knows which
    channels it carried."""

    def __init__(self, connection_class: Any, connection_kwargs: dict, encoder: Any) -> None:
        self.connection_class = connection_class
        self.connection_kwargs = connection_kwargs
        self._encoder = encoder

    def get_encoder(self) -> Any:
        return self._encoder

    def get_protocol(self) -> Any:
        return self.connection_kwargs.get("protocol")

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        # No supported errors: with any, redis-py's retry first reconnects and resubscribes
        # every channel in one SSUBSCRIBE (CROSSSLOT on a cluster), even with 0 retries.
        connection = self.connection_class(**{**self.connection_kwargs,
                                              "retry": Retry(NoBackoff(), 0, supported_errors=())})
        try:
            await connection.connect()
        except BaseException:
            await connection.disconnect()
            raise
        return connection

    async def release(self, connection: Any) -> None:
        await connection.disconnect()


class _Link:
    """One subscribed connection to one server, and the task that reads it."""

    def __init__(self, where: str, node: Any, pubsub: PubSub, channels: Iterable[str]) -> None:
        self.where = where  # host:port, for the logs
        self.node = node  # the ClusterNode (None: the standalone server)
        self.pubsub = pubsub
        self.channels = set(channels)
        self.task: asyncio.Task | None = None

    async def close(self) -> None:
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
            try:
                await self.task
            except BaseException:  # noqa: BLE001 - cancelled, or it had failed: either way gone
                pass
        try:
            await self.pubsub.aclose()
        except Exception:  # noqa: BLE001 - closing a broken connection: nothing left to release
            pass


def _name(channel: Any) -> str:
    return channel.decode() if isinstance(channel, bytes) else str(channel)


class ShardedSubscriber:
    """SSUBSCRIBE to shard channels through either client (``aioredis.Redis`` or
    ``RedisCluster``), read with one ``get_message``; see the module doc.

    ``on_down(channels, error)``: those channels are not subscribed now (once per outage; their
    messages come again after ``on_up``). ``on_up(channels)``: those channels are subscribed
    (again): anything published on them before may have been missed. Both are called on the
    event loop, from the subscriber's tasks or from ``subscribe``; they must not block.
    ``label`` names the subscription in the log.

    ``on_message(channel, data)``, if given, is handed each message by the node's reader as it
    is read, instead of queueing it for ``get_message``: no task switch and no timer per message
    (the gateway's completion notices, one per call at low load). It must not block; what it
    raises is logged and that message dropped."""

    def __init__(self, client: aioredis.Redis | RedisCluster, *, on_down: OnDown | None = None,
                 on_up: OnUp | None = None, on_message: OnMessage | None = None,
                 label: str = "sharded subscription") -> None:
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        self._on_down = on_down
        self._on_up = on_up
        self._on_message = on_message
        self._label = label
        self._messages: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue(MAX_BUFFERED)
        self._links: set[_Link] = set()
        self._channels: list[str] = []
        self._down: dict[str, BaseException] = {}  # channel -> why it is not subscribed
        self._down_since: float | None = None
        self._healer: asyncio.Task | None = None
        self._readers: set[asyncio.Task] = set()
        self._slot_map_lock = asyncio.Lock()

    @property
    def channels(self) -> list[str]:
        return list(self._channels)

    @property
    def down(self) -> dict[str, BaseException]:
        """The channels not subscribed now, each with the error that took it down."""
        return dict(self._down)

    async def subscribe(self, *channels: str) -> None:
        """Subscribe to ``channels`` (dropping any earlier subscription): every node at once,
        after re-reading the slot map in a cluster. Returns once each node has confirmed or
        failed; the channels of a node that failed are ``down`` (``on_down`` told) and are
        subscribed again in the background. Never raises for an unreachable Redis."""
        await self.aclose()
        while not self._messages.empty():  # the earlier subscription's
            self._messages.get_nowait()
        self._channels = list(dict.fromkeys(_name(c) for c in channels))
        await self._attach(self._channels, first=True)

    async def get_message(self, timeout: float) -> tuple[bytes, bytes] | None:
        """The next (channel, data) published on any subscribed channel, or None after
        ``timeout`` seconds (always None with ``on_message``, which takes every message)."""
        try:
            return self._messages.get_nowait()
        except asyncio.QueueEmpty:
            pass
        try:
            async with asyncio.timeout(timeout):
                return await self._messages.get()
        except TimeoutError:
            return None

    async def aclose(self) -> None:
        # The tasks first: a reader reopening its broken connection would add a link after
        # the links were closed.
        current = asyncio.current_task()
        tasks = [t for t in (self._healer, *self._readers) if t is not None and t is not current]
        self._healer = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        links, self._links = self._links, set()
        for link in links:
            await link.close()
        self._down.clear()
        self._down_since = None

    # -- subscribing ------------------------------------------------------------------------
    async def _attach(self, channels: list[str], first: bool = False) -> None:
        """Subscribe ``channels`` on the servers that own them now, one new connection per
        server, all at once; mark those that fail down and those that succeed up."""
        try:
            groups = await self._by_server(channels)
        except Exception as exc:  # noqa: BLE001 - no slot map (every startup node unreachable)
            self._mark_down(channels, exc, where="the cluster")
            return
        results = await asyncio.gather(*(self._open(where, node, chs)
                                         for (where, node), chs in groups.items()),
                                       return_exceptions=True)
        for ((where, node), chs), result in zip(groups.items(), results):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                self._mark_down(chs, result, where=where)
            else:
                self._mark_up(chs, announce=not first)
        if first:  # the first subscribe: the caller learns every channel's state from it
            if self._on_up is not None:
                up = [c for c in channels if c not in self._down]
                if up:
                    self._notify(self._on_up, up)

    async def _by_server(self, channels: list[str]) -> dict[tuple[str, Any], list[str]]:
        """``channels`` grouped by the server that owns each now (keys: (host:port, node))."""
        if not self._cluster:
            kwargs = self._client.connection_pool.connection_kwargs
            where = f"{kwargs.get('host', kwargs.get('path', ''))}:{kwargs.get('port', '')}"
            return {(where, None): list(channels)}
        async with self._slot_map_lock:  # one re-read for every link that broke at once
            await self._client.initialize()
            await self._client.nodes_manager.initialize()
        groups: dict[tuple[str, Any], list[str]] = defaultdict(list)
        for channel in channels:
            try:
                node = self._client.get_node_from_key(channel)
            except Exception as exc:  # noqa: BLE001 - its slot is not served now
                self._mark_down([channel], exc, where="the cluster")
                continue
            groups[node.name, node].append(channel)
        return groups

    async def _open(self, where: str, node: Any, channels: list[str]) -> _Link:
        """A new connection to ``node`` (None: the standalone server) subscribed to
        ``channels``, confirmed, its reader started."""
        if node is None:
            pool = self._client.connection_pool
            source = _OneConnection(pool.connection_class, pool.connection_kwargs, pool.get_encoder())
        else:
            source = _OneConnection(node.connection_class, node.connection_kwargs, node.get_encoder())
        pubsub = PubSub(connection_pool=source, push_handler_func=_pass_message)
        link = _Link(where, node, pubsub, channels)
        try:
            by_slot: dict[int, list[str]] = defaultdict(list)  # one SSUBSCRIBE per slot
            for channel in channels:  # (a cluster refuses channels of several: CROSSSLOT)
                by_slot[key_slot(channel.encode())].append(channel)
            for group in by_slot.values():
                await pubsub.ssubscribe(*group)
            pending = set(channels)
            async with asyncio.timeout(CONFIRM_TIMEOUT_S):
                while pending:
                    msg = await pubsub.get_message(timeout=CONFIRM_TIMEOUT_S)
                    if msg is None:
                        continue
                    kind = str_if_bytes(msg["type"])
                    if kind == "ssubscribe":
                        pending.discard(_name(msg["channel"]))
                    elif kind == "smessage":
                        await self._deliver(msg["channel"], msg["data"])
        except BaseException as exc:
            await link.close()
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"no confirmation of SSUBSCRIBE from {where} within "
                                   f"{CONFIRM_TIMEOUT_S:g} s") from exc
            raise
        link.task = asyncio.create_task(self._read(link), name=f"ssubscribe {where}")
        self._readers.add(link.task)
        link.task.add_done_callback(self._readers.discard)
        self._links.add(link)
        return link

    # -- reading ----------------------------------------------------------------------------
    async def _read(self, link: _Link) -> None:
        # Straight from the connection, as PubSub.get_message reads it, without the layers
        # around that read (a health check, a retry wrapper with no retries, a message dict,
        # an observability hook): ~14 us of Python per message read on loopback, against ~28.
        # Its retries are off (_OneConnection) and tokq sets no health-check interval.
        conn = link.pubsub.connection
        pinged_at: float | None = None
        while True:
            raise_if_cancelled()  # a cancel dropped by a send's wait_for (3.11) must still end it
            try:
                msg = await conn.read_response(timeout=PING_AFTER_S, disconnect_on_error=False,
                                               push_request=True)
                if msg is None:
                    now = time.monotonic()
                    if pinged_at is None:
                        await link.pubsub.ping()
                        pinged_at = now
                    elif now - pinged_at >= PING_AFTER_S:
                        raise TimeoutError(f"{link.where} did not answer a PING within "
                                           f"{PING_AFTER_S:g} s")
                    continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: the connection is done
                await self._broken(link, exc)
                return
            pinged_at = None  # it answers (a message, or a PING's reply)
            kind = str_if_bytes(msg[0]) if isinstance(msg, list) and len(msg) == 3 else None
            if kind == "smessage":
                await self._deliver(msg[1], msg[2])
            elif kind == "sunsubscribe":
                # Redis dropped it: its slot moved (failover of a primary left alive,
                # resharding). Subscribe it again where its slot is now.
                channel = _name(msg[1])
                if channel in link.channels:
                    link.channels.discard(channel)
                    self._mark_down([channel], ConnectionError(
                        f"{link.where} dropped the subscription (its slot moved)"), where=link.where)
                if not link.channels:
                    self._links.discard(link)
                    await link.close()
                    return

    async def _deliver(self, channel: bytes, data: bytes) -> None:
        if self._on_message is None:
            await self._messages.put((channel, data))
            return
        try:
            self._on_message(channel, data)
        except Exception:  # noqa: BLE001 - one bad message must not end the node's reader
            log.exception("%s: a message on %s was not handled", self._label, _name(channel))

    async def _broken(self, link: _Link, exc: BaseException) -> None:
        """``link`` failed: reopen it on the same server at once (a reset connection, a
        restarted Redis); if that fails too, its channels are down until the background
        resubscribe brings them back (re-reading the slot map: a failover)."""
        self._links.discard(link)
        await link.close()
        channels = sorted(link.channels)
        if not channels:
            return
        try:
            await self._open(link.where, link.node, channels)
        except asyncio.CancelledError:
            raise
        except Exception as again:  # noqa: BLE001
            self._mark_down(channels, again, where=link.where, first_error=exc)
            return
        log.info("%s: reconnected to %s after %s", self._label, link.where, _describe(exc))
        self._mark_up(channels, announce=True)

    # -- state ------------------------------------------------------------------------------
    def _mark_down(self, channels: list[str], exc: BaseException, *, where: str,
                   first_error: BaseException | None = None) -> None:
        lost = [c for c in channels if c not in self._down]
        for channel in channels:
            self._down[channel] = exc
        if lost:
            if self._down_since is None:
                self._down_since = time.monotonic()
            cause = (f"{_describe(first_error)}, then " if first_error is not None
                     and _describe(first_error) != _describe(exc) else "")
            log.warning("%s: %d channel(s) on %s not subscribed (%s%s); subscribing them again "
                        "in the background", self._label, len(lost), where, cause, _describe(exc))
            if self._on_down is not None:
                self._notify(self._on_down, lost, exc)
        if self._down and (self._healer is None or self._healer.done()):
            self._healer = asyncio.create_task(self._heal(), name=f"{self._label} resubscribe")

    def _mark_up(self, channels: list[str], *, announce: bool) -> None:
        back = [c for c in channels if self._down.pop(c, None) is not None]
        if back and self._down_since is not None:
            log.warning("%s: %d channel(s) subscribed again after %.1f s", self._label,
                        len(back), time.monotonic() - self._down_since)
        if not self._down:
            self._down_since = None
        if announce and self._on_up is not None:
            self._notify(self._on_up, list(channels))

    def _notify(self, callback: Callable, *args: Any) -> None:
        """A caller's callback, its failure logged: raised here, it would end the resubscribe
        task (or a link's reader) and leave channels down for good."""
        try:
            callback(*args)
        except Exception:  # noqa: BLE001
            log.exception("%s: %s failed", self._label, getattr(callback, "__name__", callback))

    async def _heal(self) -> None:
        """Subscribe the down channels again, with backoff, until none is left."""
        attempt = 0
        while self._down:
            raise_if_cancelled()
            attempt += 1
            await asyncio.sleep(RESUBSCRIBE_BACKOFF.compute(attempt))
            await self._attach(sorted(self._down))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
