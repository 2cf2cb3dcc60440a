"""Script runs started while one is in flight, sent to Redis together as one pipeline.

Under load a gateway starts many enqueues at nearly the same time, one per call. Each on its own
costs a write, a read and a wake-up of the event loop, in the gateway and in Redis, and redis-py's
~100 us of Python around each command. Here a run goes at once when none is in flight (so a lone
call waits for nothing); the runs started while one is in flight wait for it and then go
together, as one pipeline of EVALSHA commands (one write, one read), and so on: under load every
round trip carries what arrived during the last one. Each caller gets its own command's answer or
error, exactly as if it had run alone. Every round trip, a lone run's too, is a task of its own:
a caller cancelled while its command is out returns once that command has answered, so its
clean-up (the gateway's cancel script, on another connection) cannot overtake it and leave a
reply behind. With ``hold_s`` set (the gateway sets it), a run that starts within ``hold_s`` of
the last round trip's start (calls are arriving faster than that) is held up to ``hold_s`` for
the runs right behind it: a burst of calls (a batch's callers all answered at once send their
next calls together) goes in a few round trips instead of one or two runs each, while a call
arriving on its own still goes at once.

Failures keep each script's meaning: a command's own error (-BUSY, -READONLY; QUEUE_FULL is an
answer, not an error) goes to its caller only; a script Redis does not know (restart, SCRIPT
FLUSH) is run again alone through ``Scripts``, which loads it; a lost connection is retried by
redis-py as for one command (tokq.redis.connection) and then fails every caller of the pipeline, each
of whose scripts is safe to run twice (tokq.queue.shard). One pipeliner serves one queue shard, which
is one hash slot, so one node: a shard whose node fails over holds up no other shard's calls.

On a standalone Redis the round trips go over one connection the pipeliner takes from the
client's pool when a run starts and gives back once nothing has been sent for ``RELEASE_AFTER_S``
(so it holds one connection at most, and only while busy or just after): one round trip is in
flight at a time, so while busy it needs no pool checkout per round trip (~25 us each, and under load a
round trip follows the last within milliseconds), and redis-py's per-command machinery (a Task
for each timed send, a timeout per reply read) is paid once per round trip as one
``asyncio.timeout`` (the client's socket timeout) around the whole exchange. Its EVALSHA
commands are packed by hiredis (``pack_command``), not by redis-py's Python packing, which costs
~4x as much for an enqueue's ~20 arguments. On Redis Cluster the runs go through the cluster client's
pipeline, which follows MOVED and failovers.

The redis-py internals this module relies on are listed in tokq/redis/__init__.py, with the
versions tested.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
import redis.exceptions

from tokq.queue.scripts import Scripts

# An idle pipeliner gives its connection back to the pool after this long without a round trip.
RELEASE_AFTER_S = 0.05


def pack_command(*args: Any) -> bytes:
    """One command in the Redis protocol (RESP), packed by hiredis (C, ~3 us for an enqueue's ~20
    arguments against ~8 in Python), its arguments encoded as redis-py's encoder does with its
    default UTF-8: bytes as they are, str as UTF-8, int and float as their decimal text (what
    the queue's scripts are given); a bool, None, bytearray or other type is a DataError. (hiredis
    also takes a memoryview, reading its buffer: a strided one would be misread, so none is
    passed.)"""
    try:
        return hiredis.pack_command(args)
    except TypeError as exc:
        bad = next((a for a in args if type(a) not in (bytes, str, int, float, memoryview)), None)
        raise redis.exceptions.DataError(f"cannot send {type(bad).__name__} {bad!r} to Redis: {exc}") from None


class _Run:
    __slots__ = ("name", "keys", "args", "future", "sent")

    def __init__(self, name: str, keys: Sequence[str], args: Sequence[Any], future: asyncio.Future | None) -> None:
        self.name = name
        self.keys = keys
        self.args = args
        self.future = future
        self.sent: asyncio.Task | None = None  # the pipeline carrying it, once it left


class ScriptPipeliner:
    """Runs ``scripts`` (registered on ``client``) with ``run``; see the module doc. ``observe``,
    if set, is called with the number of runs each round trip carries (metrics)."""

    def __init__(self, client, scripts: Scripts, observe: Callable[[int], None] | None = None,
                 hold_s: float = 0.0) -> None:
        self.observe = observe
        self.hold_s = hold_s
        self._last_start = float("-inf")  # loop time the last round trip started
        self._client = client
        self._scripts = scripts
        self._waiting: list[_Run] = []
        self._in_flight = False
        # Standalone: the connection every round trip uses (see the module doc), once taken.
        self._direct = isinstance(client, aioredis.Redis)
        self._conn = None
        self._idle_since = 0.0  # loop time the last round trip ended with nothing left to send
        self._release_timer: asyncio.TimerHandle | None = None
        self._releases: set[asyncio.Task] = set()
        self._sending: asyncio.Task | None = None  # the round trip in flight, if any
        # The loop its connection is bound to, taken at the first run: asking asyncio for the
        # running loop costs a getpid() system call each time on CPython 3.11 (its fork check),
        # four times per run here.
        self._loop: asyncio.AbstractEventLoop | None = None
        # What was sent: runs and round trips (tests and benchmarks read them).
        self.commands = 0
        self.pipelines = 0

    async def run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        loop = self._loop or self._bind_loop()
        item = _Run(name, keys, args, loop.create_future())
        self._waiting.append(item)
        if not self._in_flight:
            self._in_flight = True
            if self.hold_s and loop.time() - self._last_start < self.hold_s:
                loop.call_at(self._last_start + self.hold_s, self._next)  # sends what is waiting then
            else:
                self._next()  # alone, at once
        try:
            return await item.future
        except asyncio.CancelledError:
            if item.sent is not None:
                # It may run in Redis yet: the caller's clean-up (a cancel script) must not
                # overtake it on another connection, so give back control once it answered.
                await asyncio.wait([item.sent])
            else:  # never sent: it will not be
                self._waiting.remove(item)
            raise

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    def _linger(self) -> None:
        """Idle: give the held connection (if any) back after RELEASE_AFTER_S more of it."""
        if self._conn is not None:
            loop = self._loop
            self._idle_since = loop.time()
            if self._release_timer is None:  # one timer per RELEASE_AFTER_S, not per round trip
                self._release_timer = loop.call_later(RELEASE_AFTER_S, self._release_if_idle)

    def _release_if_idle(self) -> None:
        self._release_timer = None
        if self._in_flight or self._conn is None:  # busy again: the next idle spell rearms it
            return
        loop = self._loop
        left = self._idle_since + RELEASE_AFTER_S - loop.time()
        if left > 0:  # a round trip came and went meanwhile
            self._release_timer = loop.call_later(left, self._release_if_idle)
            return
        task = loop.create_task(self._give_back())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def aclose(self) -> None:
        """Give the held connection back now (the owner is closing), once the round trips in
        flight have answered: their replies are read on that connection."""
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        while self._sending is not None and not self._sending.done():
            await asyncio.wait([self._sending])
        await self._give_back()

    async def _give_back(self) -> None:
        """Return the held connection (if any) to the pool, its own timeout restored."""
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.socket_timeout = self._timeout_s
            await self._client.connection_pool.release(conn)

    async def _round_trip(self, runs: list[_Run], packed: bytes) -> list[Any]:
        """Send the runs (``packed``: their commands) as one write on the held connection, read
        their replies (a command's error as its reply); a lost connection is retried as the
        client retries a command."""
        if self._conn is None:
            self._conn = await self._client.connection_pool.get_connection()
            # Reads and writes are bounded by the timeout around the round trip instead (and
            # the connection's own is put back before the pool gets it back).
            self._timeout_s = self._conn.socket_timeout
            self._conn.socket_timeout = None
        conn = self._conn

        async def exchange() -> list[Any]:
            try:
                async with asyncio.timeout(self._timeout_s):
                    await conn.send_packed_command(packed, check_health=False)
                    replies = []
                    for _ in runs:
                        try:
                            replies.append(await conn.read_response())
                        except redis.exceptions.ResponseError as exc:
                            replies.append(exc)
                    return replies
            except TimeoutError:
                await conn.disconnect(nowait=True)
                raise redis.exceptions.TimeoutError("Timeout talking to Redis") from None
            except BaseException:  # a reply may be left unread: never reuse the connection as is
                await conn.disconnect(nowait=True)
                raise

        return await conn.retry.call_with_retry(exchange, lambda error: conn.disconnect())

    def _count(self, n: int) -> None:
        self.commands += n
        self.pipelines += 1
        if self.observe is not None:
            self.observe(n)

    def _next(self) -> None:
        """The round trip in flight is over: send what arrived meanwhile, if anything."""
        runs, self._waiting = self._waiting, []
        if not runs:
            self._in_flight = False
            self._linger()
            return
        self._count(len(runs))
        if self.hold_s:
            self._last_start = self._loop.time()
        # Its own task: one caller cancelled must not cut the pipeline the others wait on.
        task = self._sending = self._loop.create_task(self._send(runs))
        for r in runs:
            r.sent = task

    async def _send(self, runs: list[_Run]) -> None:
        try:
            await self._pipeline(runs)
        finally:
            self._next()

    def _evalsha(self, r: _Run) -> tuple:
        return ("EVALSHA", self._scripts.sha(r.name), len(r.keys), *r.keys, *r.args)

    async def _pipeline(self, runs: list[_Run]) -> None:
        if len(runs) == 1 and not self._direct:  # the cluster client's own path: no pipeline
            return await self._run_alone(runs[0])
        try:
            if self._direct:
                packed = []
                for r in list(runs):
                    try:
                        packed.append(pack_command(*self._evalsha(r)))
                    except (redis.exceptions.DataError, UnicodeEncodeError) as exc:  # its own arguments
                        _settle(r, exc=exc)
                        runs.remove(r)
                self._scripts.calls.update(r.name for r in runs)
                replies = await self._round_trip(runs, b"".join(packed)) if runs else []
            else:
                self._scripts.calls.update(r.name for r in runs)
                async with self._client.pipeline(transaction=False) as pipe:
                    for r in runs:
                        pipe.execute_command(*self._evalsha(r))
                    replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # a lost connection (after redis-py's retries): every run shares it
            for r in runs:
                _settle(r, exc=exc)
            return
        except BaseException:  # cancelled (the loop is shutting down): nobody waits in vain
            for r in runs:
                r.future.cancel()
            raise
        unknown = []
        for r, reply in zip(runs, replies):
            if isinstance(reply, redis.exceptions.NoScriptError):
                unknown.append(r)
            elif isinstance(reply, Exception):
                _settle(r, exc=reply)
            else:
                _settle(r, reply)
        # Redis lost its scripts (restart, SCRIPT FLUSH): each runs again alone, loading it, in
        # this task, so the round trip is over only once they answered (rare: one by one).
        if unknown:
            if self._direct:
                await self._give_back()
            for r in unknown:
                await self._run_alone(r)

    async def _run_alone(self, r: _Run) -> None:
        """Through ``Scripts`` (which loads a script Redis does not know) and the client's own
        retries."""
        try:
            _settle(r, await self._scripts.run(r.name, r.keys, r.args))
        except Exception as exc:
            _settle(r, exc=exc)
        except BaseException:  # cancelled (the loop is shutting down): nobody waits in vain
            r.future.cancel()
            raise


def _settle(r: _Run, result: Any = None, exc: Exception | None = None) -> None:
    if r.future.done():  # its caller was cancelled
        return
    if exc is None:
        r.future.set_result(result)
    else:
        r.future.set_exception(exc)
