"""Stopping child processes: SIGTERM, a shared grace period, then SIGKILL for stragglers."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable


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
