"""Faults production inflicts, injected into a real deployment: a real Redis, a gateway process
and worker processes (tests/service_stack.py), the bundled model, real gRPC callers.

The gateway and the first worker reach Redis through their own fault proxy (tests/fault_proxy.py),
which can let a command run and lose its answer. The scenarios without a proxy or a Redis
restart (kill -9 of a worker and of the gateway, the overload burst, the deadline storm) run again
on the real 3+3 Redis Cluster, the queue in 3 shards over its nodes (a proxy in front of one node
would not see the commands a cluster client sends straight to the others). Each scenario sends a
bounded number of calls and checks that every call got exactly one answer: the right vectors
(compared with the model run alone) or a retryable status the scenario explains; that no call
hung (every wait is bounded); that nothing was queued twice; and that no request key is left in
Redis afterwards.

``TOKQ_FAULTS_RESULTS=profiling/RESULTS.md`` makes the module rewrite that file's "Faults
survived" table from what it measured.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tokq import AsyncClient, TokqError
from tokq.keys import QueueKeys, shard_queue_name
from tokq.model_info import ModelInfo

pytestmark = pytest.mark.slow
KEYS = QueueKeys(ModelInfo.load().queue_name)  # as the gateway and workers name it
LEASE_MS = 1500
REPLY_TTL_MS = 2000  # so a killed gateway's uncollected replies go within seconds
MAX_QUEUED_TOKENS = 6000
CLUSTER_SHARDS = 3
CALL_TIMEOUT_S = 20.0
HANG_MARGIN_S = 30.0  # a call not finished this long after its deadline counts as hung
RESULTS_ENV = "TOKQ_FAULTS_RESULTS"
TABLE: list[Tally] = []


@dataclass
class Tally:
    fault: str
    calls: int = 0
    correct: int = 0
    retryable: int = 0
    lost: int = 0  # hung, or no answer until a deadline the test did not cause
    wrong: int = 0  # wrong vectors, or a status that is not retryable
    duplicated: int | None = 0  # items queued beyond those sent (None: counters lost with Redis)
    codes: Counter = field(default_factory=Counter)

    def check(self) -> None:
        assert (self.lost, self.wrong, self.duplicated or 0) == (0, 0, 0), self
        assert self.correct + self.retryable == self.calls, self


@pytest.fixture(scope="module")
def texts(bundled_model_dir) -> list[str]:
    words = [w.strip() for w in open(bundled_model_dir / "vocab.txt", encoding="utf-8")
             if w.strip().isalpha() and w.strip().islower() and len(w.strip()) > 2][:5000]
    rng = random.Random(1)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 24))) for _ in range(64)]


@pytest.fixture(scope="module")
def reference(texts, bundled_model_dir) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(bundled_model_dir), device="cpu")
    return model.encode(texts, batch_size=64, normalize_embeddings=True)


@pytest.fixture(scope="module", params=["standalone", "cluster"])
def stack(request):
    from fault_proxy import FaultProxy
    from service_stack import ServiceStack

    env = {"TOKQ_LEASE_MS": str(LEASE_MS), "TOKQ_REPLY_TTL_MS": str(REPLY_TTL_MS),
           "TOKQ_MAX_QUEUED_TOKENS": str(MAX_QUEUED_TOKENS)}
    if request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        for node in cluster.nodes:  # every node up (an earlier test may have killed one), flushed
            if not node.running:
                cluster.restart(node.port)
        cluster.flushall()
        # The cap is per shard: the same total as standalone, so the burst overloads it too.
        s = ServiceStack(env={**env, "TOKQ_QUEUE_SHARDS": str(CLUSTER_SHARDS),
                              "TOKQ_MAX_QUEUED_TOKENS": str(MAX_QUEUED_TOKENS // CLUSTER_SHARDS)},
                         cluster=cluster)
        s.gateway_proxy = s.worker_proxy = None
        s.shards = CLUSTER_SHARDS
    else:
        s = ServiceStack(env=env)
        s.gateway_proxy = FaultProxy(s.redis.url, seed=1).start()
        s.worker_proxy = FaultProxy(s.redis.url, seed=2).start()
        s.shards = 1
    try:
        s.start_gateway(redis_url=s.gateway_proxy and s.gateway_proxy.url)
        s.start_worker("w1", redis_url=s.worker_proxy and s.worker_proxy.url)
        yield s
    finally:
        s.close()
        for proxy in (s.gateway_proxy, s.worker_proxy):
            if proxy:
                proxy.close()
        if os.environ.get(RESULTS_ENV) and TABLE:
            write_results(Path(os.environ[RESULTS_ENV]), TABLE)


def needs_proxy(stack) -> None:
    if stack.cluster:
        pytest.skip("fault proxies and the Redis restart are standalone-only (see the module doc)")


def enqueued_items(stack) -> int:
    r = stack.client()
    return sum(int(r.hget(QueueKeys(shard_queue_name(KEYS.queue, i)).counters, "enqueued") or 0)
               for i in range(stack.shards))


def keys_left(stack, settle_s: float = 30) -> list[bytes]:
    """Keys of requests still in Redis once in-flight work and grace periods are over (waits
    up to ``settle_s``); the counters, budget, shard counts, worker registry and the metrics
    exporter's lock are not request keys."""
    r = stack.client()
    keep = re.compile(rb"^tokq:\{[^}]+\}:(counters|budget|shards|workers|heartbeat:.*|metrics-exporter)$")
    deadline = time.monotonic() + settle_s
    while True:
        found = r.keys("*", target_nodes="primaries") if stack.cluster else r.keys("*")
        left = [k for k in found if not keep.match(k)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


async def one_call(client, tally: Tally, texts, reference, rng: random.Random, *,
                   retryable: set[str], timeout_s: float = CALL_TIMEOUT_S) -> int:
    """One call of 1-4 inputs; its outcome counted in ``tally``. Returns the inputs sent."""
    idx = [rng.randrange(len(texts)) for _ in range(rng.randint(1, 4))]
    tally.calls += 1
    try:
        got = await asyncio.wait_for(client.embed([texts[i] for i in idx], timeout=timeout_s),
                                     timeout_s + HANG_MARGIN_S)
    except TokqError as exc:
        tally.codes[exc.code.name] += 1
        if exc.code.name in retryable:
            tally.retryable += 1
        elif exc.code.name == "DEADLINE_EXCEEDED":
            tally.lost += 1
        else:
            tally.wrong += 1
        return len(idx)
    except TimeoutError:
        tally.lost += 1
        tally.codes["HUNG"] += 1
        return len(idx)
    want = reference[idx]
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    if got.shape == want.shape and cos.min() >= 0.9999:
        tally.correct += 1
    else:
        tally.wrong += 1
    return len(idx)


async def run_calls(stack, tally: Tally, texts, reference, *, num_calls: int, concurrency: int,
                    retryable: set[str], timeout_s=lambda rng: CALL_TIMEOUT_S, seed: int = 0,
                    during=None, counters_survive: bool = True) -> None:
    """``num_calls`` calls from ``concurrency`` callers; ``during`` (a function) runs in a thread
    once the first calls are under way. Counts duplicates from the queue's counters."""
    before = enqueued_items(stack) if counters_survive else 0
    sent = 0
    rng = random.Random(seed)
    remaining = iter(range(num_calls))

    async with AsyncClient(stack.target) as client:
        async def caller():
            nonlocal sent
            for _ in remaining:
                n = await one_call(client, tally, texts, reference, rng, retryable=retryable,
                                   timeout_s=timeout_s(rng))
                sent += n  # not `sent += await ...`: that reads `sent` before the await

        callers = [asyncio.create_task(caller()) for _ in range(concurrency)]
        if during is not None:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(during)
        await asyncio.gather(*callers)
    if counters_survive:
        tally.duplicated = max(0, enqueued_items(stack) - before - sent)
    else:
        tally.duplicated = None


def record(tally: Tally, stack) -> None:
    if stack.cluster:
        tally.fault += f" (Redis Cluster, {stack.shards} shards)"
    TABLE.append(tally)
    tally.check()
    assert keys_left(stack) == []


def test_answers_lost_on_the_gateways_link(stack, texts, reference):
    needs_proxy(stack)
    stack.gateway_proxy.cut_rate(0.05)  # of enqueue, collect and cancel
    tally = Tally("answer lost after the command ran, gateway's link (5% of script calls)")
    try:
        asyncio.run(run_calls(stack, tally, texts, reference, num_calls=200, concurrency=16,
                              retryable={"UNAVAILABLE", "ABORTED"}))
    finally:
        stack.gateway_proxy.reset()
    assert stack.gateway_proxy.cuts > 0
    tally.fault += f": {stack.gateway_proxy.cuts} answers cut"
    record(tally, stack)


def test_an_enqueue_whose_every_answer_is_lost_is_unavailable_and_withdrawn(stack, texts, reference):
    needs_proxy(stack)
    from fault_proxy import script_sha

    stack.gateway_proxy.cut_rate(1.0, script_sha("enqueue"))  # it runs; no answer ever comes
    tally = Tally("every answer to enqueue lost (after redis-py's retries)")
    try:
        asyncio.run(run_calls(stack, tally, texts, reference, num_calls=10, concurrency=2,
                              retryable={"UNAVAILABLE"}))
    finally:
        stack.gateway_proxy.reset()
    assert tally.codes == {"UNAVAILABLE": 10}
    record(tally, stack)  # each was withdrawn: nothing computed for nobody, no key left


def test_answers_lost_on_the_workers_link(stack, texts, reference):
    needs_proxy(stack)
    stack.worker_proxy.cut_rate(0.05)  # of claim, ack, renew and requeue
    tally = Tally("answer lost after the command ran, worker's link (5% of script calls)")
    try:
        asyncio.run(run_calls(stack, tally, texts, reference, num_calls=200, concurrency=16,
                              retryable=set()))
    finally:
        stack.worker_proxy.reset()
    assert stack.worker_proxy.cuts > 0
    tally.fault += f": {stack.worker_proxy.cuts} answers cut"
    record(tally, stack)


def test_kill_9_of_a_worker(stack, texts, reference):
    stack.start_worker("w2")

    def kill():
        stack.signal_worker("w2", signal.SIGKILL)
        stack.workers.pop("w2").wait()

    tally = Tally("kill -9 of a worker under load")
    # Fewer calls on the cluster (its run counts toward make test's time); the kill comes 1 s in.
    asyncio.run(run_calls(stack, tally, texts, reference, num_calls=150 if stack.cluster else 300,
                          concurrency=16,
                          retryable=set(), during=kill))
    record(tally, stack)


def test_10x_overload_burst(stack, texts, reference):
    # Each call is up to 4 inputs of ~5-35 tokens: 400 at once are ~10x the queue's token cap.
    tally = Tally(f"10x overload burst (400 calls at once, cap {MAX_QUEUED_TOKENS} tokens in all)")
    asyncio.run(run_calls(stack, tally, texts, reference, num_calls=400, concurrency=400,
                          retryable={"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"},
                          timeout_s=lambda rng: 5.0))
    assert tally.codes["RESOURCE_EXHAUSTED"] > 0  # the burst really overloaded it
    record(tally, stack)


def test_deadline_storm(stack, texts, reference):
    tally = Tally("deadline storm (300 calls, deadlines 10-400 ms)")
    asyncio.run(run_calls(stack, tally, texts, reference, num_calls=300, concurrency=100,
                          retryable={"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"},
                          timeout_s=lambda rng: rng.uniform(0.01, 0.4)))
    assert tally.codes["DEADLINE_EXCEEDED"] > 0
    record(tally, stack)


def test_redis_restart(stack, texts, reference):
    needs_proxy(stack)
    def restart():
        stack.redis.stop()  # no persistence: queued work and replies are gone, as in a crash
        time.sleep(0.5)
        stack.redis.start()

    tally = Tally("Redis restart under load (state lost)")
    asyncio.run(run_calls(stack, tally, texts, reference, num_calls=200, concurrency=16,
                          retryable={"UNAVAILABLE"}, during=restart, counters_survive=False))
    record(tally, stack)


def test_kill_9_of_the_gateway_mid_request(stack, texts, reference):
    def kill_and_restart():
        stack.kill_gateway()
        stack.start_gateway(redis_url=stack.gateway_proxy and stack.gateway_proxy.url)

    tally = Tally("kill -9 of the gateway mid-request, then a new one")
    # Calls cut off by the kill, and those sent while no gateway listens, are UNAVAILABLE.
    asyncio.run(run_calls(stack, tally, texts, reference, num_calls=200, concurrency=16,
                          retryable={"UNAVAILABLE"}, during=kill_and_restart,
                          timeout_s=lambda rng: 10.0))
    record(tally, stack)  # the dead gateway's replies expire with their deadline + reply TTL
    after = Tally("after")
    asyncio.run(run_calls(stack, after, texts, reference, num_calls=20, concurrency=4,
                          retryable=set()))
    assert after.correct == 20


# -- the RESULTS.md table --------------------------------------------------------------------


def write_results(path: Path, table: list[Tally]) -> None:
    from tokq.profiling.results_md import shared_machine_note, write_section

    body = [
        "One gateway and one worker (plus a second, killed, in the worker scenario), each behind "
        "its own fault proxy on a standalone Redis; on the Redis Cluster (3 primaries + 3 "
        f"replicas) without proxies, the queue in {CLUSTER_SHARDS} shards; lease {LEASE_MS} ms, queue cap {MAX_QUEUED_TOKENS} tokens; calls of "
        "1-4 inputs checked against the model run alone (cosine >= 0.9999). Lost = hung, or no "
        "answer by a deadline the scenario did not cause; wrong = wrong vectors or a status that "
        "is not retryable; duplicated = items queued beyond those sent. "
        + shared_machine_note(),
        "",
        "| fault | calls | answered correctly | retryable errors | lost | wrong | duplicated |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for t in table:
        codes = ", ".join(f"{c} {n}" for c, n in sorted(t.codes.items()))
        dup = "n/a (counters lost)" if t.duplicated is None else str(t.duplicated)
        body.append(f"| {t.fault} | {t.calls} | {t.correct} | {t.retryable}"
                    f"{f' ({codes})' if codes else ''} | {t.lost} | {t.wrong} | {dup} |")
    write_section(path, "faults", "Faults survived",
                  f"{RESULTS_ENV}=profiling/RESULTS.md .venv/bin/python -m pytest -q "
                  "tests/test_faults.py -p no:cacheprovider", body)
