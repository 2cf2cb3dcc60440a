"""A TCP proxy in front of a real Redis that loses answers on purpose: told to cut a command, it
lets the command run, drops Redis's answer and closes the client's connection, as a failover or
CLIENT KILL would. Commands are recognised by bytes, such as a script's SHA1 (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import threading
from urllib.parse import urlparse

from tokq.queue.scripts import script_source


def script_sha(name: str) -> bytes:
    """The SHA1 redis-py sends in EVALSHA for one of tokq's scripts."""
    return hashlib.sha1(script_source(name).encode()).hexdigest().encode()


class FaultProxy:
    def __init__(self, upstream_url: str, *, seed: int = 0) -> None:
        parsed = urlparse(upstream_url)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 6379)
        self._parsed = parsed  # the proxy's URL keeps its scheme, credentials and database
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy",
                                        daemon=True)
        self._lock = threading.Lock()
        self._cut_next: list[bytes] = []  # cut the next command holding each of these
        self._hold_next: list[bytes] = []  # withhold answers from the next command holding these
        self._rate, self._rate_match = 0.0, (b"",)  # and this fraction of those holding one of these
        self._rng = random.Random(seed)
        self._stalled = False  # withhold every answer, connections left open
        self._resumed: asyncio.Event | None = None  # cleared: answers wait (pause)
        self._server: asyncio.base_events.Server | None = None
        # Open connections (by their handler task): the first 64 KiB each client sent.
        self._connections: dict[asyncio.Task, bytearray] = {}
        self.port = 0
        self.cuts = 0  # answers dropped so far

    @property
    def url(self) -> str:
        credentials = self._parsed.netloc.rpartition("@")[0]
        netloc = f"{credentials}@127.0.0.1:{self.port}" if credentials else f"127.0.0.1:{self.port}"
        return self._parsed._replace(netloc=netloc).geturl()

    def start(self) -> FaultProxy:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    def close(self) -> None:
        if self._loop.is_closed():  # closed already
            return

        async def shutdown():
            if self._server is not None:
                self._server.close()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    # -- what to cut --------------------------------------------------------------------------

    def cut_next(self, match: bytes = b"EVALSHA", times: int = 1) -> None:
        """Lose the answer of the next ``times`` commands whose bytes contain ``match``."""
        with self._lock:
            self._cut_next += [match] * times

    def cut_rate(self, fraction: float, match: bytes | tuple[bytes, ...] = b"EVALSHA") -> None:
        """Lose the answer of this fraction of the commands containing ``match`` (or any of
        them; 0 = none)."""
        with self._lock:
            self._rate = fraction
            self._rate_match = match if isinstance(match, tuple) else (match,)

    def hold_next(self, match: bytes) -> None:
        """Withhold the answers on the connection of the next command whose bytes contain
        ``match``, from that command's on, the connection left open: the command runs, its
        answer never comes (what a client's socket timeout is for). Other connections answer."""
        with self._lock:
            self._hold_next.append(match)

    def stall(self, stalled: bool = True) -> None:
        """Withhold every answer while ``stalled``, connections left open: a Redis gone silent
        (what a client's socket timeout is for). The withheld answers are lost."""
        with self._lock:
            self._stalled = stalled

    def pause(self, paused: bool = True) -> None:
        """Delay every answer while ``paused``, connections left open; unpaused, the withheld
        answers arrive, in order (a Redis slow to answer, where ``stall`` is one gone silent)."""
        async def flip():
            (self._resumed.clear if paused else self._resumed.set)()
        asyncio.run_coroutine_threadsafe(flip(), self._loop).result(10)

    def reset(self) -> None:
        with self._lock:
            self._cut_next.clear()
            self._hold_next.clear()
            self._rate = 0.0
            self._stalled = False
        self.pause(False)

    def connections(self, match: bytes) -> int:
        """Open connections whose client has sent ``match`` (e.g. b"SUBSCRIBE")."""
        async def count():
            return sum(match in sent for sent in self._connections.values())
        return asyncio.run_coroutine_threadsafe(count(), self._loop).result(10)

    def drop_connections(self, match: bytes) -> int:
        """Reset every open connection whose client has sent ``match`` (e.g. b"SSUBSCRIBE": a
        subscriber's link), as a network reset would; Redis sees it close. Returns how many."""
        async def drop():
            dropped = [task for task, sent in self._connections.items() if match in sent]
            for task in dropped:
                task.cancel()
            await asyncio.gather(*dropped, return_exceptions=True)
            return len(dropped)
        return asyncio.run_coroutine_threadsafe(drop(), self._loop).result(10)

    def _should_hold(self, data: bytes) -> bool:
        with self._lock:
            for i, match in enumerate(self._hold_next):
                if match in data:
                    del self._hold_next[i]
                    return True
        return False

    def _should_cut(self, data: bytes) -> bool:
        with self._lock:
            for i, match in enumerate(self._cut_next):
                if match in data:
                    del self._cut_next[i]
                    self.cuts += 1
                    return True
            if self._rate and any(m in data for m in self._rate_match):
                if self._rng.random() < self._rate:
                    self.cuts += 1
                    return True
        return False

    # -- forwarding ---------------------------------------------------------------------------

    async def _serve(self) -> int:
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self._upstream)
        except OSError:  # Redis down: the client sees its connection closed
            client_w.close()
            return
        drop_answer = asyncio.Event()
        hold_answers = asyncio.Event()
        sent = self._connections[asyncio.current_task()] = bytearray()

        async def to_redis():
            while data := await client_r.read(65536):
                if len(sent) < 65536:
                    sent.extend(data[:65536 - len(sent)])
                if self._should_cut(data):
                    drop_answer.set()  # before the command leaves, so its answer is caught
                if self._should_hold(data):
                    hold_answers.set()
                upstream_w.write(data)
                await upstream_w.drain()

        async def to_client():
            while data := await upstream_r.read(65536):
                await self._resumed.wait()
                if drop_answer.is_set():
                    return  # the command ran (Redis answered); the answer is lost
                if self._stalled or hold_answers.is_set():
                    continue
                client_w.write(data)
                await client_w.drain()

        tasks = [asyncio.create_task(to_redis()), asyncio.create_task(to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._connections.pop(asyncio.current_task(), None)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for writer in (client_w, upstream_w):
                writer.close()
