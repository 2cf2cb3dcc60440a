"""The service on a real Redis Cluster (3 primaries + 3 replicas): gateway and worker processes
started with `python -m tokq.cli`, pointed at a node that does not own the queue's slot, the
queue in 3 shards spread over the nodes; then a primary is killed -9 under load."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokq import Client, TokqError
from tokq.queue.keys import QueueKeys, shard_queue_name
from tokq.model.info import ModelInfo
from tokq.processes import stop_all
from tokq.redis.embedded import free_port

pytestmark = pytest.mark.slow
NUM_SHARDS = 3
RETRYABLE = {"UNAVAILABLE"}  # what the README promises for lost answers and failover


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["queue", "shard", "cluster", "token", "batch", "vector", "model", "redis", "node",
             "replica", "primary", "embedding", "search", "query", "budget", "latency"]
    return [" ".join(rng.choice(words, size=int(rng.integers(2, 20)))) for _ in range(n)]


@pytest.fixture(scope="module")
def reference(bundled_model_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(bundled_model_dir), device="cpu")
    return lambda texts: model.encode(texts, batch_size=64, normalize_embeddings=True)


def _wait_serving(target: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, "gateway exited"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError("gateway not SERVING")


@pytest.fixture(scope="module")
def stack(redis_cluster):
    """Gateway + worker through a primary that owns none of the queue's first shard's slot."""
    for node in redis_cluster.nodes:
        if not node.running:
            redis_cluster.restart(node.port)
    redis_cluster.flushall()
    queue = ModelInfo.load(None).queue_name
    owner = redis_cluster.owner_port(QueueKeys(queue).pending)
    url = redis_cluster.node_url(next(p for p in redis_cluster.primary_ports() if p != owner))
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKQ_REDIS_URL": url,
           "TOKQ_QUEUE_SHARDS": str(NUM_SHARDS), "TOKQ_LEASE_MS": "2000"}
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "tokq.cli", "gateway", "--host",
                                       "127.0.0.1", "--port", str(port)], env=env))
        procs.append(subprocess.Popen([sys.executable, "-m", "tokq.cli", "worker", "--worker-id",
                                       "cw1", "--threads", "1"], env=env))
        _wait_serving(f"127.0.0.1:{port}", procs[0])
        yield {"target": f"127.0.0.1:{port}", "queue": queue, "procs": procs, "url": url}
    finally:
        stop_all(procs, timeout_s=20)


def _assert_close(got, want) -> None:
    got = np.asarray(got, np.float32)
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999, f"min cosine {cos.min()}"


def test_embed_through_a_node_that_does_not_own_the_queue(stack, reference):
    texts = _texts(40, seed=1)
    with Client(stack["target"]) as client:
        for chunk in (texts[:1], texts[1:8], texts[8:]):
            _assert_close(client.embed(chunk), reference(chunk))


def test_requests_spread_over_every_shard_and_node(stack, redis_cluster, reference):
    texts = _texts(60, seed=2)
    want = reference(texts)
    errors = []

    def call(i: int) -> None:
        try:
            _assert_close(client.embed(texts[i:i + 3]), want[i:i + 3])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with Client(stack["target"]) as client:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(0, 60, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    shard_keys = [QueueKeys(shard_queue_name(stack["queue"], s)) for s in range(NUM_SHARDS)]
    with redis.RedisCluster.from_url(stack["url"]) as c:
        enqueued = [int(c.hget(k.counters, "enqueued") or 0) for k in shard_keys]
    assert all(n > 0 for n in enqueued), enqueued
    # Slots come from hashing each shard's tag: 3 shards reach 2 or 3 of the 3 primaries.
    assert len({redis_cluster.owner_port(k.pending) for k in shard_keys}) >= 2


def test_worker_liveness_check_reads_the_cluster(stack):
    env = {**os.environ, "TOKQ_REDIS_URL": stack["url"]}
    check = [sys.executable, "-m", "tokq.cli", "worker", "--check", "--worker-id"]
    assert subprocess.run([*check, "cw1"], env=env, timeout=60).returncode == 0
    assert subprocess.run([*check, "no-such-worker"], env=env, timeout=60).returncode == 1


def test_kill_9_of_a_primary_under_load_answers_right_or_retryable(stack, redis_cluster, reference):
    """Calls run before, during and after a primary dies; a replica takes over. Every call is
    answered with its own vectors or a retryable status; then calls succeed again, with no
    process restarted."""
    texts = _texts(200, seed=3)
    want = reference(texts)
    outcomes: list[str] = []
    stop = threading.Event()

    def caller(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with Client(stack["target"]) as client:
            while not stop.is_set():
                i = int(rng.integers(0, len(texts) - 4))
                try:
                    got = client.embed(texts[i:i + 4], timeout=30)
                except TokqError as exc:
                    outcomes.append(exc.code.name)
                    continue
                try:
                    _assert_close(got, want[i:i + 4])  # right vectors, never another call's
                    outcomes.append("OK")
                except AssertionError:
                    outcomes.append("WRONG VECTORS")

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(3)
        victim = redis_cluster.owner_port(QueueKeys(shard_queue_name(stack["queue"], 1)).pending)
        redis_cluster.kill(victim)
        redis_cluster.wait_ok(timeout_s=60)
        assert redis_cluster.owner_port(
            QueueKeys(shard_queue_name(stack["queue"], 1)).pending) != victim
        time.sleep(8)  # load continues on the new primary
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    print("outcomes during the failover:", dict(Counter(outcomes)))
    assert all(p.poll() is None for p in stack["procs"]), "a tokq process died"
    assert set(outcomes) <= {"OK"} | RETRYABLE, sorted(set(outcomes))
    assert outcomes.count("OK") > 0
    # after the failover, every call succeeds again
    with Client(stack["target"]) as client:
        for i in range(0, 40, 4):
            for attempt in range(20):
                try:
                    _assert_close(client.embed(texts[i:i + 4], timeout=30), want[i:i + 4])
                    break
                except TokqError as exc:
                    assert exc.code.name in RETRYABLE
                    time.sleep(0.5)
            else:
                pytest.fail("calls still fail after the failover")
