"""Child processes: stopping them (SIGTERM, a shared grace period, then SIGKILL for
stragglers), and making one die with its parent."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import time
from collections.abc import Iterable

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux), so a supervisor
    killed outright (SIGKILL, the OOM killer) leaves no child holding ports behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the supervisors' signal handlers still clean up
        pass


def stop_all(procs: Iterable[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """Terminate every process still running and wait for all; kill any that outlast
    ``timeout_s`` (counted once for the whole group, so N stuck children cost one timeout)."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
