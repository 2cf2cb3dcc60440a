"""Real `tokq worker` processes for the benchmarks that start their own stack: the bundled model,
one torch thread, the Redis URL in the environment; waited on until each has beaten its
heartbeat (it has loaded and warmed up)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import redis

from tokq.queue.keys import QueueKeys
from tokq.model.info import ModelInfo, bundled_model_path

QUEUE = ModelInfo.load().queue_name  # the bundled model's, as its workers name it


def start_worker(redis_url: str, worker_id: str, *, token_budget: int | None = None,
                 env: dict[str, str] | None = None, log=subprocess.DEVNULL) -> subprocess.Popen:
    """One `tokq worker` of the bundled model with one torch thread; its output goes to ``log``."""
    budget = ["--token-budget", str(token_budget)] if token_budget else []
    return subprocess.Popen([sys.executable, "-m", "tokq.cli", "worker", "--model", str(bundled_model_path()),
                             "--worker-id", worker_id, *budget, "--threads", "1"],
                            env={**(env or os.environ), "PYTHONUNBUFFERED": "1",
                                 "TOKQ_REDIS_URL": redis_url},  # the password stays off argv
                            stdout=log, stderr=log)


def wait_heartbeats(client: redis.Redis, procs: dict[str, subprocess.Popen], timeout_s: float = 300) -> None:
    """Until every worker (by id) has a heartbeat key; fails if one exits first."""
    keys = QueueKeys(QUEUE)
    deadline = time.monotonic() + timeout_s
    while not all(client.exists(keys.heartbeat(w)) for w in procs):
        if any(p.poll() is not None for p in procs.values()):
            raise RuntimeError("a worker exited during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers sent no heartbeat within {timeout_s:.0f} s")
        time.sleep(0.2)
