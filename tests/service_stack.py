"""A real tokq deployment for end-to-end tests: its own Redis server, one gateway process and
worker processes, each started with `python -m tokq.cli ...` exactly as an operator would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokq.keys import QueueKeys
from tokq.model_info import ModelInfo
from tokq.processes import stop_all
from tokq.redis_server import EmbeddedRedis, free_port


class ServiceStack:
    def __init__(self, env: dict[str, str] | None = None, model: str | None = None) -> None:
        self.redis = EmbeddedRedis(binary=os.environ.get("TOKQ_TEST_REDIS_SERVER") or None).start()
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.model_args = ["--model", model] if model else []
        self.keys = QueueKeys(ModelInfo.load(model).queue_name)  # as its gateway and workers name it
        self.gateway: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}

    def _spawn(self, *args: str) -> subprocess.Popen:
        # The Redis URL (with its password) goes in the environment, as `tokq up` passes it.
        return subprocess.Popen([sys.executable, "-m", "tokq.cli", *args, *self.model_args],
                                env={**self.env, "TOKQ_REDIS_URL": self.redis.url})

    def start_gateway(self, *extra: str, timeout_s: float = 90) -> None:
        self.gateway = self._spawn("gateway", "--host", "127.0.0.1", "--port", str(self.port), *extra)
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.gateway.poll() is None, "gateway exited during start-up"
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                        return
                except grpc.RpcError:
                    time.sleep(0.2)
        raise TimeoutError("gateway did not become healthy")

    def start_worker(self, worker_id: str, *extra: str, wait: bool = True, timeout_s: float = 90) -> None:
        self.workers[worker_id] = self._spawn("worker", "--worker-id", worker_id, *extra)
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

    def signal_worker(self, worker_id: str, sig: int) -> None:
        self.workers[worker_id].send_signal(sig)

    def stop_worker(self, worker_id: str, timeout_s: float = 60) -> int:
        proc = self.workers.pop(worker_id)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout_s)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url)

    def close(self) -> None:
        procs = list(self.workers.values()) + ([self.gateway] if self.gateway else [])
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        stop_all(procs, timeout_s=20)
        self.redis.close()
