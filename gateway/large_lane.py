"""The large-request lane: its own threads, at a lower CPU priority, paced while light calls are
being served so large requests take at most ``share`` of the lane's time (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tokq.gateway.helper_threads import batch_this_thread

T = TypeVar("T")

# How much lower the lane's threads run (``_yield_cpu``): nice 10 has ~1/10 the CPU weight of
# nice 0 when cores are contended, and everything when they are not.
LARGE_NICE = 10

# Light calls this recent count as "being served": a search backend's calls come every few
# tens of milliseconds when it sends any.
LIGHT_RECENT_S = 0.1


def _yield_cpu() -> None:
    """Lowers the calling thread's CPU priority (nice is per thread on Linux) by ``LARGE_NICE`` and
    makes it a batch thread, so contended cores serve light calls and forwards first."""
    batch_this_thread()
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + LARGE_NICE)
    except (AttributeError, OSError):  # not Linux: the lanes still keep large requests apart
        pass


class LargeLane:
    def __init__(self, threads: int, share: float) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize-large",
                                       initializer=_yield_cpu)
        self._slots = asyncio.Semaphore(threads)
        self._rest_per_s = (1 - share) / share  # seconds a slot rests per second of a turn
        self._last_light = float("-inf")

    def light_seen(self) -> None:
        """A light call is being served now (called per light call: one clock read)."""
        self._last_light = time.monotonic()

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on one of the lane's threads, in its turn."""
        await self._slots.acquire()
        start = time.monotonic()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn)
        finally:
            self._release(start)

    def _release(self, start: float) -> None:
        now = time.monotonic()
        if self._rest_per_s and now - self._last_light < LIGHT_RECENT_S:
            asyncio.get_running_loop().call_later((now - start) * self._rest_per_s,
                                                  self._slots.release)
        else:
            self._slots.release()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
