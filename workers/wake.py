"""How a worker hears of work without polling: pub/sub wake-ups on its shards' channels.

An idle worker registers as idle and waits on its worker channel, where enqueue and requeue wake
one idle worker when the queue stops being empty (and a claim that leaves work wakes the next,
so a burst spreads); the queue's work channel gets the wake-up when no worker is registered. It
claims at least every IDLE_FALLBACK_S in case a wake-up was missed. A worker running a heavy
forward registers as pre-emptible instead: light work arriving tells it 'light'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from tokq.queue.sharded import ShardedQueue
from tokq.redis.pubsub import ShardedSubscriber
from tokq.tasks import stop_tasks, raise_if_cancelled
from tokq.workers.chores import REDIS_ERRORS, OutageLog

log = logging.getLogger("tokq.worker")

# An idle worker waits for a work wake-up, but claims at least this often: a missed wake-up
# (a reconnect) costs at most this long.
IDLE_FALLBACK_S = 0.5


class Registration:
    """The worker's place in one kind of wake-up set on every shard it claims from: ``idle`` (a
    'work' wake-up may pick it) or ``preemptible`` (a 'light' one may, while a heavy forward
    runs). A wake-up pops it out of that one shard's set only (lua/lib/wake.lua): with several
    shards it may stay in the others' (so may a registration whose answer was lost) until it
    withdraws; else, busy, it would take those shards' wake-ups from the workers waiting."""

    def __init__(self, queue: ShardedQueue, kind: str) -> None:
        self.queue = queue
        self.kind = kind
        self.registered = False  # in every claimed shard's set, as far as this worker knows
        self.maybe = False  # possibly in some shard's set: withdraw before that matters
        self.wakeups = 0  # wake-ups of this kind read (WakeUps.read)
        self._outage = OutageLog(f"{kind} registration")

    def woken(self) -> None:
        """A wake-up of this kind was read: the shard that sent it holds this worker no more."""
        self.registered = False
        self.maybe = self.maybe and self.queue.claim_shards > 1
        self.wakeups += 1

    async def set(self, on: bool) -> bool:
        """Register (``on``) or withdraw; True if a wake-up was read meanwhile."""
        read, was_maybe = self.wakeups, self.maybe
        try:
            await getattr(self.queue.consumer, f"mark_{self.kind}")(on)
            # A wake-up read meanwhile took this worker out of a set: not registered. (Believing
            # itself registered, it would hear no more wake-ups: enqueue.lua tells only the
            # workers in the set.) It may be in a set still: another shard's, or this one's if
            # the wake-up popped an earlier registration whose answer was lost and this one
            # landed after it.
            self.registered = on and self.wakeups == read
            self.maybe = on and (self.registered or was_maybe or self.queue.claim_shards > 1)
            self._outage.worked()
        except REDIS_ERRORS as exc:
            # Not registered, or registered with its answer lost: taken for maybe registered,
            # withdrawn later (idle: before the forward; pre-emptible: as the forward ends).
            # Meanwhile work waits for a claim. With one shard's node down this fails at every
            # wait (the other shards' sets are still written): logged once per outage.
            self._outage.failed(exc)
            self.maybe = self.maybe or on
        return self.wakeups != read


class WakeUps:
    """The worker's subscription to its shards' work and worker channels, read by one task
    (``start_reading``), and its registrations. ``healthy()``: False once the worker gave up
    (it then stays off its worker channels)."""

    def __init__(self, queue: ShardedQueue, *, healthy: Callable[[], bool]) -> None:
        self.queue = queue
        self.healthy = healthy
        self._subscriber = ShardedSubscriber(queue.redis, label="wake-ups")
        self._subscribed = False
        self.idle = Registration(queue, "idle")  # withdrawn before each forward
        self.preemptible = Registration(queue, "preemptible")  # while a heavy forward runs
        self._reader: asyncio.Task | None = None  # read(), the subscription's one reader
        self._woken = asyncio.Event()  # a wake-up came (set by read() only)
        self.light_wakeup = asyncio.Event()  # a 'light' wake-up came

    async def subscribe(self) -> None:
        try:
            # Every shard's work channel, and this process's worker channels: while it lives,
            # they tell requeue not to take its leases early (tokq.queue.shard.Queue.worker_channel).
            # A node that cannot be reached costs only its shards' channels, which the
            # subscriber subscribes again in the background (tokq.redis.pubsub); claims still
            # happen every IDLE_FALLBACK_S meanwhile.
            consumer = self.queue.consumer
            await self._subscriber.subscribe(*consumer.work_channels(), *consumer.worker_channels())
            self._subscribed = True
        except REDIS_ERRORS as exc:
            log.warning("wake-up subscription failed: %s", exc)
            self._subscribed = False

    async def follow_shard_count(self) -> None:
        """Gateways may have raised (or lowered) the shard count: claim from the shards in use,
        listen for work on them, and register on them at the next wait (else their work wakes
        every idle worker)."""
        before = self.queue.claim_shards
        if await self.queue.refresh_shard_count() != before:
            self._subscribed = False
            self.idle.registered = False

    def start_reading(self) -> asyncio.Task:
        self._reader = asyncio.create_task(self._read())
        return self._reader

    async def _read(self) -> None:
        """The one reader of the subscription, busy or idle: a wake-up wakes the idle wait, a
        'light' one also the pre-empting claim of a heavy forward."""
        while self.healthy():  # a worker that gave up stays off its worker channels
            raise_if_cancelled()
            if not self._subscribed:
                await self.subscribe()
                if not self._subscribed:
                    await asyncio.sleep(IDLE_FALLBACK_S)
                    continue
            try:
                message = await self._subscriber.get_message(timeout=IDLE_FALLBACK_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a lost or closed subscription: subscribe again
                log.warning("wake-up subscription lost: %s", exc)
                self._subscribed = False
                continue
            if message is None:
                continue
            # Picked out of the idle or pre-emptible set (lua/lib/wake.lua): it registers
            # again before its next wait.
            if message[1] == b"work":
                self.idle.woken()
            elif message[1] == b"light":
                self.preemptible.woken()
                self.light_wakeup.set()
            self._woken.set()

    async def wait_for_work(self) -> None:
        """Until a wake-up arrives or IDLE_FALLBACK_S pass. Wake-ups that came while busy are
        taken at once: one claim answers all of them."""
        if not self.idle.registered:
            await self.idle.set(True)
        if not self._woken.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), timeout=IDLE_FALLBACK_S)
        self._woken.clear()

    async def stop_reading(self) -> None:
        """No read may be in flight on a connection closed under it: the reader ends first."""
        if self._reader is not None:
            await stop_tasks(self._reader)

    async def close(self) -> None:
        """The subscription closed: this process's worker channels go (its leases are redone
        sooner once nobody listens)."""
        await self._subscriber.aclose()
