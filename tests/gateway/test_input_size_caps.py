"""Hostile input over real gRPC: byte caps are checked before tokenizing (INVALID_ARGUMENT naming
the cap, nothing queued), gRPC's receive limit follows them, and an 8 MB truncate=true input
gets the vector of tokenizing the whole string."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import grpc
import httpx
import numpy as np
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_support import left_for_the_gc, running_gateway
from tokq import config as cfg
from tokq.gateway.validate import Limits
from tokq.gateway.wire import EmbedRequestUtf8
from tokq.model.info import ModelInfo
from tokq.redis.embedded import free_port
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc

OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


HTTP_PORT = free_port()


@pytest.fixture(scope="module")
def small_caps(redis_server):
    with running_gateway(redis_server.url, max_input_bytes=1000, max_request_bytes=3000,
                         http_port=HTTP_PORT) as port:
        with grpc.insecure_channel(f"127.0.0.1:{port}", OPTIONS) as channel:
            yield pb_grpc.EmbedderStub(channel)


def rejected(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=30)
    return err.value


def nothing_queued(redis_url: str) -> bool:
    r = redis.Redis.from_url(redis_url)
    return not [k for k in r.scan_iter() if b":reply:" in k or b":pending" in k or b":heavy" in k]


@pytest.mark.parametrize("inputs,needle", [
    (["x" * 1001], "input 0 is 1,001 bytes; the limit is 1,000 bytes per input (max_input_bytes"),
    (["ok", "é" * 600], "input 1 is 1,200 bytes"),  # 600 characters, 1,200 UTF-8 bytes
    (["y" * 900] * 4, "3,600 bytes; the limit is 3,000 bytes per request (max_request_bytes"),
])
def test_over_a_cap_is_invalid_argument_naming_it_and_nothing_is_queued(small_caps, redis_url, inputs, needle):
    for truncate in (False, True):  # truncate=true does not lift the caps
        err = rejected(small_caps.Embed, pb.EmbedRequest(inputs=inputs, truncate=truncate))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.details(), err.details()
    err = rejected(small_caps.Tokenize, pb.TokenizeRequest(inputs=inputs))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.details()
    http = httpx.post(f"http://127.0.0.1:{HTTP_PORT}/v1/embeddings", json={"input": inputs}, timeout=30)
    assert http.status_code == 413 and needle in http.json()["error"]["message"]
    assert nothing_queued(redis_url)


def _embed_raw(channel, **fields):
    """Embed with inputs given as raw bytes: what a client whose strings are not UTF-8 sends."""
    embed = channel.unary_unary("/tokq.v1.Embedder/Embed", request_serializer=EmbedRequestUtf8.SerializeToString,
                                response_deserializer=pb.EmbedResponse.FromString)
    return rejected(embed, EmbedRequestUtf8(**fields))


def test_inputs_that_are_not_utf8_are_invalid_argument_naming_input_and_byte(redis_url):
    long_text = b"word " * 4000  # 4,000 tokens: refused without truncate=true from a prefix
    with running_gateway(redis_url, max_input_bytes=100_000) as port, \
            grpc.insecure_channel(f"127.0.0.1:{port}", OPTIONS) as channel:
        for fields, needle in [
            ({"inputs": [b"ok", b"caf\xc3"]}, "input 1 is not valid UTF-8 (byte 3)"),  # cut short
            ({"inputs": [b"ok", b"\xff" + long_text]}, "input 1 is not valid UTF-8 (byte 0)"),
            ({"inputs": [long_text + b"\xed\xa0\x80"], "truncate": True},  # a surrogate, at the end
             "input 0 is not valid UTF-8 (byte 20,000)"),
            # too long from a prefix, before the rest is read: its bad byte is never reached
            ({"inputs": [long_text + b"\xff"]}, "input 0 is more than 256 tokens long"),
        ]:
            err = _embed_raw(channel, **fields)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.details(), err.details()
    assert nothing_queued(redis_url)


def test_tokenize_inputs_and_other_fields_that_are_not_utf8_are_invalid_argument(redis_url):
    """Only Embed's inputs were read as bytes: bad UTF-8 in Tokenize's inputs, or in a string
    field of any request (model, prompt_name), or a corrupt message, got UNKNOWN with protobuf's
    exception text and a traceback in the gateway's log."""
    from tokq.gateway.wire import TokenizeRequestUtf8

    def raw(channel, method, message: bytes) -> grpc.RpcError:
        call = channel.unary_unary(f"/tokq.v1.Embedder/{method}", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        return rejected(call, message)

    bad_model = pb.EmbedRequest(inputs=["ok"]).SerializeToString() + b"\x12\x02\xff\xfe"  # model = 0xff 0xfe
    bad_prompt = pb.TokenizeRequest(inputs=["ok"]).SerializeToString() + b"\x22\x01\xc3"  # prompt_name
    with running_gateway(redis_url) as port, grpc.insecure_channel(f"127.0.0.1:{port}", OPTIONS) as channel:
        err = raw(channel, "Tokenize", TokenizeRequestUtf8(inputs=[b"ok", b"caf\xc3"]).SerializeToString())
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert "input 1 is not valid UTF-8 (byte 3)" in err.details()
        for method, message in [("Embed", bad_model), ("Tokenize", bad_prompt),
                                ("Info", pb.InfoRequest().SerializeToString() + b"\x0a\x01\xff"),
                                ("Embed", b"\x0a\x05ab")]:  # a field longer than the message
            err = raw(channel, method, message)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.code(), err.details())
            assert f"the request is not a valid tokq.v1.{method}Request" in err.details()
            assert "Unexpected" not in err.details() and "<class" not in err.details()
        ok = pb_grpc.EmbedderStub(channel).Tokenize(pb.TokenizeRequest(inputs=["café"]), timeout=30)
        assert ok.inputs[0].tokens  # a valid request is still read
    assert nothing_queued(redis_url)


def test_a_reply_too_large_to_send_is_refused_before_any_work(redis_url):
    """--max-inputs allows 100,000, but 64 MiB (gRPC's send limit) hold ~43,000 of MiniLM's
    vectors: such a call was embedded in full, then failed RESOURCE_EXHAUSTED (which callers
    retry, computing it all again). Fewer dimensions fit more."""
    from tokq.gateway.wire import MAX_SEND_MESSAGE_BYTES

    fit = (MAX_SEND_MESSAGE_BYTES - 4096) // (384 * 4 + 8)
    with running_gateway(redis_url, max_inputs=100_000) as port, \
            grpc.insecure_channel(f"127.0.0.1:{port}", OPTIONS) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        err = rejected(stub.Embed, pb.EmbedRequest(inputs=["hi"] * (fit + 1)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert f"{fit + 1:,} inputs of 384 dimensions do not fit one reply (at most 64 MiB): send at most " \
               f"{fit:,} inputs a request" in err.details()
        err = rejected(stub.Embed, pb.EmbedRequest(token_inputs=[pb.TokenIds(ids=[101, 102])] * (fit + 1)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "do not fit one reply" in err.details()
    assert nothing_queued(redis_url)


@settings(deadline=None, max_examples=50)
@given(st.integers(0, 40), st.integers(1, 2048), st.integers(0, 10**6), st.text(max_size=40))
def test_the_reply_bound_is_never_below_a_real_reply(num_vectors, dims, num_tokens, model):
    from tokq.gateway.wire import embed_response, embed_response_max_bytes

    vectors = [np.ones(dims, np.float32)] * num_vectors
    timing = {f.name: 1e300 for f in pb.Timing.DESCRIPTOR.fields}
    assert len(embed_response(vectors, model, num_tokens, timing)) <= embed_response_max_bytes(num_vectors, dims)


def test_just_under_the_caps_is_tokenized(small_caps):
    reply = small_caps.Tokenize(pb.TokenizeRequest(inputs=["word " * 199 + "x"] * 3, truncate=True), timeout=30)
    assert [len(t.ids) for t in reply.inputs] == [202] * 3  # 1,000 bytes each (200 words), 3,000 in all


def test_far_over_the_caps_is_refused_by_grpc_before_it_is_read(small_caps):
    limits = Limits.resolve(ModelInfo.load(), cfg.load(cfg.GatewayConfig, {"max_input_bytes": 1000,
                                                                            "max_request_bytes": 3000}, env={}))
    err = rejected(small_caps.Embed, pb.EmbedRequest(inputs=["z" * (limits.max_message_bytes + 1)]))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_default_caps_come_from_the_models_max_length():
    limits = Limits.resolve(ModelInfo.load(), cfg.load(cfg.GatewayConfig, env={}))
    assert limits.max_input_bytes == 256 * 256  # max_length 256 x 256 bytes
    assert limits.max_request_bytes == 512 * 256 * 16  # max_inputs x max_length x 16 bytes
    # the message limit: twice the request cap plus 1 MiB of framing (README, --max-message-bytes) ...
    assert limits.max_message_bytes == 2 * limits.max_request_bytes + (1 << 20)
    # ... or a full request of token ids (<= 5 bytes each) plus 1 MiB, where that is larger
    small = Limits.resolve(ModelInfo.load(), cfg.load(cfg.GatewayConfig, {"max_request_bytes": 3000},
                                                      env={}))
    assert small.max_message_bytes == 512 * 256 * 5 + (1 << 20)


@pytest.mark.slow
def test_an_8mb_truncated_input_gets_the_vector_of_the_whole_string(redis_server, redis_url, bundled_model_dir):
    words = [w.strip() for w in open(bundled_model_dir / "vocab.txt", encoding="utf-8")
             if w.strip().isalpha()][:20000]
    rng = random.Random(5)
    text = " ".join(rng.choice(words) for _ in range(1_500_000))[: 8 << 20]
    from transformers import AutoTokenizer

    whole_ids = AutoTokenizer.from_pretrained(str(bundled_model_dir))(
        text, truncation=True, max_length=256)["input_ids"]  # tokenizes all 8 MB
    worker = subprocess.Popen([sys.executable, "-m", "tokq.cli", "worker", "--device", "cpu", "--threads", "1"],
                              env={**os.environ, "TOKQ_REDIS_URL": redis_url})
    try:
        with running_gateway(redis_url, max_input_bytes=9 << 20, max_request_bytes=9 << 20) as port, \
                grpc.insecure_channel(f"127.0.0.1:{port}", OPTIONS) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            ids = stub.Tokenize(pb.TokenizeRequest(inputs=[text], truncate=True), timeout=60).inputs[0].ids
            assert list(ids) == whole_ids
            cut = stub.Embed(pb.EmbedRequest(inputs=[text], truncate=True), timeout=180)
            whole = stub.Embed(pb.EmbedRequest(token_inputs=[pb.TokenIds(ids=whole_ids)]), timeout=180)
            assert cut.usage.prompt_tokens == 256
            np.testing.assert_allclose(cut.embeddings[0].values, whole.embeddings[0].values, atol=1e-6)
    finally:
        worker.terminate()
        worker.wait(60)


def test_a_refused_request_is_freed_at_once_not_by_the_garbage_collector(small_caps):
    # Aborting with context.abort() made a reference cycle (gRPC keeps the AbortError, whose
    # traceback holds the handler's frames and so the request): each refused request's megabytes
    # lived until a GC pass, and under a flood of them those passes stalled the event loop
    # (bench hostile's refused row). The servicer now sets the status and returns instead.
    def refused():
        for _ in range(3):
            assert rejected(small_caps.Embed, pb.EmbedRequest(inputs=["word " * 300])).code() \
                == grpc.StatusCode.INVALID_ARGUMENT
    refused()  # warm-up
    assert left_for_the_gc(refused) == []


def test_a_started_gateway_keeps_the_collector_off_its_start_up_and_its_calls_in_flight(small_caps):
    # Start-up objects are frozen out of the collector's reach; the young generation is
    # collected every GC_YOUNG_THRESHOLD allocations, not every ~16 calls (gateway/server.py).
    import gc

    from tokq.gateway.server import GC_YOUNG_THRESHOLD

    assert gc.get_freeze_count() > 100_000  # start-up: the tokenizer, transformers, gRPC (~200,000)
    assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD  # (running_gateway puts both back after)


def test_a_stopped_gateway_frees_its_metrics_port(redis_url):
    # A gateway's /metrics server is a thread of its process: stopping the gateway stops it, so a
    # gateway started next in the same process (an embedding app's restart, these tests) binds
    # the same port instead of failing with "address in use".
    import socket
    import urllib.request

    metrics_port = free_port()
    for _ in range(2):
        with running_gateway(redis_url, metrics_port=metrics_port):
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
            assert b"tokq_gateway" in text
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", metrics_port))  # raises while a server still holds it
