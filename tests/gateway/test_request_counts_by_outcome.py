"""tokq_gateway_requests_total counts every Embed call by how it ended, over gRPC and HTTP: a
deadline that passes is DEADLINE_EXCEEDED (gRPC cancels the handler then, which read as
CANCELLED), a caller's cancellation CANCELLED; a call refused before it named a served model
(unknown model, unparsable body, no API key) is counted under model="", never under a name the
caller sent. A real gateway in this process, no worker: nothing is ever answered."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from prometheus_client import REGISTRY

from tokq import Client, TokqError
from tokq.redis.embedded import free_port
from gateway_support import running_gateway

MODEL = "all-MiniLM-L6-v2"
CODES = ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED")


def _counts(model: str, rpc: str) -> dict[str, float]:
    """``model``/``rpc``'s calls by code, over every priority class."""
    counts = dict.fromkeys(CODES, 0.0)
    for family in REGISTRY.collect():
        for s in family.samples if family.name == "tokq_gateway_requests" else ():
            if (s.name == "tokq_gateway_requests_total" and s.labels["model"] == model
                    and s.labels["rpc"] == rpc and s.labels["code"] in counts):
                counts[s.labels["code"]] += s.value
    return counts


def _added(before: dict[str, float], model: str, rpc: str, total: int) -> dict[str, float]:
    """What ``model``/``rpc``'s counts gained since ``before``, once ``total`` calls are counted
    (the gateway counts on its own thread, after the client has its answer)."""
    deadline = time.monotonic() + 10
    while True:
        added = {c: n - before[c] for c, n in _counts(model, rpc).items() if n != before[c]}
        if sum(added.values()) >= total or time.monotonic() > deadline:
            return added
        time.sleep(0.02)


@pytest.mark.slow
def test_a_passed_deadline_is_deadline_exceeded_and_a_cancelled_call_cancelled(redis_url):
    with running_gateway(redis_url) as port, Client(f"127.0.0.1:{port}") as client:
        before = _counts(MODEL, "Embed")
        for i in range(8):  # the race between gRPC's cancel and the gateway's timer, run 8 times
            with pytest.raises(TokqError) as err:
                client.embed([f"no worker {i}"], timeout=0.3)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _added(before, MODEL, "Embed", 8) == {"DEADLINE_EXCEEDED": 8}

        before = _counts(MODEL, "Embed")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            from tokq.v1 import embedder_pb2, embedder_pb2_grpc

            call = embedder_pb2_grpc.EmbedderStub(channel).Embed.future(
                embedder_pb2.EmbedRequest(inputs=["given up on"]), timeout=30)
            time.sleep(0.5)
            call.cancel()
        assert _added(before, MODEL, "Embed", 1) == {"CANCELLED": 1}


def test_calls_refused_before_naming_a_served_model_are_counted_under_no_model(redis_url):
    http_port = free_port()
    with running_gateway(redis_url, http_port=http_port) as port, \
            Client(f"127.0.0.1:{port}", model="a-name-the-caller-made-up") as client:
        grpc_before, http_before = _counts("", "Embed"), _counts("", "http.Embeddings")
        with pytest.raises(TokqError) as err:
            client.embed(["hello"], timeout=10)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        url = f"http://127.0.0.1:{http_port}/v1/embeddings"
        as_json = {"Content-Type": "application/json"}
        statuses = [httpx.post(url, json={"input": "x", "model": "another-made-up-name"}).status_code,
                    httpx.post(url, content=b"{not json", headers=as_json).status_code,
                    httpx.post(url, content=b"hello", headers={"Content-Type": "text/plain"}).status_code,
                    httpx.post(url, json={"input": "x", "inputs": "typo"}).status_code]
        assert statuses == [404, 400, 415, 400]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # a message that does not parse
            raw = channel.unary_unary("/tokq.v1.Embedder/Embed", request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as bad:
                raw(b"\x0a\x01a\x12\x02\xff\xfe", timeout=10)  # model: bad UTF-8
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _added(grpc_before, "", "Embed", 2) == {"INVALID_ARGUMENT": 2}
        assert _added(http_before, "", "http.Embeddings", 4) == {"INVALID_ARGUMENT": 4}
    names = {s.labels["model"] for f in REGISTRY.collect() if f.name == "tokq_gateway_requests"
             for s in f.samples}
    assert not {"a-name-the-caller-made-up", "another-made-up-name"} & names


def test_calls_refused_for_want_of_an_api_key_are_counted_under_no_model(redis_url):
    http_port = free_port()
    with running_gateway(redis_url, http_port=http_port, api_keys=("the-key",)) as port:
        grpc_before, http_before = _counts("", "Embed"), _counts("", "http.Embeddings")
        with Client(f"127.0.0.1:{port}") as client, pytest.raises(TokqError):
            client.embed(["no key"], timeout=10)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # health: open, and not counted
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/embeddings", json={"input": "no key"})
        assert reply.status_code == 401
        assert _added(grpc_before, "", "Embed", 1) == {"UNAUTHENTICATED": 1}
        assert _added(http_before, "", "http.Embeddings", 1) == {"UNAUTHENTICATED": 1}
