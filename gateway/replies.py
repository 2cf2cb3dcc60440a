"""Waking the calls whose replies are complete.

Workers (through ack.lua) PUBLISH a request's id on its gateway's channel once every input of it
is answered. One subscription per gateway process serves all waiting calls, so thousands of
concurrent requests hold no Redis connection each. A notice can be missed (a reconnect), so calls
waiting longer than ``poll_after_s`` are also checked directly; if the subscription breaks,
waiting calls fail UNAVAILABLE at once rather than hang until their deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis
import redis.exceptions

from tokq.gateway.errors import Unavailable
from tokq.keys import QueueKeys

log = logging.getLogger(__name__)
_NET_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class ReplyRouter:
    def __init__(self, pubsub_client: aioredis.Redis, client: aioredis.Redis, keys: QueueKeys,
                 channel: str, poll_after_s: float = 1.0) -> None:
        self._pubsub_client = pubsub_client
        self._client = client
        self._keys = keys
        self.channel = channel
        self._poll_after_s = poll_after_s
        self._waiting: dict[str, tuple[asyncio.Future, int, float]] = {}
        self._task: asyncio.Task | None = None
        self.subscribed = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reply-router")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def expect(self, request_id: str, num_items: int) -> asyncio.Future:
        """Register before enqueueing, so a fast reply cannot be missed."""
        fut = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = (fut, num_items, time.monotonic())
        return fut

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def _wake(self, request_id: str) -> None:
        entry = self._waiting.get(request_id)
        if entry and not entry[0].done():
            entry[0].set_result(None)

    def _fail_all(self, exc: Exception) -> None:
        for fut, _, _ in self._waiting.values():
            if not fut.done():
                fut.set_exception(exc)

    async def _run(self) -> None:
        while True:
            pubsub = self._pubsub_client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                self.subscribed.set()
                # A notice published while we were disconnected is lost: check everyone now.
                await self._poll(min_age_s=0.0)
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.25)
                    if msg is not None and msg["type"] == "message":
                        self._wake(msg["data"].decode())
                        continue
                    await self._poll(min_age_s=self._poll_after_s)
            except asyncio.CancelledError:
                raise
            except _NET_ERRORS as exc:
                self.subscribed.clear()
                self._fail_all(Unavailable(f"lost the connection to Redis while waiting: {exc}"))
                await asyncio.sleep(0.2)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _poll(self, min_age_s: float) -> None:
        """Wake calls whose reply hash is complete (fields n, ch + one per item)."""
        now = time.monotonic()
        due = [(rid, n) for rid, (fut, n, t0) in list(self._waiting.items())
               if not fut.done() and now - t0 >= min_age_s][:1000]
        if not due:
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for rid, _ in due:
                pipe.hlen(self._keys.reply(rid))
            lengths = await pipe.execute()
        for (rid, n), length in zip(due, lengths):
            if length >= n + 2:
                self._wake(rid)
