"""A busy worker taken for dead: its worker-channel subscription drops while it also misses a
lease renewal, so requeue.lua redoes its batch early, on another worker, while it is still
computing it; then it comes back and acknowledges the same batch late. The work is done twice;
each request must still be answered once, with the right vectors, and the queue's counters and
keys must add up.

Real processes on a real Redis: a gateway, worker w1 (through a fault proxy, which resets its
subscriber connection as a network would) and, later, worker w2. w1 is stopped (SIGSTOP) while
it holds a lease, so its renewals stop; requeue runs at the moment a renewal is overdue (half a
lease before the deadline, the Redis clock given to the script), which makes "early" exact
instead of a race against the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import threading
import time

import numpy as np
import pytest
import redis

from tokq import AsyncClient
from tokq.config import QueueConfig
from tokq.redis.connection import connect
from tokq.queue.keys import QueueKeys
from tokq.model.info import ModelInfo
from tokq.queue.shard import Queue

pytestmark = pytest.mark.slow
KEYS = QueueKeys(ModelInfo.load().queue_name)
LEASE_MS = 20_000  # long: only the test's requeue, not the workers' own, redoes the batch early
CALL_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def texts(bundled_model_dir) -> list[str]:
    words = [w.strip() for w in open(bundled_model_dir / "vocab.txt", encoding="utf-8")
             if w.strip().isalpha() and w.strip().islower() and len(w.strip()) > 2][:5000]
    rng = random.Random(7)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 40))) for _ in range(48)]


@pytest.fixture(scope="module")
def reference(texts, bundled_model_dir) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(bundled_model_dir), device="cpu")
    return model.encode(texts, batch_size=64, normalize_embeddings=True)


@pytest.fixture
def stack():
    from tokq.testing.fault_proxy import FaultProxy
    from service_stack import ServiceStack

    s = ServiceStack(env={"TOKQ_LEASE_MS": str(LEASE_MS)})
    s.worker_proxy = FaultProxy(s.redis.url, seed=3).start()
    try:
        s.start_gateway()
        s.start_worker("w1", redis_url=s.worker_proxy.url)
        yield s
    finally:
        s.close()
        s.worker_proxy.close()


def held_leases(r: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.zrange(KEYS.leases, 0, -1, withscores=True)}


def counters(r: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(KEYS.counters).items()}


def worker_channel_subscribers(r: redis.Redis, batch_prefix: str) -> int:
    [(_, count)] = r.pubsub_shardnumsub(KEYS.worker_channel_prefix + batch_prefix)
    return int(count)


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def keys_left(r: redis.Redis, settle_s: float = 30) -> list[bytes]:
    """Request keys still in Redis once delivered replies' grace is over (waits up to
    ``settle_s``); counters, budget, worker registries and the like are not request keys."""
    keep = re.compile(rb"^tokq:\{[^}]+\}:(counters|budget|shards|workers|idle|heartbeat:.*"
                      rb"|metrics-exporter|cancelled:.*)$")  # a cancelled mark expires by itself
    deadline = time.monotonic() + settle_s
    while True:
        left = [k for k in r.keys("*") if not keep.match(k)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


class Calls:
    """Embed calls of 4 texts each, run on a background event loop; each one's answer checked
    against the model run alone."""

    def __init__(self, target: str, texts: list[str], reference: np.ndarray) -> None:
        self.texts, self.reference = texts, reference
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        async def open_client():  # its gRPC channel belongs to the loop that creates it
            return AsyncClient(target)
        self.client = self.run(open_client())
        self.pending: list[tuple[int, object]] = []
        self.items = self.answered = 0

    def send(self, starts) -> None:
        for i in starts:
            self.pending.append((i, asyncio.run_coroutine_threadsafe(
                self.client.embed(self.texts[i:i + 4], timeout=CALL_TIMEOUT_S), self.loop)))
            self.items += len(self.texts[i:i + 4])

    def settle(self) -> None:
        """Wait for every pending call: each must return the right vectors (one answer)."""
        for i, call in self.pending:
            got, want = call.result(CALL_TIMEOUT_S + 30), self.reference[i:i + 4]
            cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
            assert got.shape == want.shape and cos.min() >= 0.9999, (i, cos)
            self.answered += 1
        self.pending = []

    def run(self, coro, timeout_s: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def stop_w1_holding_a_lease(stack, r: redis.Redis, calls: Calls) -> dict[str, int]:
    """Send calls until w1 is caught (SIGSTOP) holding a lease; returns its leases."""
    w1 = stack.workers["w1"]
    for _ in range(30):
        calls.send(range(0, len(calls.texts), 4))
        deadline = time.monotonic() + 60
        while not r.zcard(KEYS.leases) and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(w1.pid, signal.SIGSTOP)
        leases = held_leases(r)
        if leases:
            return leases
        os.kill(w1.pid, signal.SIGCONT)  # it acknowledged in between: try again
        calls.settle()
    pytest.fail("never caught w1 holding a lease")


def test_a_live_worker_taken_for_dead_has_its_batch_redone_and_every_call_answered_once(
        stack, texts, reference):
    r = redis.Redis.from_url(stack.redis.url)
    w1 = stack.workers["w1"]
    calls = Calls(stack.target, texts, reference)
    try:
        leases = stop_w1_holding_a_lease(stack, r, calls)
        owners = {re.match(r"^(.*)-\d+$", b).group(1) for b in leases}
        assert len(owners) == 1, leases  # w1 is the only worker so far
        owner = owners.pop()
        leased_items = sum(r.llen(KEYS.lease(b)) for b in leases)
        assert leased_items > 0

        # w1's subscriber link resets: Redis drops its worker-channel subscription.
        assert stack.worker_proxy.drop_connections(b"SSUBSCRIBE") >= 1
        wait_for(lambda: worker_channel_subscribers(r, owner) == 0, "w1's subscription to drop")

        # Requeue as it runs once w1's renewal is overdue: within half a lease of the deadline
        # but before it (not expired: only the silent worker channel makes it redo the batch).
        now_ms = max(leases.values()) - LEASE_MS // 2 + 1
        assert now_ms < min(leases.values())
        before = counters(r)

        async def requeue():
            redis_client = connect(stack.redis.url)
            try:
                queue = Queue(redis_client, KEYS.queue, QueueConfig(lease_ms=LEASE_MS),
                              clock=lambda: now_ms)
                return await queue.requeue_expired()
            finally:
                await redis_client.aclose()

        assert calls.run(requeue()) == (leased_items, 0)  # (requeued, failed)
        assert not set(held_leases(r)) & set(leases)  # w1's leases are gone
        assert counters(r)["requeued"] - before.get("requeued", 0) == leased_items

        # Started only now: a worker's own requeue chore, running while a slow start-up (torch,
        # the model) passed half a lease from w1's claim, would take the lease first.
        stack.start_worker("w2")  # it redoes the batch; w1 stays stopped
        # w2 redoes the batch while w1 is still stopped: every call is answered by then.
        calls.settle()
        assert w1.poll() is None

        # w1 resumes: it finishes the same batch and acknowledges it late (the first write
        # won); it has acknowledged once it waits for work again, subscribed anew.
        os.kill(w1.pid, signal.SIGCONT)
        wait_for(lambda: worker_channel_subscribers(r, owner) >= 1, "w1 to resubscribe")
        calls.send([0, 4])  # and both workers serve on
        calls.settle()
    finally:
        if w1.poll() is None:
            os.kill(w1.pid, signal.SIGCONT)
        calls.close()

    # Each item enqueued once and acknowledged once (the late ack stored nothing), none
    # failed; nothing in flight or queued; no request key left behind.
    after = counters(r)
    assert after["enqueued"] == after["acked"] == calls.items, after
    assert after.get("failed", 0) == 0, after
    assert int(r.get(KEYS.inflight) or 0) == 0
    assert int(r.get(KEYS.tokens) or 0) == 0
    assert keys_left(r) == []
