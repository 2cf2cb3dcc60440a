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


def wait_for_health(target: str, procs: Iterable[subprocess.Popen], timeout_s: float,
                    wanted: Collection[int] = (SERVING,)) -> int:
    """Poll ``target`` until its health status is one of ``wanted`` and return it; raise
    ExitedDuringStartup if any of ``procs`` exits first, TimeoutError after ``timeout_s``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.poll() is not None:
                    raise ExitedDuringStartup(f"{target}: a process exited during start-up ({proc.returncode})")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status in wanted:
                    return status
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{target} health not in {sorted(wanted)} after {timeout_s:.0f} s")
