"""The service end to end: real Redis, real gRPC on loopback, real worker processes, the bundled
all-MiniLM-L6-v2. Tests run in file order against one deployment (starting it is the slow part)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from service_stack import delivered_reply

from tokq import Client, TokqError
from tokq.queue.keys import QueueKeys
from tokq.model.info import ModelInfo

pytestmark = pytest.mark.slow
KEYS = QueueKeys(ModelInfo.load().queue_name)


def make_texts(n: int, seed: int, bundled_model_dir) -> list[str]:
    words = [w.strip() for w in open(bundled_model_dir / "vocab.txt", encoding="utf-8")
             if w.strip().isalpha() and w.strip().islower() and len(w.strip()) > 2][:20000]
    rng = random.Random(seed)
    lengths = [min(200, max(1, int(rng.lognormvariate(2.0, 0.8)))) for _ in range(n)]
    return [" ".join(rng.choice(words) for _ in range(k)) for k in lengths]


@pytest.fixture(scope="module")
def reference(bundled_model_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(bundled_model_dir), device="cpu")
    return lambda texts: model.encode(texts, batch_size=64, normalize_embeddings=True)


@pytest.fixture(scope="module")
def stack():
    from service_stack import gateway_and_worker

    # Short leases so a killed worker's batch is redone quickly; a small token cap to test overload.
    # The gateway reaches Redis through its Unix socket (unix://), the workers over TCP: every test
    # below runs on both kinds of URL, against one server.
    with gateway_and_worker(env={"TOKQ_LEASE_MS": "1500", "TOKQ_MAX_QUEUED_TOKENS": "40000"},
                            gateway_over_unix_socket=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.target) as c:
        yield c


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999, f"min cosine {cos.min()}"


def no_request_keys_left(stack, settle_s: float = 15) -> list[bytes]:
    """Request keys still in Redis once the workers have finished what they hold and dropped
    what is left of cancelled requests (at their next claim: a resumed worker may not have
    claimed yet)."""
    r = stack.client()
    deadline = time.monotonic() + settle_s
    while ((int(r.get(KEYS.inflight) or 0) or r.llen(KEYS.pending) or r.llen(KEYS.heavy))
           and time.monotonic() < deadline):
        time.sleep(0.05)
    left = [k for k in r.scan_iter(match=f"{KEYS.base}:*")
            if (b":reply:" in k and not delivered_reply(r, k)) or b":lease:" in k]
    for lane in (KEYS.pending, KEYS.heavy):
        if r.llen(lane):
            left.append(lane.encode())
    return left


@pytest.mark.parametrize("n", [1, 7, 300])
def test_embeddings_match_sentence_transformers_one_worker(client, reference, bundled_model_dir, n):
    texts = make_texts(n, seed=n, bundled_model_dir=bundled_model_dir)
    assert_close(client.embed(texts, timeout=60), reference(texts))


def test_embed_full_returns_usage_and_timing(client, reference, bundled_model_dir):
    texts = make_texts(3, seed=21, bundled_model_dir=bundled_model_dir)
    full = client.embed_full(texts, timeout=60)
    assert_close(full.vectors, reference(texts))
    assert full.model == "all-MiniLM-L6-v2"
    assert full.prompt_tokens == sum(len(ids) for ids in client.tokenize(texts))
    t = full.timing
    assert t["tokenize_ms"] > 0 and t["queue_ms"] >= 0 and t["inference_ms"] > 0
    assert t["total_ms"] >= t["tokenize_ms"] + t["inference_ms"], t


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_the_gateway_process_runs_its_helper_threads_as_batch_threads(stack, client):
    client.embed(["hello"])  # every gRPC thread has started
    pid = stack.gateway.pid
    policies = {}
    for name in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{name}/comm") as f:
            policies[int(name)] = (f.read().strip(), os.sched_getscheduler(int(name)))
    assert policies.pop(pid)[1] == os.SCHED_OTHER  # the main thread runs the event loop
    # gRPC core's threads (event_engine, grpc_global_timer, ...), its completion-queue poller and
    # the tokenizer's pools (tests/gateway/test_helper_threads_run_sched_batch.py tells them apart)
    assert any(comm != "python" for comm, _ in policies.values()), policies
    assert all(p == os.SCHED_BATCH for _, p in policies.values()), policies


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is not a dependency on Windows")
def test_the_gateway_process_runs_on_uvloop_by_default(stack, client):
    client.embed(["hello"])
    with open(f"/proc/{stack.gateway.pid}/maps") as f:
        assert "uvloop" in f.read()  # its extension module is loaded: the loop it runs on

def test_info_and_tokenize(stack, client, bundled_model_dir):
    info = client.info(timeout=5)
    assert (info.model, info.dimensions, info.max_input_length) == ("all-MiniLM-L6-v2", 384, 256)
    assert (info.max_inputs, info.token_budget) == (512, 0)  # the default cap; no budget published
    # A published budget (tokq profile --apply) is the one Info reports: here the worker's own,
    # so publishing it changes nothing for the module's other tests.
    r = stack.client()
    worker_id = next(iter(stack.workers))
    budget = json.loads(r.get(stack.keys.heartbeat(worker_id)))["token_budget"]
    r.set(stack.keys.budget, budget)
    try:
        assert client.info(timeout=5).token_budget == budget > 0
    finally:
        r.delete(stack.keys.budget)
        r.close()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundled_model_dir))
    assert client.tokenize(["hello world"]) == [tok("hello world")["input_ids"]]


def test_grpc_health_and_reflection(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stack.wait_ready()  # the readiness check has seen the worker's heartbeat

    with grpc.insecure_channel(stack.target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tokq.v1.Embedder"), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"tokq.v1.Embedder", "grpc.health.v1.Health"} <= names


def test_dimensions_prompt_and_normalize_options(client, reference, bundled_model_dir):
    texts = make_texts(5, seed=11, bundled_model_dir=bundled_model_dir)
    full = reference(texts)
    cut = client.embed(texts, dimensions=64)
    want = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    assert_close(cut, want)
    raw = client.embed(texts, normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)
    assert_close(raw / np.linalg.norm(raw, axis=1, keepdims=True), full)


def test_two_workers_share_a_request(stack, client, reference, bundled_model_dir):
    stack.start_worker("w2", "--token-budget", "128")
    texts = make_texts(300, seed=3, bundled_model_dir=bundled_model_dir)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: client.embed(texts, timeout=120), range(4)))
    want = reference(texts)
    for out in outs:
        assert_close(out, want)
    r = stack.client()
    # Read from the heartbeats, written every 2 s: on a fast machine the calls end within one beat.
    deadline = time.monotonic() + 15
    while True:
        batches = {w: json.loads(r.get(KEYS.heartbeat(w)))["batches"] for w in ("w1", "w2")}
        if all(n > 0 for n in batches.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(n > 0 for n in batches.values()), batches


def test_200_concurrent_calls_all_answered_correctly(stack, client, reference, bundled_model_dir):
    texts = make_texts(200, seed=5, bundled_model_dir=bundled_model_dir)
    want = reference(texts)
    with ThreadPoolExecutor(200) as pool:
        got = list(pool.map(lambda t: client.embed([t], timeout=120)[0], texts))
    assert_close(np.stack(got), want)
    assert no_request_keys_left(stack) == []


def test_thousands_of_concurrent_calls_use_a_bounded_number_of_redis_connections(stack, bundled_model_dir):
    import asyncio

    from tokq import AsyncClient

    texts = make_texts(50, seed=17, bundled_model_dir=bundled_model_dir)
    r = stack.client()
    peak = 0

    async def run():
        nonlocal peak
        async with AsyncClient(stack.target) as client:
            calls = [asyncio.create_task(client.embed([texts[i % 50]], timeout=120)) for i in range(2000)]
            while not all(c.done() for c in calls):
                peak = max(peak, r.info("clients")["connected_clients"])
                await asyncio.sleep(0.05)
            return [c.result() for c in calls]

    out = asyncio.run(run())
    assert len(out) == 2000 and all(v.shape == (1, 384) for v in out)
    # gateway pool (32) + its subscription + its readiness check + 8 per worker (2 running) + this test's client
    assert peak <= 32 + 1 + 1 + 8 * len(stack.workers) + 1, peak


@pytest.mark.parametrize("call, code, needle", [
    (dict(texts=[]), "INVALID_ARGUMENT", "empty"),
    (dict(texts=["ok", ""]), "INVALID_ARGUMENT", "input 1"),
    (dict(texts=["x"] * 513), "INVALID_ARGUMENT", "limit is 512"),
    (dict(texts=["word " * 400]), "INVALID_ARGUMENT", "at most 256 tokens"),
    (dict(texts=["hi"], dimensions=0), "INVALID_ARGUMENT", "dimensions"),
    (dict(texts=["hi"], dimensions=385), "INVALID_ARGUMENT", "1..384"),
    (dict(texts=["hi"], prompt_name="query"), "INVALID_ARGUMENT", "prompt_name"),
])
def test_bad_requests_get_invalid_argument_and_service_still_serves(client, call, code, needle):
    texts = call.pop("texts")
    with pytest.raises(TokqError) as err:
        client.embed(texts, timeout=10, **call)
    assert err.value.code.name == code and needle in err.value.message, err.value
    assert client.embed(["still serving"], timeout=30).shape == (1, 384)


def test_token_id_inputs_embed_like_their_text(stack, client, reference):
    from tokq.v1 import embedder_pb2 as pb
    from tokq.v1 import embedder_pb2_grpc as pb_grpc

    texts = ["caller tokenized this", "and this one too"]
    ids = client.tokenize(texts)
    with grpc.insecure_channel(stack.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        reply = stub.Embed(pb.EmbedRequest(token_inputs=[pb.TokenIds(ids=seq) for seq in ids]), timeout=30)
        got = np.array([e.values for e in reply.embeddings], dtype=np.float32)
        assert_close(got, reference(texts))
        assert reply.usage.prompt_tokens == sum(len(seq) for seq in ids)
        long = pb.TokenIds(ids=ids[0][:1] + [2000] * 300)
        cut = stub.Embed(pb.EmbedRequest(token_inputs=[long], truncate=True), timeout=30)
        assert cut.usage.prompt_tokens == 256  # cut to the model's limit, like text
        for bad, needle in [(pb.EmbedRequest(token_inputs=[pb.TokenIds(ids=[101, 30522])]), "30522"),
                            (pb.EmbedRequest(token_inputs=[long]), "at most 256"),
                            (pb.EmbedRequest(token_inputs=[pb.TokenIds(ids=[])]), "no token ids"),
                            (pb.EmbedRequest(inputs=["x"], token_inputs=[pb.TokenIds(ids=[101])]), "not both")]:
            with pytest.raises(grpc.RpcError) as err:
                stub.Embed(bad, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()


def test_unknown_model_is_not_found(stack):
    with Client(stack.target, model="no-such-model") as c, pytest.raises(TokqError) as err:
        c.embed(["hi"], timeout=10)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "no-such-model" in err.value.message


def test_truncate_cuts_over_long_input(client, reference):
    long_text = "embedding " * 400
    got = client.embed([long_text], truncate=True, timeout=30)
    assert_close(got, reference([long_text]))  # sentence-transformers truncates at 256 too


def test_deadline_exceeded_and_overload_leave_nothing_behind(stack, client):
    for w in list(stack.workers):
        stack.signal_worker(w, signal.SIGSTOP)  # nobody claims: calls can only time out
    try:
        with pytest.raises(TokqError) as err:
            client.embed(["nobody will answer this"], timeout=0.5)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # Fill the queue past its 40,000-token cap with calls that wait; the next is rejected whole.
        big = ["token " * 120] * 100  # ~12,200 tokens a request
        waiting = ThreadPoolExecutor(4)
        futures = [waiting.submit(client.embed, big, timeout=4) for _ in range(4)]
        time.sleep(1.5)
        with pytest.raises(TokqError) as err:
            client.embed(big, timeout=5)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        codes = []
        for f in futures:
            with pytest.raises(TokqError) as e:
                f.result()
            codes.append(e.value.code)
        assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    finally:
        for w in list(stack.workers):
            stack.signal_worker(w, signal.SIGCONT)
    assert no_request_keys_left(stack) == []
    assert int(stack.client().get(KEYS.tokens) or 0) == 0
    assert client.embed(["served again"], timeout=30).shape == (1, 384)


def test_a_request_whose_state_vanishes_fails_unavailable_not_at_its_deadline(stack, client):
    for w in list(stack.workers):
        stack.signal_worker(w, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(client.embed, ["lost in a Redis restart"], timeout=60)
            r = stack.client()
            # Earlier tests' answered replies linger a short grace (delivered_reply): wait for
            # this call's own, still unanswered, reply hash.
            for _ in range(400):  # the request is queued within 20 s
                waiting = [k for k in r.scan_iter(match=f"{KEYS.base}:reply:*") if not delivered_reply(r, k)]
                if waiting:
                    break
                time.sleep(0.05)
            assert waiting, "the call was never queued"
            for key in waiting:  # what a flush would do
                r.delete(key)
            with pytest.raises(TokqError) as err:
                call.result(timeout=20)  # the poll notices within a few seconds, not at 60 s
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "vanished" in err.value.message
    finally:
        for w in list(stack.workers):
            stack.signal_worker(w, signal.SIGCONT)
    assert no_request_keys_left(stack) == []


def _load(client, texts, reference_vectors, stop: threading.Event, errors: list, done: list) -> None:
    i = 0
    while not stop.is_set():
        k = 1 + i % 9
        idx = [(i * 7 + j) % len(texts) for j in range(k)]
        try:
            got = client.embed([texts[j] for j in idx], timeout=60)
            assert_close(got, reference_vectors[idx])
            done.append(k)
        except Exception as exc:  # noqa: BLE001 - every failure is a test failure
            errors.append(exc)
        i += 1


@contextlib.contextmanager
def under_load(client, texts, reference_vectors, num_callers: int = 8):
    """Eight callers checking every answer while the body runs; yields (errors, done) lists."""
    stop, errors, done = threading.Event(), [], []
    threads = [threading.Thread(target=_load, args=(client, texts, reference_vectors, stop, errors, done))
               for _ in range(num_callers)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        yield errors, done
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_kill_9_of_a_worker_under_load_loses_nothing(stack, client, reference, bundled_model_dir):
    texts = make_texts(120, seed=9, bundled_model_dir=bundled_model_dir)
    with under_load(client, texts, reference(texts)) as (errors, done):
        stack.signal_worker("w2", signal.SIGKILL)
        stack.workers.pop("w2").wait()
        time.sleep(4)  # past the 1.5 s lease: w2's batches are redone by w1
    assert errors == [] and len(done) > 20
    assert no_request_keys_left(stack) == []
    assert int(stack.client().get(KEYS.inflight) or 0) == 0


def test_sigterm_to_a_worker_under_load_loses_nothing(stack, client, reference, bundled_model_dir):
    # README: on SIGTERM a worker stops claiming, finishes and acknowledges the batches in hand,
    # and exits: nothing of its is left to be redone when its lease runs out.
    stack.start_worker("w3")
    r = stack.client()
    texts = make_texts(120, seed=13, bundled_model_dir=bundled_model_dir)
    with under_load(client, texts, reference(texts)) as (errors, done):
        requeued = int(r.hget(KEYS.counters, "requeued") or 0)
        assert stack.stop_worker("w3") == 0
        time.sleep(1)
    assert errors == [] and len(done) > 20
    assert not r.exists(KEYS.heartbeat("w3"))
    assert no_request_keys_left(stack) == []
    time.sleep(2)  # past the 1.5 s lease of anything w3 might have left behind
    assert int(r.hget(KEYS.counters, "requeued") or 0) == requeued
    assert r.zcard(KEYS.leases) == 0


def test_worker_check_reports_liveness(stack):
    import subprocess
    import sys

    def check(worker_id, flag=True):
        args, env = ["--worker-id", worker_id], os.environ
        if not flag:
            args, env = [], {**os.environ, "TOKQ_WORKER_ID": worker_id}
        return subprocess.run([sys.executable, "-m", "tokq.cli", "worker", "--check", *args,
                               "--redis-url", url], capture_output=True, env=env).returncode

    url = stack.redis.url
    assert check("w1") == 0
    url = stack.redis.unix_url
    assert check("w1") == 0
    assert check("w3") == 1  # stopped above
    assert check("w3", flag=False) == 1  # TOKQ_WORKER_ID names it too (any worker is alive: w1)


def test_redis_down_is_unavailable_promptly_and_service_recovers(stack, client):
    stack.redis.stop()
    try:
        start = time.monotonic()
        with pytest.raises(TokqError) as err:
            client.embed(["redis is down"], timeout=20)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
        elapsed = time.monotonic() - start
    finally:
        stack.redis.start()
    assert elapsed < 10  # it failed on its own, long before the 20 s deadline
    deadline = time.monotonic() + 30
    while True:
        try:
            assert client.embed(["back again"], timeout=10).shape == (1, 384)
            break
        except TokqError:
            assert time.monotonic() < deadline, "service did not recover after Redis came back"
            time.sleep(0.5)
