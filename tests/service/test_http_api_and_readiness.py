"""The HTTP API on the wire (plain httpx, as curl would send it) and readiness on both transports:
a real gateway with --http-port, a real worker and Redis, each stopped and started again."""

from __future__ import annotations

import base64
import gzip
import signal
import time

import grpc
import httpx
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2

pytestmark = pytest.mark.slow
MODEL = "all-MiniLM-L6-v2"
MAX_MESSAGE_BYTES = 200_000


@pytest.fixture(scope="module")
def stack():
    from service_stack import gateway_and_worker

    with gateway_and_worker(http=True, env={"TOKQ_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
                                            "TOKQ_READY_CHECK_MS": "300"}) as s:
        yield s


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=60) as client:
        yield client


def embed(http, **body) -> httpx.Response:
    return http.post("/v1/embeddings", json={"model": MODEL, **body})


def test_response_has_openai_shape_and_usage_counts_tokens(http, stack):
    from tokq import Client

    texts = ["the first input", "and a second, longer input than the first"]
    resp = embed(http, input=texts)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["object"] == "list" and body["model"] == MODEL
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    with Client(stack.target) as grpc_client:
        num_tokens = sum(len(ids) for ids in grpc_client.tokenize(texts))
        want = grpc_client.embed(texts, timeout=30)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    np.testing.assert_array_equal(got, want)  # one code path: the same vectors as gRPC


def test_single_string_base64_and_tei_extras(http):
    floats = np.array(embed(http, input="one string").json()["data"][0]["embedding"], dtype=np.float32)
    b64 = embed(http, input="one string", encoding_format="base64").json()["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(b64), dtype="<f4"), floats)
    tagged = embed(http, input="one string", user="end-user-42")  # OpenAI's field, accepted
    assert tagged.status_code == 200
    np.testing.assert_allclose(tagged.json()["data"][0]["embedding"], floats, atol=1e-6)
    raw = embed(http, input="one string", normalize=False).json()["data"][0]["embedding"]
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-3
    np.testing.assert_allclose(np.array(raw) / np.linalg.norm(raw), floats, atol=1e-5)
    long = embed(http, input="word " * 400, truncate=True).json()
    assert long["usage"]["prompt_tokens"] == 256
    resp = embed(http, input="q", prompt_name="query")  # all-MiniLM-L6-v2 defines no prompts
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_name"


@pytest.mark.parametrize("body, status, needle", [
    ({"input": ""}, 400, "input 0 is an empty string"),
    ({"input": []}, 400, "empty"),
    ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
    ({"input": "hi", "dimensions": True}, 400, "dimensions must be an integer"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "encoding_format": ""}, 400, "encoding_format"),
    ({"input": "hi", "temperature": 1}, 400, "unknown field(s) temperature"),
    ({"input": [1.5, 2]}, 400, "token-id array"),
    ({"input": [[101, 10 ** 9]]}, 400, "outside"),
    ({"input": [[101, -1]]}, 400, "outside"),
    ({"input": [[101, None]]}, 400, "input 0 is a list, but not of integer token ids"),
    ({"input": [[101, 102], [101, [2]]]}, 400, "input 1 is a list, but not of integer token ids"),
    ({"input": [[[101, 2]]]}, 400, "not of integer token ids"),
    ({"input": [[101, True]]}, 400, "not of integer token ids"),  # JSON true is no token id 1
    ({"input": "word " * 400}, 400, "at most 256 tokens"),
    ({"input": "hi", "model": "no-such-model"}, 404, "no-such-model"),
])
def test_bad_requests_get_openai_error_objects(http, body, status, needle):
    resp = http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and needle in error["message"]
    assert embed(http, input="still serving").status_code == 200


def test_invalid_json_and_oversized_bodies(http, stack):
    resp = http.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
    body = b'{"input": "hi"}'
    for declared in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        resp = http.post("/v1/embeddings", content=body, headers={"content-type": declared})
        assert resp.status_code == 415, (declared, resp.text)
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and declared in error["message"]
    for declared in ("application/json; charset=utf-8", "Application/JSON", "text/json", None):
        headers = {"content-type": declared} if declared else {}
        assert http.post("/v1/embeddings", content=body, headers=headers).status_code == 200, declared
    resp = http.post("/v1/embeddings", content=gzip.compress(body),
                     headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert resp.status_code == 415 and "Content-Encoding 'gzip'" in resp.json()["error"]["message"], resp.text
    headers = {"content-type": "application/json", "content-encoding": "identity"}
    assert http.post("/v1/embeddings", content=body, headers=headers).status_code == 200
    big = embed(http, input=["x " * 1000] * 120)  # ~240 kB > 200 kB
    assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
    assert big.json()["error"]["type"] == "invalid_request_error"  # not a rate limit: resending cannot help
    from tokq.v1 import embedder_pb2 as pb
    from tokq.v1 import embedder_pb2_grpc as pb_grpc

    with grpc.insecure_channel(stack.target) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(inputs=["x " * 1000] * 120), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # the same cap on gRPC


def test_models_health_and_unknown_routes(http):
    assert http.get("/v1/models").json() == {
        "object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "tokq"}]}
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert http.get("/v1/models/").json() == http.get("/v1/models").json()  # no model named ""
    assert http.get("/v1/models/nope").status_code == 404
    assert http.get("/health").status_code == 200
    assert http.get("/ready").json() == {"status": "ready"}
    for resp, status in ((http.get("/v2/nothing"), 404), (http.delete("/v1/embeddings"), 405)):
        assert resp.status_code == status and (status == 404 or resp.headers["allow"] == "POST")
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_a_caller_that_hangs_up_has_its_request_cancelled(stack, http):
    # An SDK that times out closes its connection and retries: the inputs it left queued are
    # cancelled then, as a cancelled gRPC call's are, not left to a worker until the 30 s deadline.
    import json
    import socket

    r, keys = stack.client(), stack.keys
    cancelled = int(r.hget(keys.counters, "cancelled") or 0)
    stack.signal_worker("w1", signal.SIGSTOP)  # nobody claims: the inputs stay queued
    try:
        body = json.dumps({"model": MODEL, "input": ["token " * 50] * 4}).encode()
        with socket.create_connection(("127.0.0.1", stack.http_port)) as impatient:
            impatient.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: tokq\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 30
            while not int(r.get(keys.tokens) or 0):  # queued: then it hangs up
                assert time.monotonic() < deadline, "the call's inputs were never queued"
                time.sleep(0.02)
        deadline = time.monotonic() + 5
        while int(r.hget(keys.counters, "cancelled") or 0) == cancelled:
            assert time.monotonic() < deadline, "a call whose caller left was not cancelled"
            time.sleep(0.05)
    finally:
        stack.signal_worker("w1", signal.SIGCONT)
    assert embed(http, input="still serving").status_code == 200


def _wait(stack, http, ready: bool, timeout_s: float = 30) -> None:
    want_grpc = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    want_http = 200 if ready else 503
    deadline = time.monotonic() + timeout_s
    while True:
        # gRPC health overall and the Embedder service's (what a per-service probe asks), /ready
        seen = (stack.health(), stack.health("tokq.v1.Embedder"), http.get("/ready").status_code)
        if seen == (want_grpc, want_grpc, want_http):
            return
        assert time.monotonic() < deadline, f"readiness stuck at {seen}, want {(want_grpc, want_grpc, want_http)}"
        time.sleep(0.2)


def test_not_ready_without_a_live_worker_and_ready_again_when_one_starts(stack, http):
    assert stack.stop_worker("w1") == 0
    _wait(stack, http, ready=False)
    assert "no live worker" in http.get("/ready").json()["reason"]
    assert http.get("/health").status_code == 200  # alive all the same
    stack.start_worker("w2")
    _wait(stack, http, ready=True)
    assert embed(http, input="back").status_code == 200


def test_not_ready_while_redis_is_down_and_ready_when_it_returns(stack, http):
    stack.redis.stop()
    try:
        _wait(stack, http, ready=False)
        reason = http.get("/ready").json()["reason"]
        assert reason.startswith("Redis")  # unreachable, or no answer in time; and not where it is
        assert str(redis.connection.parse_url(stack.redis_url)["port"]) not in reason, reason
        resp = embed(http, input="redis is down")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "unavailable"
        assert resp.headers["retry-after"] == "1"  # the openai SDK waits this long before its retry
    finally:
        stack.redis.start()
    _wait(stack, http, ready=True, timeout_s=60)
    assert embed(http, input="served again").status_code == 200
