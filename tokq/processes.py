"""Child processes: waiting for a child gRPC server to report healthy (grpc.health.v1), stopping
children (SIGTERM, a shared grace period, then SIGKILL), and making one die with its parent."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Collection, Iterable

_PR_SET_PDEATHSIG = 1
try:  # looked up here, in the parent: loading a library between fork and exec may deadlock
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:  # not Linux: the supervisors' signal handlers still clean up
    _prctl = None


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux), so a supervisor killed
    outright leaves no child holding ports. ``parent``: the supervisor's pid, read before the fork;
    if it already died, this child exits at once."""
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

SERVING = 1  # health_pb2.HealthCheckResponse.SERVING, without importing grpc at module load


class ExitedDuringStartup(RuntimeError):
    """A process the caller is waiting on exited before the server reported the status."""


def health_status(target: str, timeout_s: float = 2.0, service: str = "") -> int:
    """The server's health status (health_pb2.HealthCheckResponse.SERVING, ...): overall, or
    ``service``'s; raises grpc.RpcError when it does not answer."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=timeout_s).status


class NotHealthy(TimeoutError):
    """The server did not report a wanted status in time; ``last_error``: why its last check
    failed ("" when it answered, with another status), e.g. a certificate it cannot verify."""

    def __init__(self, message: str, last_error: str) -> None:
        super().__init__(message)
        self.last_error = last_error


def wait_for_health(target: str, procs: Iterable[subprocess.Popen], timeout_s: float,
                    wanted: Collection[int] = (SERVING,), credentials=None) -> int:
    """Poll ``target`` until its health status is one of ``wanted`` and return it; raise
    ExitedDuringStartup if any of ``procs`` exits first, NotHealthy (a TimeoutError) after
    ``timeout_s``. ``credentials``: grpc channel credentials for a server serving TLS."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    last_error = ""
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.poll() is not None:
                    raise ExitedDuringStartup(f"{target}: a process exited during start-up ({proc.returncode})")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status in wanted:
                    return status
                last_error = ""
            except grpc.RpcError as exc:
                last_error = exc.details() or exc.code().name
            time.sleep(0.2)
    raise NotHealthy(f"{target} health not in {sorted(wanted)} after {timeout_s:.0f} s", last_error)
