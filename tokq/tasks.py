"""Stopping background asyncio tasks for good.

On Python 3.11 a ``Task.cancel()`` landing inside redis-py's ``wait_for`` can be dropped, so loops
check for a pending stop after Redis calls and shutdown asks again until tasks end (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable


def raise_if_cancelled() -> None:
    """Raise CancelledError in a task asked to stop whose stop was dropped. Call it where a loop
    has just returned from Redis: a delivered stop would have raised already."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


GRACE_S = 0.5  # after the first ask: a task still running by then dropped it, or is slow
RECANCEL_S = 0.05  # then asked again this often


async def stop_tasks(tasks: asyncio.Task | Iterable[asyncio.Task | None] | None,
                     timeout_s: float | None = None) -> bool:
    """Stop ``tasks`` (None skipped) and wait until each has ended, asking again every RECANCEL_S
    after GRACE_S; their exceptions are taken, not raised. False if ``timeout_s`` passed first.
    Stopped itself, it asks the running tasks once more and lets its own stop through."""
    if isinstance(tasks, asyncio.Task):
        tasks = [tasks]
    tasks = [t for t in tasks or () if t is not None]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = {t for t in tasks if not t.done()}
    wait_s = GRACE_S
    try:
        while pending:
            for task in pending:
                task.cancel()
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    break
            _, pending = await asyncio.wait(pending, timeout=wait_s)
            wait_s = RECANCEL_S
    except asyncio.CancelledError:
        for task in pending:
            task.cancel()
        raise
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()
    return not pending
