"""The gateway's helper threads yield to its event loop's thread (Linux: SCHED_BATCH), so gRPC's
wake-ups do not preempt the loop; a no-op where the policy cannot be set (docs/internals.md).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("tokq.gateway")


def _set_batch(tid: int) -> bool:
    try:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        return True
    except OSError as exc:  # ended meanwhile; EPERM/EINVAL from a sandbox
        log.debug("thread %d keeps its scheduling policy: %s", tid, exc)
        return False


def batch_this_thread() -> None:
    """The calling thread to SCHED_BATCH: for the gateway's own pools (a ThreadPoolExecutor's
    ``initializer``), whose threads may start after ``yield_to_loop_thread`` ran."""
    if hasattr(os, "SCHED_BATCH"):
        _set_batch(0)


def yield_to_loop_thread() -> int:
    """Every thread of this process but the calling one (the event loop's) to SCHED_BATCH; returns
    how many. Threads the loop thread starts later must call ``batch_this_thread`` themselves."""
    if not hasattr(os, "SCHED_BATCH"):
        return 0
    me = threading.get_native_id()
    try:
        tids = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError as exc:
        log.debug("no thread list (%s): scheduling policies unchanged", exc)
        return 0
    return sum(_set_batch(tid) for tid in tids if tid != me)
