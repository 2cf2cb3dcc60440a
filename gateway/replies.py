"""Waking the calls whose replies are complete: one sharded pub/sub subscription per gateway
process for the notices, and a poll for notices that were missed (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis

from tokq.tasks import stop_tasks, raise_if_cancelled
from tokq.gateway.errors import Unavailable
from tokq.queue.shard import REPLY_META_FIELDS, parse_notices
from tokq.redis.pubsub import ShardedSubscriber

log = logging.getLogger(__name__)
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
                 poll_after_s: float = 1.0, poll_every_s: float = 0.25,
                 shard_of: Callable[[str], int | None] | None = None) -> None:
        """``channels``: this gateway's notice channel on each queue shard (shard i's at i);
        ``reply_key``: a request id's reply hash; ``shard_of``: a request id's shard (None: not
        known yet). Without ``shard_of``, a lost channel fails every waiting call."""
        self._pubsub_client = pubsub_client
        self._client = client
        self._reply_key = reply_key
        self.channels = list(channels)
        self._shard_of = shard_of
        self._repoll = asyncio.Event()  # a channel was subscribed again: poll every waiting call now
        self._poll_after_s = poll_after_s
        self._poll_every_s = poll_every_s
        self._waiting: dict[str, _Waiter] = {}
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._subscriber: ShardedSubscriber | None = None
        self.subscribed = asyncio.Event()  # set while every channel is subscribed

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()  # for expect(): asking each time costs a getpid() (3.11)
        self._task = asyncio.create_task(self._run(), name="reply-router")

    async def stop(self) -> None:
        await stop_tasks(self._task)

    def expect(self, request_id: str, num_items: int) -> asyncio.Future:
        """Register before enqueueing, so a fast reply cannot be missed. The future's result:
        the results (index -> raw result) when the notice carried them, else None (collect)."""
        fut = (self._loop or asyncio.get_running_loop()).create_future()
        self._waiting[request_id] = _Waiter(fut, num_items)
        return fut

    def enqueued(self, request_id: str) -> None:
        waiter = self._waiting.get(request_id)
        if waiter is not None:
            waiter.enqueued_at = time.monotonic()

    def forget(self, request_id: str) -> None:
        waiter = self._waiting.pop(request_id, None)
        if waiter is not None and waiter.future.done() and not waiter.future.cancelled():
            # Failed before its call awaited it: mark the exception seen, or asyncio logs
            # "exception was never retrieved".
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

    def _channels_down(self, channels: list[str], exc: BaseException) -> None:
        """Those channels' notices will not come: fail the calls waiting on their shards (all
        calls without ``shard_of``). A call not yet given a shard is left to its enqueue."""
        self.subscribed.clear()
        error = Unavailable(f"lost the connection to Redis while waiting: {exc}")
        if self._shard_of is None:
            self._fail_all(error)
            return
        lost = {i for i, channel in enumerate(self.channels) if channel in channels}
        for request_id in list(self._waiting):
            if self._shard_of(request_id) in lost:
                self._settle(request_id, error)

    def _channels_up(self, channels: list[str]) -> None:
        self._repoll.set()  # notices published before are lost: check everyone
        if self._subscriber is not None and not self._subscriber.down:
            self.subscribed.set()

    def _on_notice(self, channel: bytes, data: bytes) -> None:
        """A notice, handed over by the subscriber's reader as it is read."""
        for request_id, results in parse_notices(data):
            self._settle(request_id, results=results)

    async def _run(self) -> None:
        # Notices settle their calls as they are read (_on_notice); this task subscribes, and
        # polls: every poll_every_s, and at once after a (re)subscribe.
        self._subscriber = subscriber = ShardedSubscriber(
            self._pubsub_client, on_down=self._channels_down, on_up=self._channels_up,
            on_message=self._on_notice, label="reply notices")
        while True:
            try:
                await subscriber.subscribe(*self.channels)  # never raises for Redis down
                next_poll = time.monotonic() + self._poll_every_s
                while True:
                    raise_if_cancelled()
                    if self._repoll.is_set():  # (re)subscribed: what was published before is lost
                        self._repoll.clear()
                        await self._poll(min_age_s=0.0)
                        next_poll = time.monotonic() + self._poll_every_s
                    elif time.monotonic() >= next_poll:
                        await self._poll(min_age_s=self._poll_after_s)
                        next_poll = time.monotonic() + self._poll_every_s
                    try:
                        async with asyncio.timeout(max(0.0, next_poll - time.monotonic())):
                            await self._repoll.wait()
                    except TimeoutError:
                        pass
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: never die silently
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
