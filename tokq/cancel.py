"""Stopping background tasks for good.

On Python 3.11, ``asyncio.wait_for`` returns the awaited result when a cancel lands just as that
result arrives, and the cancel is lost (CPython gh-86296, fixed in 3.12 by rebuilding wait_for on
``asyncio.timeout``). redis-py awaits every reply through ``wait_for``, so cancelling a task
that is running a Redis command is dropped about a quarter of the time (measured on loopback:
a cancel at a random point of a GET). A background loop (``while True: await redis ...;
await asyncio.sleep(...)``) then carries on, and whoever awaits its end waits forever: a
worker told to stop hung in its shutdown this way. So shutdown paths cancel again until the
task has ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

RECANCEL_S = 0.05  # how long a cancelled task gets before it is cancelled again


async def cancel_and_wait(tasks: asyncio.Task | Iterable[asyncio.Task | None] | None,
                          timeout_s: float | None = None) -> bool:
    """Cancel ``tasks`` (None entries skipped) and wait until each has ended, cancelling again
    every RECANCEL_S while one has not (a dropped cancel). Their own exceptions are taken
    (not raised, not logged as never retrieved). Returns False if ``timeout_s`` passed first."""
    if isinstance(tasks, asyncio.Task):
        tasks = [tasks]
    tasks = [t for t in tasks or () if t is not None]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        wait_s = RECANCEL_S if deadline is None else min(RECANCEL_S, deadline - time.monotonic())
        if wait_s <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=wait_s)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()
    return not pending
