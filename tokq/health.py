"""Waiting for a gRPC server started as a child process to report a health status (the
standard grpc.health.v1 service): `tokq up`, the benchmarks and the tests all start servers
this way."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Collection, Iterable

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
