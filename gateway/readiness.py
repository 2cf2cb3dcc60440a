"""Whether this gateway can answer now: Redis reachable and a live worker for every model it
serves. gRPC health and HTTP /ready report the last check, so a load balancer stops sending
calls that could only wait out their deadline."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from tokq.tasks import stop_tasks, raise_if_cancelled
from tokq.queue.keys import QueueKeys

log = logging.getLogger(__name__)


class SiblingProcesses:
    """The processes of one `tokq gateway --procs N` that listen on the shared port so far. Each
    reports ready only once all N do: SO_REUSEPORT hands an early connection, for its whole life,
    to the processes listening then."""

    def __init__(self, counter, procs: int) -> None:
        self._counter = counter  # multiprocessing.Value("i"), made by the parent
        self.procs = procs
        self._all = False  # once all listen, the shared count (and its lock) is not read again

    def add(self) -> None:
        with self._counter.get_lock():
            self._counter.value += 1

    def missing(self) -> str | None:
        """Why not ready yet (None: all N listen)."""
        if self._all:
            return None
        n = self._counter.value
        self._all = n >= self.procs
        return None if self._all else f"{n} of {self.procs} gateway processes listening"


class Readiness:
    def __init__(self, client, keys: Mapping[str, QueueKeys], period_s: float = 1.0,
                 on_change: Callable[[bool], Awaitable[None]] | None = None,
                 siblings: SiblingProcesses | None = None) -> None:
        self._client = client
        self._siblings = siblings
        self._keys = dict(keys)  # served model name -> its queue's keys
        self.period_s = period_s
        self._on_change = on_change
        self.ready = False
        self.reason = "not checked yet"
        self._detail_logged = False  # this outage's cause: logged once, until Redis answers again
        self._task: asyncio.Task | None = None

    async def _live_workers(self, keys: QueueKeys) -> int:
        members = await self._client.zrange(keys.workers, 0, -1)
        if not members:
            return 0
        # Heartbeat keys expire 3 periods after a worker's last beat; the set keeps dead ones a while.
        return int(await self._client.exists(*(keys.heartbeat(m.decode()) for m in members)))

    async def _probe(self) -> tuple[bool, str]:
        if self._siblings and (waiting := self._siblings.missing()):
            return False, waiting
        try:
            await self._client.ping()
            for name, keys in self._keys.items():
                if not await self._live_workers(keys):
                    self._detail_logged = False  # Redis answered every question: the outage is over
                    return False, f"no live worker serves model {name!r}"
        except Exception as exc:  # any failure to ask Redis is "Redis unreachable"
            # The detail (Redis's address) goes to the log only, once per outage: /ready answers
            # anyone.
            if not self._detail_logged:
                self._detail_logged = True
                log.warning("readiness: Redis unreachable: %s: %s", type(exc).__name__, exc)
            return False, f"Redis unreachable ({type(exc).__name__})"
        self._detail_logged = False
        return True, "ready"

    async def check(self) -> bool:
        try:
            ready, reason = await asyncio.wait_for(self._probe(), timeout=max(1.0, 2 * self.period_s))
        except TimeoutError:
            ready, reason = False, "Redis did not answer the readiness check in time"
        changed = ready != self.ready
        self.ready, self.reason = ready, reason
        if changed:
            log.info("readiness: %s (%s)", "SERVING" if ready else "NOT_SERVING", reason)
            if self._on_change:
                await self._on_change(ready)
        return ready

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self.check()
            raise_if_cancelled()

    async def start(self) -> None:
        await self.check()
        if self._on_change and not self.ready:  # report the first answer even if unchanged
            await self._on_change(False)
        self._task = asyncio.create_task(self._run(), name="readiness")

    async def stop(self) -> None:
        await stop_tasks(self._task)
