"""Child processes: stopping them (SIGTERM, a shared grace period, then SIGKILL for
stragglers), and making one die with its parent."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterable

_PR_SET_PDEATHSIG = 1
try:  # looked up here, in the parent: loading a library between fork and exec may deadlock
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:  # not Linux: the supervisors' signal handlers still clean up
    _prctl = None


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux), so a supervisor
    killed outright (SIGKILL, the OOM killer) leaves no child holding ports behind. ``parent``:
    the supervisor's pid, read before the fork: a parent that died before the request (which
    then never fires) ends this child at once."""
    if _prctl is None:
        return
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def supervised_child(parent: int):
    """A ``preexec_fn`` for a supervisor's child: it dies with ``parent`` (its pid) and ignores
    SIGHUP, which a closing terminal sends its whole process group: the supervisor takes it as
    its stop and stops its children in order, instead of each dying where it stands."""
    def setup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # kept across exec
        die_with_parent(parent)
    return setup


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
