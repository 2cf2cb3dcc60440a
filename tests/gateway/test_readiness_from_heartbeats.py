"""Readiness from worker heartbeats in a real Redis (standalone and Cluster), and the worker's
--check probe as k8s runs it. The gateway end to end (Redis stopped and started, a worker
stopped and started) is in tests/service/test_http_api_and_readiness.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import redis

from tokq.queue.keys import QueueKeys
from tokq.model.info import ModelInfo

pytestmark = pytest.mark.redis_kinds("standalone", "cluster")
KEYS = QueueKeys(ModelInfo.load().queue_name)  # as gateways and workers name the bundled model's queue


def beat(client, worker_id: str, ttl_ms: int = 60_000) -> None:
    """What a worker's heartbeat writes (workers/heartbeat.py)."""
    client.set(KEYS.heartbeat(worker_id), "{}", px=ttl_ms)
    client.zadd(KEYS.workers, {worker_id: int(time.time() * 1000)})


async def test_ready_only_with_a_live_heartbeat(redis_url):
    from tokq.redis.connection import connect
    from tokq.gateway.readiness import Readiness

    changes = []

    async def on_change(ready):
        changes.append(ready)

    client = connect(redis_url)
    try:
        # Connected first (a cluster client reads the slot map, then links to each node): each
        # check is bounded at 2 periods or 1 s, which a loaded machine's first links could outlast.
        await client.ping()
        readiness = Readiness(client, {"all-MiniLM-L6-v2": KEYS}, period_s=1.0, on_change=on_change)
        assert not await readiness.check() and "no live worker" in readiness.reason
        await client.zadd(KEYS.workers, {"gone": 1})  # listed, but its heartbeat key expired
        assert not await readiness.check()
        await client.set(KEYS.heartbeat("w1"), "{}", px=60_000)
        await client.zadd(KEYS.workers, {"w1": int(time.time() * 1000)})
        assert await readiness.check() and readiness.reason == "ready"
        await client.delete(KEYS.heartbeat("w1"))  # a worker's clean stop
        assert not await readiness.check()
        assert changes == [True, False]
    finally:
        await client.aclose()


@pytest.mark.redis_kinds("standalone")
async def test_one_of_several_gateway_processes_is_ready_only_once_all_listen(redis_url):
    """`tokq gateway --procs N`: a process whose siblings do not listen yet reports not ready,
    so `tokq up` (waiting on the port's health) says "up" only when every process serves."""
    import multiprocessing

    from tokq.redis.connection import connect
    from tokq.gateway.readiness import Readiness, SiblingProcesses

    client = connect(redis_url)
    try:
        await client.set(KEYS.heartbeat("w1"), "{}", px=60_000)
        await client.zadd(KEYS.workers, {"w1": int(time.time() * 1000)})
        siblings = SiblingProcesses(multiprocessing.get_context("spawn").Value("i", 0), 3)
        readiness = Readiness(client, {"all-MiniLM-L6-v2": KEYS}, siblings=siblings)
        siblings.add()
        siblings.add()
        assert not await readiness.check() and readiness.reason == "2 of 3 gateway processes listening"
        siblings.add()
        assert await readiness.check() and readiness.reason == "ready"
        assert await Readiness(client, {"all-MiniLM-L6-v2": KEYS}).check()  # one process: no siblings
    finally:
        await client.aclose()


async def test_unreachable_redis_is_not_ready(caplog):
    from tokq.redis.connection import connect
    from tokq.gateway.readiness import Readiness
    from tokq.redis.embedded import free_port

    port = free_port()
    client = connect(f"redis://127.0.0.1:{port}/0", cluster="no")
    try:
        readiness = Readiness(client, {"m": KEYS})
        assert not await readiness.check() and "Redis unreachable" in readiness.reason
        assert str(port) not in readiness.reason  # /ready shows the reason to anyone
        assert not await readiness.check()
        logged = [r.getMessage() for r in caplog.records
                  if r.levelname == "WARNING" and "Redis unreachable" in r.getMessage()]
        assert len(logged) == 1 and str(port) in logged[0]  # the detail, once an outage
    finally:
        await client.aclose()


@pytest.mark.slow
@pytest.mark.redis_kinds("standalone")
def test_worker_check_this_host_sees_only_this_hosts_workers(redis_url):
    def check(*args):
        return subprocess.run([sys.executable, "-m", "tokq.cli", "worker", "--check", *args,
                               "--redis-url", redis_url], capture_output=True).returncode

    client = redis.Redis.from_url(redis_url)
    beat(client, "another-pod-1234")
    assert check() == 0  # some worker is alive
    assert check("--this-host") == 1  # but not one of this pod's
    beat(client, f"{socket.gethostname()}-4321")
    assert check("--this-host") == 0
    client.close()


async def test_a_worker_check_that_fails_while_ping_answers_is_logged_once(redis_url, caplog):
    """Ping answers but the workers' key cannot be read (in a cluster: shard 0's node out while
    the node the client asks answers; here: the key of the wrong type): one warning for the
    outage, not one a second."""
    import logging

    from tokq.redis.connection import connect
    from tokq.gateway.readiness import Readiness

    client = connect(redis_url)
    caplog.set_level(logging.WARNING, logger="tokq.gateway.readiness")
    try:
        await client.set(KEYS.workers, "not a sorted set")  # ZRANGE: WRONGTYPE
        readiness = Readiness(client, {"all-MiniLM-L6-v2": KEYS})
        for _ in range(3):
            assert not await readiness.check() and readiness.reason.startswith("Redis unreachable")
        warned = [r for r in caplog.records if "Redis unreachable" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in warned]
    finally:
        await client.delete(KEYS.workers)
        await client.aclose()
