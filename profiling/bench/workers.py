"""Real `tokq worker` processes for the benchmarks that need several of them on their own Redis
(crash recovery, an idle fleet): started with the bundled model, and waited on until each has
beaten its heartbeat."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import redis

from tokq.keys import QueueKeys
from tokq.model_info import ModelInfo, bundled_model_path

QUEUE = ModelInfo.load().queue_name  # the bundled model's, as its workers name it


def start_worker(redis_url: str, worker_id: str, *, token_budget: int | None = None,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """One `tokq worker` of the bundled model with one torch thread, its output dropped."""
    budget = ["--token-budget", str(token_budget)] if token_budget else []
    return subprocess.Popen([sys.executable, "-m", "tokq.cli", "worker", "--model", str(bundled_model_path()),
                             "--worker-id", worker_id, *budget, "--threads", "1"],
                            env={**(env or os.environ), "PYTHONUNBUFFERED": "1",
                                 "TOKQ_REDIS_URL": redis_url},  # the password stays off argv
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_heartbeats(client: redis.Redis, procs: dict[str, subprocess.Popen], timeout_s: float = 300) -> None:
    """Until every worker (by id) has a heartbeat key; fails if one exits first."""
    keys = QueueKeys(QUEUE)
    deadline = time.monotonic() + timeout_s
    while not all(client.exists(keys.heartbeat(w)) for w in procs):
        assert all(p.poll() is None for p in procs.values()), "a worker exited during start-up"
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.2)
