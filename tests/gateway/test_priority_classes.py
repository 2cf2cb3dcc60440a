"""A call's priority class reaches the queue: the request's own (gRPC's Priority enum, HTTP's
"priority"), else its API key's default, else interactive; an unknown class is refused
(INVALID_ARGUMENT, HTTP 400) with nothing written to Redis.

Two layers:
- A real gateway in this process whose ``Producer.enqueue`` records the ``priority=`` it is given
  and answers "queue full": every transport, key default and override, `tokq embed`, a request
  large enough for the large-request lane, and the metrics' priority label.
- A real gateway, worker and Redis (service_stack): with the worker stopped, a batch call's items
  wait in the batch lane and an interactive call's in the light lane; let go, both are answered.
  The openai SDK sends the class with ``extra_body``.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import httpx
import pytest
from click.testing import CliRunner
from gateway_support import record_enqueues, left_for_the_gc, running_gateway
from prometheus_client import REGISTRY
from service_stack import gateway_and_worker

from tokq import Client, TokqError
from tokq.client_cli import embed_command
from tokq.redis.embedded import free_port
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc

MODEL = "all-MiniLM-L6-v2"
# Keys without a default, with batch, with interactive: what each call is queued in, by the
# request's own class (None: unset).
KEYS = ("plain-key", "bulk-key priority=batch", "live-key priority=interactive")
MATRIX = [("plain-key", None, "interactive"), ("plain-key", "batch", "batch"),
          ("plain-key", "interactive", "interactive"), ("bulk-key", None, "batch"),
          ("bulk-key", "interactive", "interactive"), ("bulk-key", "batch", "batch"),
          ("live-key", None, "interactive"), ("live-key", "batch", "batch")]


@pytest.fixture
def enqueued(monkeypatch):
    return record_enqueues(monkeypatch)


@pytest.fixture
def gateway(redis_url):
    http_port = free_port()
    with running_gateway(redis_url, http_port=http_port, api_keys=KEYS) as port:
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"


def _count(rpc: str, code: str, priority: str) -> float:
    return REGISTRY.get_sample_value("tokq_gateway_requests_total", {
        "model": MODEL, "rpc": rpc, "code": code, "priority": priority}) or 0.0


def test_grpc_calls_are_queued_in_their_own_class_else_their_keys_else_interactive(gateway, enqueued):
    target, _ = gateway
    before = {p: _count("Embed", "RESOURCE_EXHAUSTED", p) for p in ("interactive", "batch")}
    for key, asked, want in MATRIX:
        with Client(target, api_key=key) as client, pytest.raises(TokqError) as err:
            client.embed(["red shoes"], priority=asked, timeout=10)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert enqueued[-1] == want, (key, asked)
    assert len(enqueued) == len(MATRIX)
    deadline = time.monotonic() + 10  # counted on the gateway's thread, after the answer
    while True:
        added = {p: _count("Embed", "RESOURCE_EXHAUSTED", p) - before[p] for p in before}
        if sum(added.values()) >= len(MATRIX) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert added == {"interactive": 4, "batch": 4}


def test_http_bodies_are_queued_in_their_own_class_else_their_keys_else_interactive(gateway, enqueued):
    _, http_url = gateway
    for key, asked, want in MATRIX:
        body = {"input": ["red shoes"]} | ({"priority": asked} if asked else {})
        reply = httpx.post(f"{http_url}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {key}"},
                           timeout=30)
        assert reply.status_code == 429, reply.text
        assert enqueued[-1] == want, (key, asked)
    assert len(enqueued) == len(MATRIX)


def test_tokq_embed_priority_reaches_the_queue(gateway, enqueued):
    target, _ = gateway
    for args, want in [([], "interactive"), (["--priority", "batch"], "batch")]:
        result = CliRunner().invoke(embed_command, ["--target", target, *args, "hello"],
                                    env={"TOKQ_API_KEY": "plain-key"})
        assert result.exit_code == 1 and "RESOURCE_EXHAUSTED" in result.output, result.output
        assert enqueued[-1] == want
    CliRunner().invoke(embed_command, ["--target", target, "hello"], env={"TOKQ_API_KEY": "bulk-key"})
    assert enqueued[-1] == "batch"  # the key's default, as for any other client


def test_a_large_request_tokenized_in_the_large_lane_keeps_its_class(gateway, enqueued):
    target, _ = gateway
    texts = [f"page {i} " + "lorem ipsum dolor sit amet " * 200 for i in range(40)]  # ~220 KB: the large lane
    with Client(target, api_key="plain-key") as client:
        for asked in ("batch", "interactive"):
            with pytest.raises(TokqError, match="RESOURCE_EXHAUSTED"):
                client.embed(texts, truncate=True, priority=asked, timeout=30)
            assert enqueued[-1] == asked
    with Client(target, api_key="bulk-key") as client, pytest.raises(TokqError):
        client.embed(texts, truncate=True, timeout=30)
    assert enqueued[-1] == "batch"


def test_an_unknown_class_is_refused_before_anything_is_enqueued(gateway, enqueued):
    target, http_url = gateway
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        metadata = (("authorization", "Bearer bulk-key"),)
        for value in (3, 7, 1000):  # numbers the enum does not define (a proto3 enum keeps them)
            with pytest.raises(grpc.RpcError) as err:
                stub.Embed(pb.EmbedRequest(inputs=["x"], priority=value), timeout=10, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == (f"priority {value} is not a tokq.v1.Priority: send INTERACTIVE (1) "
                                           "or BATCH (2), or leave it unset for the API key's default")

        def refused():
            with pytest.raises(grpc.RpcError):
                stub.Embed(pb.EmbedRequest(inputs=["x"], priority=3), timeout=10, metadata=metadata)
        assert left_for_the_gc(refused) == []  # freed at once, as gateway.errors.refuse wants
    for value in ("BATCH", "urgent", "", 2, True, ["batch"], {"class": "batch"}):
        reply = httpx.post(f"{http_url}/v1/embeddings", json={"input": "x", "priority": value},
                           headers={"Authorization": "Bearer plain-key"}, timeout=30)
        assert reply.status_code == 400, (value, reply.text)
        error = reply.json()["error"]
        assert error["param"] == "priority" and error["code"] == "invalid_argument"
        assert error["message"].startswith('priority must be "interactive" or "batch", got ')
    assert enqueued == []


# -- a real gateway, worker and Redis -----------------------------------------------------------

STACK_KEYS = "live-key,bulk-key priority=batch"


@pytest.fixture(scope="module")
def stack():
    with gateway_and_worker("--metrics-port", str(free_port()), env={"TOKQ_API_KEYS": STACK_KEYS},
                            http=True) as s:
        yield s


def _lanes(stack) -> dict[str, int]:
    r = stack.client()
    keys = stack.keys
    return {"light": r.llen(keys.pending), "heavy": r.llen(keys.heavy), "batch": r.llen(keys.batch)}


def queued_while_stopped(stack, call) -> tuple[dict[str, int], object]:
    """With the worker stopped: ``call()`` (on a thread), the entries each lane holds once it is
    queued; then the worker goes on and the call's answer comes."""
    out: dict = {}

    def run():
        try:
            out["answer"] = call()
        except BaseException as exc:  # re-raised below, in the test's thread
            out["error"] = exc
    stack.signal_worker("w1", signal.SIGSTOP)
    thread = threading.Thread(target=run)
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while not any((lanes := _lanes(stack)).values()):
            assert time.monotonic() < deadline and thread.is_alive(), out
            time.sleep(0.01)
    finally:
        stack.signal_worker("w1", signal.SIGCONT)
        thread.join(60)
    if "error" in out:
        raise out["error"]
    return lanes, out["answer"]


@pytest.mark.slow
def test_batch_work_waits_in_the_batch_lane_and_interactive_work_in_the_light_lane(stack):
    with Client(stack.target, api_key="live-key") as client:
        client.embed(["warm up"], timeout=60)
        cases = [(lambda: client.embed(["red shoes"], priority="batch", timeout=60), "batch"),
                 (lambda: client.embed(["red shoes"], timeout=60), "light"),
                 (lambda: client.embed(["red shoes"], priority="interactive", timeout=60), "light")]
        for call, lane in cases:
            lanes, vectors = queued_while_stopped(stack, call)
            assert lanes == {"light": 0, "heavy": 0, "batch": 0} | {lane: 1}
            assert vectors.shape == (1, 384)
    with Client(stack.target, api_key="bulk-key") as client:
        for priority, lane in [(None, "batch"), ("interactive", "light")]:  # the key's default, overridden
            lanes, vectors = queued_while_stopped(
                stack, lambda: client.embed(["red shoes", "blue shoes"], priority=priority, timeout=60))
            assert lanes == {"light": 0, "heavy": 0, "batch": 0} | {lane: 2}
            assert vectors.shape == (2, 384)


@pytest.mark.slow
def test_the_openai_sdk_sends_the_class_in_extra_body(stack):
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.http_url}/v1", api_key="live-key", max_retries=0)
    for extra, lane in [({"priority": "batch"}, "batch"), ({}, "light")]:
        lanes, response = queued_while_stopped(stack, lambda: client.embeddings.create(
            model=MODEL, input=["red shoes"], extra_body=extra))
        assert lanes == {"light": 0, "heavy": 0, "batch": 0} | {lane: 1}
        assert len(response.data[0].embedding) == 384
    bulk = OpenAI(base_url=f"{stack.http_url}/v1", api_key="bulk-key", max_retries=0)
    lanes, _ = queued_while_stopped(stack, lambda: bulk.embeddings.create(model=MODEL, input=["red shoes"]))
    assert lanes["batch"] == 1
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input=["x"], extra_body={"priority": "low"})
    assert err.value.body["param"] == "priority"


@pytest.mark.slow
def test_an_unknown_class_leaves_nothing_in_redis(stack):
    r = stack.client()
    with Client(stack.target, api_key="live-key") as client:
        client.embed(["warm up"], timeout=60)
    before = set(r.keys("*"))  # the warm-up's reply key may expire meanwhile: nothing may be added
    tokens = r.get(stack.keys.tokens)
    with grpc.insecure_channel(stack.target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(inputs=["x"], priority=5), timeout=10,
                                                metadata=(("authorization", "Bearer bulk-key"),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reply = httpx.post(f"{stack.http_url}/v1/embeddings", json={"input": "x", "priority": "urgent"},
                       headers={"Authorization": "Bearer live-key"}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "priority"
    assert set(r.keys("*")) <= before and r.get(stack.keys.tokens) == tokens
    assert not any(_lanes(stack).values())
    with Client(stack.target, api_key="live-key") as client:  # and the service keeps serving
        assert client.embed(["still here"], priority="batch", timeout=60).shape == (1, 384)
