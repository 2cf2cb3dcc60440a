"""Stopping background tasks for good.

On Python 3.11, ``asyncio.wait_for`` returns the awaited result when a cancel lands just as that
result arrives, and the cancel is lost (CPython gh-86296, fixed in 3.12 by rebuilding wait_for on
``asyncio.timeout``). redis-py sends every command through ``wait_for`` when the client has a
socket timeout (tokq's clients do: tokq.redis.connection), so cancelling a task that is running a
Redis command is dropped often (measured on loopback: about a quarter of cancels at a random
point of a GET). A background loop (``while True: await redis ...; await asyncio.sleep(...)``)
then carries on, and whoever awaits its end waits forever: a worker told to stop hung in its
shutdown this way. Cancelling again does not cure it: under load a canceller woken by a timer
kept landing in the same phase of the loop's command, 100-190 cancels in a row were dropped
(measured, cancelling every 50 ms). What a dropped cancel leaves behind is the task's cancel
request (``Task.cancelling()`` > 0, nothing has uncancelled it), so:

- ``raise_if_cancelled`` is called by every background loop after its Redis calls: a dropped
  cancel ends the loop there (then every loop measured ended on the first cancel);
- ``cancel_and_wait`` is how shutdown paths stop such loops: it cancels, waits a grace that lets
  an ordinary clean-up (a lock released, a connection closed) finish undisturbed, then cancels
  again until the task has ended (for a loop that had no check to pass yet).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable


def raise_if_cancelled() -> None:
    """Raise CancelledError in a task whose cancel request is pending but was not raised (a
    dropped cancel, see the module doc). Call it where a loop has just returned from Redis: a
    delivered cancel would have raised already, so only a dropped one is found here."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


GRACE_S = 0.5  # after the first cancel: a task still running by then dropped it, or is slow
RECANCEL_S = 0.05  # then cancelled again this often


async def cancel_and_wait(tasks: asyncio.Task | Iterable[asyncio.Task | None] | None,
                          timeout_s: float | None = None) -> bool:
    """Cancel ``tasks`` (None entries skipped) and wait until each has ended, cancelling again
    every RECANCEL_S once GRACE_S has passed (a dropped cancel). Their own exceptions are taken
    (not raised, not logged as never retrieved). Returns False if ``timeout_s`` passed first.
    Cancelled itself, it cancels the tasks still running once more and lets the cancel through."""
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
