"""Sharded pub/sub: SSUBSCRIBE to shard channels through a standalone Redis or a Redis Cluster
client, with one interface (``ShardedSubscriber``)."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster


async def _pass_message(message):
    """A published message, handed on as is. redis-py's default handler for RESP3 pushes logs
    each at DEBUG, building ``"..." + str(message)`` first even with DEBUG off: the repr of every
    completion message's bytes (a batch's results) on the gateway's loop."""
    return message


class ShardedSubscriber:
    """SSUBSCRIBE to shard channels through either client, with one interface: a standalone
    ``Redis`` reads them with ``get_message``; a ``RedisCluster`` opens one connection per
    node that owns a channel's slot and reads them with ``get_sharded_message``."""

    def __init__(self, client: aioredis.Redis | RedisCluster) -> None:
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        self._pubsub: Any = None

    async def subscribe(self, *channels: str) -> None:
        """Subscribe (a fresh connection each time, after re-reading the slot map in a cluster,
        so a resubscribe after a failover goes to the new primary)."""
        await self.aclose()
        if self._cluster:
            await self._client.initialize()
            await self._client.nodes_manager.initialize()
        self._pubsub = self._client.pubsub(push_handler_func=_pass_message)
        await self._pubsub.ssubscribe(*channels)
        for _ in channels:  # the confirmations
            await self._read(timeout=1.0, ignore_subscribe_messages=False)

    async def _read(self, timeout: float, ignore_subscribe_messages: bool) -> dict | None:
        if self._cluster:
            return await self._pubsub.get_sharded_message(
                ignore_subscribe_messages=ignore_subscribe_messages, timeout=timeout)
        return await self._pubsub.get_message(
            ignore_subscribe_messages=ignore_subscribe_messages, timeout=timeout)

    async def get_message(self, timeout: float) -> tuple[bytes, bytes] | None:
        """The next (channel, data) published, or None after ``timeout`` seconds."""
        msg = await self._read(timeout=timeout, ignore_subscribe_messages=True)
        if msg is None or msg["type"] not in (b"smessage", "smessage"):
            return None
        return msg["channel"], msg["data"]

    async def aclose(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                await pubsub.aclose()
            except Exception:  # closing a broken connection: nothing left to release
                pass
