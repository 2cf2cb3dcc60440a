"""The gateway's helper threads yield to its event loop's thread (Linux: SCHED_BATCH).

Every call goes through the event loop's thread. gRPC's completion-queue poller and event-engine
threads wake several times per call (a request read, each completion handed to the loop), and
under the default policy each wake-up preempted the loop thread: ~5 involuntary context switches
per call with 64 calls in flight on 2 cores, ~1 as batch threads, and ~6% less gateway CPU per
call (RESULTS.md). A batch thread that wakes does not preempt the running one: it runs on a free
core, or when the loop thread waits (which is when the loop needs what it brings).

Where the policy cannot be set (not Linux; gVisor refuses every policy but the default; no
/proc) nothing changes and the gateway serves as before.
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
    """Every thread of this process but the calling one (the event loop's) to SCHED_BATCH;
    returns how many. Threads they start later inherit it (gRPC's pool grows from its own
    threads); ones the loop thread starts later keep the default, unless they call
    ``batch_this_thread`` (the tokenizer's pools do). A no-op where the policy does not exist."""
    if not hasattr(os, "SCHED_BATCH"):
        return 0
    me = threading.get_native_id()
    try:
        tids = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError as exc:
        log.debug("no thread list (%s): scheduling policies unchanged", exc)
        return 0
    return sum(_set_batch(tid) for tid in tids if tid != me)
