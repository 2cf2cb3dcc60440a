"""A real tokq deployment for end-to-end tests: its own Redis server, one gateway process and
worker processes, each started with `python -m tokq.cli ...` exactly as an operator would."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
import redis
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from tokq.processes import health_status, wait_for_health
from tokq.queue.keys import QueueKeys
from tokq.model.info import ModelInfo
from tokq.processes import stop_all
from tokq.queue.shard import COLLECT_GRACE_MS, REPLY_META_FIELDS
from tokq.redis.embedded import EmbeddedRedis, free_port


def alive(pid: int) -> bool:
    """The process runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def delivered_reply(r: redis.Redis, key: bytes) -> bool:
    """A complete reply whose results went out in its completion notice: kept only a short grace
    (tokq.queue.shard.COLLECT_GRACE_MS) for a gateway that missed the notice, then gone by itself. A
    key whose grace ends while it is being looked at (it was listed, then expired) counts too."""
    n = r.hget(key, "n")
    complete = n is not None and r.hlen(key) == int(n) + len(REPLY_META_FIELDS)
    # read last: -2 = gone meanwhile, 0 = going this millisecond (Redis expires a key only once
    # its time has passed: among 2,000 replies whose grace ends together, one read lands on it)
    pttl = r.pttl(key)
    return pttl in (-2, 0) or (complete and 0 < pttl <= COLLECT_GRACE_MS)


def ctrl_c_reaches_it() -> None:
    """``preexec_fn`` for a child the test stops as Ctrl-C (or a closed terminal) would:
    SIGINT's and SIGHUP's default actions, even when the suite itself runs where they are
    ignored (a background job of a non-interactive shell, nohup: `tokq up` then rightly
    ignores them, as any such job does)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (its socket fds matched in /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def ipv6_loopback() -> bool:
    """This host can bind the IPv6 loopback address (::1)."""
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback (::1 cannot be bound)")


def embed_counts(metrics_ports: list[int], rpc: str = "Embed") -> list[float]:
    """Embed calls (``rpc``: "http.Embeddings" for HTTP) each gateway process has answered OK,
    from its own metrics page."""
    counts = []
    for port in metrics_ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        counts.append(sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                          if s.name == "tokq_gateway_requests_total"
                          and s.labels.get("rpc") == rpc and s.labels.get("code") == "OK"))
    return counts


def read_until_serving(proc: subprocess.Popen, timeout_s: float = 180) -> list[str]:
    """The lines `tokq up` (started with stdout=PIPE, text=True) prints up to the one saying it
    serves; fails with its output if it exits first."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "tokq up exited:\n" + "".join(lines)
        lines.append(line)
        if "Ctrl-C stops everything" in line:
            return lines
    raise AssertionError(f"tokq up not serving after {timeout_s:.0f} s:\n" + "".join(lines))


class ServiceStack:
    def __init__(self, env: dict[str, str] | None = None, model: str | None = None, http: bool = False,
                 cluster=None) -> None:
        # Its own Redis server, or a node of ``cluster`` (a running tokq.testing.cluster.LocalCluster).
        self.cluster = cluster
        self.redis = None if cluster else EmbeddedRedis(
            binary=os.environ.get("TOKQ_TEST_REDIS_SERVER") or None).start()
        self.redis_url = cluster.url if cluster else self.redis.url
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        # Workers keep the device's default budget, not one fitted to this machine's speed at
        # the moment (fitting: tests/worker/test_default_budget_fits_latency_goal.py).
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKQ_LATENCY_GOAL_MS": "0", **(env or {})}
        self.model_args = ["--model", model] if model else []
        self.keys = QueueKeys(ModelInfo.load(model).queue_name)  # as its gateway and workers name it
        # The OpenAI-compatible HTTP API on its own free port, when asked for.
        self.http_port = free_port() if http else 0
        self.http_url = f"http://127.0.0.1:{self.http_port}" if http else ""
        self.gateway: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}

    def _spawn(self, *args: str, redis_url: str | None = None) -> subprocess.Popen:
        # The Redis URL (with its password) goes in the environment, as `tokq up` passes it.
        return subprocess.Popen([sys.executable, "-m", "tokq.cli", *args, *self.model_args],
                                env={**self.env, "TOKQ_REDIS_URL": redis_url or self.redis_url})

    def start_gateway(self, *extra: str, timeout_s: float = 90, redis_url: str | None = None) -> None:
        """Start the gateway (through ``redis_url``, e.g. a fault proxy, instead of the server) and
        return once it answers health checks; it reports SERVING only once a worker is alive too
        (``wait_ready``)."""
        http_args = ["--http-port", str(self.http_port)] if self.http_port else []
        self.gateway = self._spawn("gateway", "--host", "127.0.0.1", "--port", str(self.port), *http_args, *extra,
                                   redis_url=redis_url)
        wait_for_health(self.target, [self.gateway], timeout_s,
                        wanted={health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING})

    def health(self, service: str = "") -> int:
        """The gateway's gRPC health status (health_pb2.HealthCheckResponse.SERVING, ...), overall
        or ``service``'s."""
        return health_status(self.target, service=service)

    def wait_ready(self, timeout_s: float = 60) -> None:
        wait_for_health(self.target, [self.gateway], timeout_s)

    def start_worker(self, worker_id: str, *extra: str, wait: bool = True, timeout_s: float = 90,
                     redis_url: str | None = None) -> None:
        self.workers[worker_id] = self._spawn("worker", "--worker-id", worker_id, *extra,
                                              redis_url=redis_url)
        if wait:
            self.wait_heartbeat(worker_id, timeout_s)

    def wait_heartbeat(self, worker_id: str, timeout_s: float = 90) -> None:
        keys = self.keys
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.workers[worker_id].poll() is None, f"worker {worker_id} exited"
            if client.exists(keys.heartbeat(worker_id)):
                return
            time.sleep(0.1)
        raise TimeoutError(f"worker {worker_id} sent no heartbeat")

    def kill_gateway(self) -> None:
        """kill -9 the gateway (calls in flight lose their connection)."""
        self.gateway.send_signal(signal.SIGKILL)
        self.gateway.wait()
        self.gateway = None

    def signal_worker(self, worker_id: str, sig: int) -> None:
        self.workers[worker_id].send_signal(sig)

    def stop_worker(self, worker_id: str, timeout_s: float = 60) -> int:
        proc = self.workers.pop(worker_id)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout_s)

    def client(self) -> redis.Redis:
        if self.cluster:
            return redis.RedisCluster.from_url(self.redis_url)
        return redis.Redis.from_url(self.redis.url)

    def close(self) -> None:
        procs = list(self.workers.values()) + ([self.gateway] if self.gateway else [])
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        stop_all(procs, timeout_s=20)
        if self.redis:
            self.redis.close()


@contextlib.contextmanager
def gateway_and_worker(*gateway_args: str, env: dict[str, str] | None = None, http: bool = False,
                       model: str | None = None, gateway_over_unix_socket: bool = False) -> Iterator[ServiceStack]:
    """The stack most end-to-end tests want: one gateway and one worker ("w1"), serving (gRPC
    health SERVING) when the block starts, every process and Redis stopped after it."""
    stack = ServiceStack(env=env, http=http, model=model)
    try:
        stack.start_gateway(*gateway_args, redis_url=stack.redis.unix_url if gateway_over_unix_socket else None)
        stack.start_worker("w1")
        stack.wait_ready()
        yield stack
    finally:
        stack.close()
