"""Concurrent Embed calls through a real gateway process share Redis round trips for their
enqueues (tokq.redis.pipeline), and each still gets its own answer: its own vectors, or its own
RESOURCE_EXHAUSTED when its enqueue alone is refused."""

from __future__ import annotations

import asyncio
import math
import signal
import time
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_stack import ServiceStack

from tokq.redis.embedded import free_port_block
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
MAX_QUEUED_TOKENS = 1000
HOLD_US = 100_000  # far above the default (2,000), so the flag's effect is unmistakable


@pytest.fixture(scope="module")
def stack():
    s = ServiceStack(env={"TOKQ_MAX_QUEUED_TOKENS": str(MAX_QUEUED_TOKENS)})
    s.metrics_port = free_port_block(2)
    try:
        s.start_gateway("--metrics-port", str(s.metrics_port), "--enqueue-hold-us", str(HOLD_US))
        s.start_worker("w1")
        s.wait_ready()
        yield s
    finally:
        s.close()


def enqueue_batches(stack) -> tuple[float, float]:
    """(round trips that carried enqueues, enqueues they carried), from the gateway's metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=5).read().decode()
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
              if s.name.startswith("tokq_gateway_enqueue_batch_requests")}
    return values.get("tokq_gateway_enqueue_batch_requests_count", 0), values.get(
        "tokq_gateway_enqueue_batch_requests_sum", 0)


def request(ids: list[int]) -> pb.EmbedRequest:
    # Token ids, so no call waits on a tokenizer thread: they reach the enqueue together.
    return pb.EmbedRequest(token_inputs=[pb.TokenIds(ids=[101, *ids, 102])])


async def concurrently(stack, requests: list[pb.EmbedRequest]) -> list:
    async with grpc.aio.insecure_channel(stack.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        await channel.channel_ready()
        return await asyncio.gather(*(stub.Embed(r, timeout=60) for r in requests), return_exceptions=True)


def vector(response: pb.EmbedResponse) -> np.ndarray:
    return np.asarray(response.embeddings[0].values, np.float32)


def test_concurrent_calls_share_round_trips_and_each_gets_its_own_vector(stack):
    inputs = [[2000 + i, 3000 + 7 * i, 4000 + (i * 13) % 500] for i in range(200)]
    before = enqueue_batches(stack)
    together = asyncio.run(concurrently(stack, [request(ids) for ids in inputs]))
    trips, sent = (a - b for a, b in zip(enqueue_batches(stack), before))
    assert sent == 200
    # A burst of 200 calls: gRPC hands the loop several new calls at a time, whose enqueues go
    # together (how many depends on scheduling; that none would is what this catches).
    assert trips < sent, "no two enqueues shared a round trip"
    # each call's vector is its own input's: the same as that input embedded on its own
    for ids, got in list(zip(inputs, together))[::25]:
        want = vector(asyncio.run(concurrently(stack, [request(ids)]))[0])
        assert float(vector(got) @ want) >= 0.9999
    assert len({vector(r).tobytes() for r in together}) == 200  # distinct inputs, distinct answers


def test_the_enqueue_hold_flag_reaches_the_gateway_s_queue(stack):
    """Calls 5 ms apart: with the default hold (2 ms) each would go in its own round trip; with
    the flag's 100 ms, those right behind one wait for each other and share a few."""
    async def spaced() -> list:
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            await channel.channel_ready()
            calls = []
            start = time.monotonic()
            for i in range(20):
                calls.append(asyncio.ensure_future(stub.Embed(request([5000 + i]), timeout=60)))
                await asyncio.sleep(0.005)
            nonlocal span_s
            span_s = time.monotonic() - start
            return await asyncio.gather(*calls)

    span_s = 0.0
    before = enqueue_batches(stack)
    answers = asyncio.run(spaced())
    trips, sent = (a - b for a, b in zip(enqueue_batches(stack), before))
    assert sent == 20 and len(answers) == 20
    # ~1 trip per 100 ms of sending; on a loaded machine the sends may spread past ~0.1 s, but
    # without the hold every call is its own trip (20).
    allowed = min(19, max(10, math.ceil(span_s / 0.1) + 2))
    assert trips <= allowed, (f"{trips:.0f} round trips for 20 calls sent over {span_s:.2f} s: "
                              "the hold was not applied")


def test_a_refused_enqueue_fails_only_its_own_call(stack):
    """The queue's cap (1,000 tokens) refuses the one request that alone passes it (4 inputs of
    252 tokens), sent amid a burst of small ones, which are answered. (That a refusal inside one
    pipeline touches no other call is checked deterministically in test_enqueues_pipelined.py.)
    An empty queue takes any one request, so the worker is paused (SIGSTOP) until all are
    enqueued, the first 50 small ones before the big one: a worker that had claimed them all
    already (it did, once, in a full-suite run) would let the big one in."""
    small = [request([2000 + i, 2100 + i]) for i in range(100)]
    big = pb.EmbedRequest(token_inputs=[pb.TokenIds(ids=[101, *range(2000, 2250), 102])] * 4)
    before = enqueue_batches(stack)
    worker = stack.workers["w1"]

    async def enqueued(n: int) -> None:
        deadline = time.monotonic() + 30
        while (await asyncio.to_thread(enqueue_batches, stack))[1] - before[1] < n:
            assert time.monotonic() < deadline, f"fewer than {n} enqueues"
            await asyncio.sleep(0.05)

    async def burst() -> list:
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            await channel.channel_ready()
            worker.send_signal(signal.SIGSTOP)
            try:
                first = [asyncio.ensure_future(stub.Embed(r, timeout=60)) for r in small[:50]]
                await enqueued(50)
                rest = [asyncio.ensure_future(stub.Embed(r, timeout=60)) for r in [big, *small[50:]]]
                await enqueued(101)
            finally:
                worker.send_signal(signal.SIGCONT)
            return await asyncio.gather(*first, *rest, return_exceptions=True)
    outcomes = asyncio.run(burst())
    assert enqueue_batches(stack)[1] - before[1] == 101
    refused = outcomes[50]
    assert isinstance(refused, grpc.aio.AioRpcError), refused
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in refused.details()
    answered = outcomes[:50] + outcomes[51:]
    assert all(isinstance(o, pb.EmbedResponse) and len(o.embeddings) == 1 for o in answered), answered
