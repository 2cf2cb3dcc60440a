"""Faults production inflicts, injected into a real deployment: a real Redis, a gateway process
and worker processes (tests/service_stack.py), the bundled model, real gRPC callers.

On a standalone Redis, the gateway and the first worker reach Redis through their own fault
proxy (tokq/testing/fault_proxy.py), which can let a command run and lose its answer. Every scenario
runs again on a real 3+3 Redis Cluster of this module's own, the queue in 3 shards over its
nodes: each node announces the port of a fault proxy in front of it, so the gateway's and
workers' cluster clients (which find the nodes through CLUSTER SLOTS and MOVED) reach every node
only through a proxy; there the two links share the proxies and are told apart by the scripts
each side runs. The cluster's "Redis restart" is a kill -9 of a primary holding a queue shard:
its replica takes over, then the killed node starts again and rejoins as a replica. Each
scenario sends a bounded number of calls and checks that every call got exactly one answer: the
right vectors (compared with the model run alone) or a retryable status the scenario explains;
that no call hung (every wait is bounded); that nothing was queued twice; and that no request
key is left in Redis afterwards.

``TOKQ_FAULTS_RESULTS=profiling/results/service.md`` makes the module rewrite that file's "Faults
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
from tokq.queue.keys import QueueKeys, shard_queue_name
from tokq.model.info import ModelInfo

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
# The scripts each side runs: on the cluster, what tells the gateway's link from the workers'.
GATEWAY_SCRIPTS = ("enqueue", "collect", "cancel")
WORKER_SCRIPTS = ("claim", "ack", "renew", "requeue", "heartbeat")


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


@pytest.fixture(scope="module")
def proxied_cluster():
    """A 3+3 Redis Cluster whose every node announces a fault proxy's port in place of its own
    (its cluster bus stays direct, so gossip and failover are untouched)."""
    from tokq.testing.fault_proxy import FaultProxy
    from tokq.testing.cluster import LocalCluster

    proxies: list[FaultProxy] = []

    def announce(port: int) -> int:
        proxies.append(FaultProxy(f"redis://127.0.0.1:{port}/0", seed=len(proxies)).start())
        return proxies[-1].port

    cluster = LocalCluster(binary=os.environ.get("TOKQ_TEST_REDIS_SERVER") or None,
                           announce_port=announce)
    try:
        cluster.start()
        cluster.proxies = proxies
        yield cluster
    finally:
        cluster.close()
        for proxy in proxies:
            proxy.close()


@pytest.fixture(scope="module", params=["standalone", "cluster"])
def stack(request):
    from tokq.testing.fault_proxy import FaultProxy, script_sha
    from service_stack import ServiceStack

    env = {"TOKQ_LEASE_MS": str(LEASE_MS), "TOKQ_REPLY_TTL_MS": str(REPLY_TTL_MS),
           "TOKQ_MAX_QUEUED_TOKENS": str(MAX_QUEUED_TOKENS)}
    if request.param == "cluster":
        cluster = request.getfixturevalue("proxied_cluster")
        # The cap is per shard: the same total as standalone, so the burst overloads it too.
        s = ServiceStack(env={**env, "TOKQ_QUEUE_SHARDS": str(CLUSTER_SHARDS),
                              "TOKQ_MAX_QUEUED_TOKENS": str(MAX_QUEUED_TOKENS // CLUSTER_SHARDS)},
                         cluster=cluster)
        s.gateway_proxy = s.worker_proxy = None
        s.links = {"gateway": (cluster.proxies, tuple(script_sha(n) for n in GATEWAY_SCRIPTS)),
                   "worker": (cluster.proxies, tuple(script_sha(n) for n in WORKER_SCRIPTS))}
        s.shards = CLUSTER_SHARDS
    else:
        s = ServiceStack(env=env)
        s.gateway_proxy = FaultProxy(s.redis.url, seed=1).start()
        s.worker_proxy = FaultProxy(s.redis.url, seed=2).start()
        s.links = {"gateway": ([s.gateway_proxy], b"EVALSHA"),
                   "worker": ([s.worker_proxy], b"EVALSHA")}
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


def cut_link(stack, link: str, fraction: float, only: bytes | None = None) -> int:
    """Lose the answers of ``fraction`` of the script calls on the gateway's or the workers'
    link (0: stop); ``only``: just those of one script. Returns the answers cut so far there."""
    proxies, match = stack.links[link]
    for proxy in proxies:
        if fraction:
            proxy.cut_rate(fraction, only or match)
        else:
            proxy.reset()
    return sum(proxy.cuts for proxy in proxies)


def enqueued_items(stack) -> int:
    r = stack.client()
    return sum(int(r.hget(QueueKeys(shard_queue_name(KEYS.queue, i)).counters, "enqueued") or 0)
               for i in range(stack.shards))


def keys_left(stack, settle_s: float = 30) -> list[bytes]:
    """Keys of requests still in Redis once in-flight work and grace periods are over (waits
    up to ``settle_s``); the counters, budget, shard counts, worker registries and the metrics
    exporter's lock are not request keys, nor a cancelled request's mark (set where its enqueue's
    answer was lost; it expires by itself, tests/queue_support.keys_left checks how soon)."""
    r = stack.client()
    keep = re.compile(
        rb"^tokq:\{[^}]+\}:(counters|budget|shards|workers|idle|heartbeat:.*|metrics-exporter|cancelled:.*)$")
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
                    during=None, calls_outlast_during: bool = False,
                    counters_survive: bool = True) -> None:
    """``num_calls`` calls from ``concurrency`` callers; ``during`` (a function) runs in a thread
    once the first calls are under way (with ``calls_outlast_during``, calls go on until it has
    returned, however many that takes, each caller pausing 0.1 s after a failed call as a
    client backs off). Counts duplicates from the queue's counters."""
    before = enqueued_items(stack) if counters_survive else 0
    sent = 0
    rng = random.Random(seed)
    started = 0
    during_done = during is None or not calls_outlast_during

    async with AsyncClient(stack.target) as client:
        async def caller():
            nonlocal sent, started
            while started < num_calls or not during_done:
                started += 1
                correct = tally.correct
                n = await one_call(client, tally, texts, reference, rng, retryable=retryable,
                                   timeout_s=timeout_s(rng))
                sent += n  # not `sent += await ...`: that reads `sent` before the await
                if not during_done and tally.correct == correct:
                    await asyncio.sleep(0.1)

        callers = [asyncio.create_task(caller()) for _ in range(concurrency)]
        if during is not None:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(during)
            during_done = True
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
    before = cut_link(stack, "gateway", 0.05)  # of enqueue, collect and cancel
    tally = Tally("answer lost after the command ran, gateway's link (5% of script calls)")
    try:
        asyncio.run(run_calls(stack, tally, texts, reference, num_calls=200, concurrency=16,
                              retryable={"UNAVAILABLE"}))
    finally:
        cuts = cut_link(stack, "gateway", 0) - before
    assert cuts > 0
    tally.fault += f": {cuts} answers cut"
    record(tally, stack)


def test_an_enqueue_whose_every_answer_is_lost_is_unavailable_and_cancelled(stack, texts, reference):
    from tokq.testing.fault_proxy import script_sha

    cut_link(stack, "gateway", 1.0, only=script_sha("enqueue"))  # it runs; no answer ever comes
    tally = Tally("every answer to enqueue lost (after redis-py's retries)")
    try:
        asyncio.run(run_calls(stack, tally, texts, reference, num_calls=10, concurrency=2,
                              retryable={"UNAVAILABLE"}))
    finally:
        cut_link(stack, "gateway", 0)
    assert tally.codes == {"UNAVAILABLE": 10}
    record(tally, stack)  # each was cancelled: nothing computed for nobody, no key left


def test_answers_lost_on_the_workers_link(stack, texts, reference):
    before = cut_link(stack, "worker", 0.05)  # of claim, ack, renew, requeue and heartbeat
    tally = Tally("answer lost after the command ran, worker's link (5% of script calls)")
    try:
        asyncio.run(run_calls(stack, tally, texts, reference, num_calls=200, concurrency=16,
                              retryable=set()))
    finally:
        cuts = cut_link(stack, "worker", 0) - before
    assert cuts > 0
    tally.fault += f": {cuts} answers cut"
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
    if stack.cluster:
        pytest.skip("the cluster's restart is test_kill_9_of_a_primary_then_it_rejoins")

    def restart():
        stack.redis.stop()  # no persistence: queued work and replies are gone, as in a crash
        time.sleep(0.5)
        stack.redis.start()

    tally = Tally("Redis restart under load (state lost)")
    asyncio.run(run_calls(stack, tally, texts, reference, num_calls=200, concurrency=16,
                          retryable={"UNAVAILABLE"}, during=restart, counters_survive=False))
    record(tally, stack)


def test_kill_9_of_a_primary_then_it_rejoins(stack, texts, reference):
    """The cluster's Redis restart: the primary holding a queue shard dies (writes it had not
    yet sent its replica are lost), the replica takes over, the dead node starts again and
    rejoins as the new primary's replica. Calls go on throughout."""
    if not stack.cluster:
        pytest.skip("a cluster failover (the standalone restart is test_redis_restart)")
    cluster = stack.cluster
    shard_key = QueueKeys(shard_queue_name(KEYS.queue, 1)).pending
    victim = cluster.owner_port(shard_key)
    roles = {}

    def kill_fail_over_rejoin():
        cluster.kill(victim)
        cluster.wait_ok(timeout_s=60)  # the replica took over its slots
        roles["new primary"] = cluster.owner_port(shard_key)
        time.sleep(2.0)  # calls run on the new primary
        cluster.restart(victim, timeout_s=60)  # back, and a replica once wait_ok passes
        roles["replicas"] = cluster.replica_ports_of(roles["new primary"])

    tally = Tally("kill -9 of a primary holding a queue shard, failover, it rejoins as a replica")
    asyncio.run(run_calls(stack, tally, texts, reference, num_calls=200, concurrency=16,
                          retryable={"UNAVAILABLE"}, during=kill_fail_over_rejoin,
                          calls_outlast_during=True))
    assert roles["new primary"] != victim and victim in roles["replicas"], roles
    record(tally, stack)
    after = Tally("after")
    asyncio.run(run_calls(stack, after, texts, reference, num_calls=20, concurrency=4,
                          retryable=set()))
    assert after.correct == 20


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


# -- the results table --------------------------------------------------------------------


def write_results(path: Path, table: list[Tally]) -> None:
    from tokq.profiling.results_md import shared_machine_note, write_section

    body = [
        "One gateway and one worker (plus a second, killed, in the worker scenario), each behind "
        "its own fault proxy on a standalone Redis; on the Redis Cluster (3 primaries + 3 "
        "replicas), every node announcing a fault proxy in front of it (the gateway's and "
        "workers' links told apart by the scripts each runs), the queue in "
        f"{CLUSTER_SHARDS} shards; lease {LEASE_MS} ms, queue cap {MAX_QUEUED_TOKENS} tokens; calls of "
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
                  f"{RESULTS_ENV}=profiling/results/service.md .venv/bin/python -m pytest -q "
                  "tests/faults/test_faults_survived.py -p no:cacheprovider", body)
