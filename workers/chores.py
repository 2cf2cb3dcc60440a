"""What a worker runs beside its loop, again and again (renewals, requeues, heartbeats, budget
reads), and how it takes Redis failures: wait and retry, never exit; a failure that recurs is
logged once per outage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.exceptions

from tokq.tasks import raise_if_cancelled

log = logging.getLogger("tokq.worker")

REDIS_RETRY_S = 0.2
# Any Redis failure, -READONLY after a failover or -OOM included: wait and retry, never exit.
REDIS_ERRORS = (redis.exceptions.RedisError, OSError)


class OutageLog:
    """A failure that recurs while it lasts, logged once, and once more when it works again:
    with one shard's node out, a chore fails at every round for as long as the node is out."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failing = False

    def failed(self, exc: BaseException) -> None:
        if not self.failing:
            log.warning("%s failed: %s (not logged again until it works)", self.what, exc)
        self.failing = True

    def worked(self) -> None:
        if self.failing:
            self.failing = False
            log.warning("%s works again", self.what)


async def every(period_s: float | Callable[[], float], chore: Callable[[], Awaitable[object]]) -> None:
    """``chore`` again and again, ``period_s`` apart (a callable: asked after each round); its
    failures logged once per outage, under its name."""
    outage = OutageLog(chore.__name__)
    while True:
        try:
            await chore()
            outage.worked()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis blips must not kill the worker
            outage.failed(exc)
        raise_if_cancelled()
        await asyncio.sleep(period_s() if callable(period_s) else period_s)
