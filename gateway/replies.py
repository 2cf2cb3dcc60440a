"""Waking the calls whose replies are complete.

Workers (through ack.lua) SPUBLISH a notice on the request's gateway's shard channel once every
input of it is answered (sharded pub/sub: Redis >= 7, and the only kind that stays on the queue's
node on Redis Cluster), one message per gateway for all the requests a batch completes; the
notice carries the results themselves unless they are large (tokq.queue.parse_notices), and then
the waiting call needs no second round trip to collect them.
One subscription per gateway process serves all waiting calls, so thousands of concurrent
requests hold no Redis connection each. A notice can be missed (a reconnect), so every
``poll_every_s`` the calls waiting longer than ``poll_after_s`` are also checked directly:
complete replies wake their call, and a reply hash that has vanished (Redis restarted and lost
it) fails the call UNAVAILABLE at once instead of leaving it to its deadline. A subscription
that breaks is restored by redis-py's reconnect while Redis answers (the calls keep waiting;
the poll makes up for notices lost in between); when the reconnect fails, every waiting call
fails UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
import redis.exceptions

from tokq.cancel import cancel_and_wait, raise_if_cancelled
from tokq.gateway.errors import Unavailable
from tokq.queue import REPLY_META_FIELDS, parse_notices
from tokq.subscriber import ShardedSubscriber

log = logging.getLogger(__name__)
_NET_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
MAX_POLLED = 1000  # calls checked per poll round (oldest first)


class _Waiter:
    __slots__ = ("future", "num_items", "enqueued_at")

    def __init__(self, future: asyncio.Future, num_items: int) -> None:
        self.future = future
        self.num_items = num_items
        self.enqueued_at: float | None = None  # polled only once its enqueue has returned


class ReplyRouter:
    def __init__(self, pubsub_client: aioredis.Redis, client: aioredis.Redis,
                 reply_key: Callable[[str], str], channels: Sequence[str],
                 poll_after_s: float = 1.0, poll_every_s: float = 0.25) -> None:
        """``channels``: this gateway's done channel on every queue shard it enqueues to;
        ``reply_key``: a request id's reply hash (on the shard it was enqueued to)."""
        self._pubsub_client = pubsub_client
        self._client = client
        self._reply_key = reply_key
        self.channels = list(channels)
        self._poll_after_s = poll_after_s
        self._poll_every_s = poll_every_s
        self._waiting: dict[str, _Waiter] = {}
        self._task: asyncio.Task | None = None
        self.subscribed = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reply-router")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def expect(self, request_id: str, num_items: int) -> asyncio.Future:
        """Register before enqueueing, so a fast reply cannot be missed. The future's result:
        the results (index -> raw result) when the notice carried them, else None (collect)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = _Waiter(fut, num_items)
        return fut

    def enqueued(self, request_id: str) -> None:
        waiter = self._waiting.get(request_id)
        if waiter is not None:
            waiter.enqueued_at = time.monotonic()

    def forget(self, request_id: str) -> None:
        waiter = self._waiting.pop(request_id, None)
        if waiter is not None and waiter.future.done() and not waiter.future.cancelled():
            # Failed (a broken subscription) before its call waited on it: mark it seen, or
            # asyncio logs "exception was never retrieved" for every such call.
            waiter.future.exception()

    def _settle(self, request_id: str, exc: Exception | None = None,
                results: dict[int, bytes] | None = None) -> None:
        waiter = self._waiting.get(request_id)
        if waiter and not waiter.future.done():
            if exc is None:
                waiter.future.set_result(results)
            else:
                waiter.future.set_exception(exc)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._waiting):
            self._settle(request_id, exc)

    async def _run(self) -> None:
        subscriber = ShardedSubscriber(self._pubsub_client)
        while True:
            try:
                await subscriber.subscribe(*self.channels)
                self.subscribed.set()
                # A notice published while we were not subscribed is lost: check everyone now.
                await self._poll(min_age_s=0.0)
                next_poll = time.monotonic() + self._poll_every_s
                while True:
                    raise_if_cancelled()
                    msg = await subscriber.get_message(timeout=self._poll_every_s)
                    if msg is not None:
                        for request_id, results in parse_notices(msg[1]):
                            self._settle(request_id, results=results)
                    if time.monotonic() >= next_poll:  # even while notices keep coming
                        await self._poll(min_age_s=self._poll_after_s)
                        next_poll = time.monotonic() + self._poll_every_s
            except asyncio.CancelledError:
                raise
            except _NET_ERRORS as exc:
                self.subscribed.clear()
                self._fail_all(Unavailable(f"lost the connection to Redis while waiting: {exc}"))
                await asyncio.sleep(0.2)
            except Exception:  # e.g. -BUSY or -READONLY: resubscribe, never die silently
                self.subscribed.clear()
                log.exception("reply subscription failed; resubscribing")
                await asyncio.sleep(0.2)
            finally:
                await subscriber.aclose()

    async def _poll(self, min_age_s: float) -> None:
        """Settle enqueued calls whose reply hash is complete (REPLY_META_FIELDS + one field
        per item) or gone. A failed poll is skipped, not fatal: the next round tries again."""
        now = time.monotonic()
        due = [(rid, w.num_items) for rid, w in list(self._waiting.items())
               if w.enqueued_at is not None and not w.future.done()
               and now - w.enqueued_at >= min_age_s][:MAX_POLLED]
        if not due:
            return
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for rid, _ in due:
                    pipe.hlen(self._reply_key(rid))
                lengths = await pipe.execute()
        except Exception as exc:
            log.warning("reply poll failed: %s", exc)
            return
        for (rid, n), length in zip(due, lengths):
            if length >= n + len(REPLY_META_FIELDS):
                self._settle(rid)
            elif length == 0:
                self._settle(rid, Unavailable(
                    "the request's state vanished from Redis (restarted or flushed); retry it"))
