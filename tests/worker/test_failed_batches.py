"""A worker's failed batches, in process: a real Queue on the real Redis, the real MiniLM engine
made to fail the way a GPU can. A bad input fails only its own item (its batch-mates are
answered); a token id past the vocabulary is refused before the forward; out of memory splits
the batch and retries only once the exception (and the activations its traceback holds) is
gone and the cache emptied; a sticky device error exits for the supervisor and answers nothing;
NaN/inf vectors are never returned and are counted."""

from __future__ import annotations

import gc
import math
import uuid
import weakref

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from queue_support import NOTICE_CHANNEL, open_queue
from tokq import metrics
from tokq.batch import PackedBatch
from tokq.config import QueueConfig, WorkerConfig
from tokq.queue.wire import decode_result, encode_body
from tokq.model.flops import forward_flops
from tokq.workers.engine import Engine
from tokq.workers.errors import Fault, classify
from tokq.workers.runner import EXIT_DEVICE_ERROR, BatchRunner, DeviceUnhealthy
from tokq.workers.worker import Worker

POISON = 7777  # a token id the faulty engine chokes on
NAN_TOKEN = 8888  # a token id whose vector comes out NaN (an fp16 overflow, say)
VOCAB = 30522  # all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm():
    return Engine.load(device="cpu", dtype="float32")


class FaultyEngine:
    """The real engine; ``fail(batch)`` may return an exception to raise instead."""

    def __init__(self, engine: Engine, fail=lambda batch: None, nan_token: int | None = None) -> None:
        self.engine, self.fail, self.nan_token = engine, fail, nan_token
        self.info, self.device, self.dtype = engine.info, engine.device, engine.dtype
        self.forwards: list[int] = []  # sequences per forward attempt
        self.seen_ids: set[int] = set()
        self.raised: list[weakref.ref] = []
        self.captures: list[tuple[int | None, int]] = []  # (max_tokens, forwards before it)

    def warmup(self, num_tokens: int) -> None:
        pass

    last_graphed = False

    def capture_graphs(self, max_tokens: int | None = None) -> int:
        self.captures.append((max_tokens, len(self.forwards)))
        return 0

    def embed(self, batch: PackedBatch) -> np.ndarray:
        self.forwards.append(batch.num_seqs)
        self.seen_ids |= set(batch.input_ids.tolist())
        exc = self.fail(batch)
        if exc is not None:
            self.raised.append(weakref.ref(exc))
            raise exc
        out = self.engine.embed(batch)
        if self.nan_token is not None:
            for row in range(batch.num_seqs):
                if self.nan_token in batch.input_ids[batch.cu_seqlens[row]:batch.cu_seqlens[row + 1]]:
                    out[row] = np.nan
        return out


# Python-level subclasses: built-in exception objects cannot be weakly referenced
class EmbeddingIndexError(IndexError):
    pass


class CudaRuntimeError(RuntimeError):
    pass


def _poisoned(batch):
    return EmbeddingIndexError("index out of range in self") if POISON in batch.input_ids else None


def _ids(i: int) -> np.ndarray:
    return np.array([101, 2000 + i, 3000 + i, 4000 + i, 102])


def _item(ids) -> tuple[int, bytes]:
    """(queued tokens, entry body) as a gateway enqueues it. ``ids`` bytes: a body as is (what a
    foreign or mismatched writer could queue); (ids, p): its first p ids a shared prompt, which
    the queue does not count."""
    if isinstance(ids, bytes):
        return 3, ids
    ids, prompt_len = ids if isinstance(ids, tuple) else (ids, 0)
    return len(ids) - prompt_len, encode_body(ids, prompt_len=prompt_len)


async def _serve(redis_url, engine, bodies, *, exit=None, observer=None):
    """Enqueue one request of these token-id lists, let a burst worker drain it, collect."""
    released = []

    def release():
        gc.collect()  # what the real release does first; then the exceptions must be gone
        released.append(all(ref() is None for ref in engine.raised))

    exits = []
    async with open_queue(redis_url) as queue:
        worker = Worker(engine, queue, WorkerConfig(token_budget=4096), QueueConfig(),
                        worker_id="w-runner", observer=observer)
        worker.loop.runner = BatchRunner(engine, observer=observer, release=release,
                                    exit=exit or exits.append)
        request_id = uuid.uuid4().hex
        items = [_item(ids) for ids in bodies]
        await queue.enqueue(request_id, items, timeout_ms=60_000, notice_channel=NOTICE_CHANNEL)
        error = None
        try:
            await worker.run(burst=True)
        except DeviceUnhealthy as exc:
            error = exc
        results = {i: decode_result(raw) for i, raw in (await queue.collect(request_id)).items()}
        stats = await queue.stats()
    return results, released, exits, error, stats, worker


def _alone(minilm, ids) -> np.ndarray:
    return minilm.embed(PackedBatch.pack([ids]))[0]


async def test_an_input_the_model_fails_on_fails_alone_and_its_batch_mates_are_answered(redis_url, minilm):
    bodies = [_ids(i) for i in range(16)]
    bodies[5] = np.array([101, POISON, 102])
    engine = FaultyEngine(minilm, _poisoned)
    results, released, exits, error, _, _ = await _serve(redis_url, engine, bodies)
    assert error is None and exits == []
    assert not results[5].ok and results[5].code == "INTERNAL" and "index out of range" in results[5].message
    for i in set(range(16)) - {5}:
        assert results[i].ok
        np.testing.assert_allclose(results[i].vector, _alone(minilm, bodies[i]), atol=1e-5)
    # bisection: one forward per level and side, not one per item
    assert len(engine.forwards) <= 1 + 2 * math.ceil(math.log2(16)) < 1 + 16
    assert released and all(released), "memory released while the exception was still alive"


async def test_the_worker_captures_cuda_graphs_up_to_its_budget_before_its_first_forward(redis_url, minilm):
    engine = FaultyEngine(minilm)
    results, *_ = await _serve(redis_url, engine, [[101, 2023, 102]])
    assert results[0].ok and engine.forwards == [1]
    assert engine.captures == [(4096, 0)]  # once, with the worker's budget, before any forward


async def test_token_id_past_the_vocabulary_is_invalid_argument_before_the_forward(redis_url, minilm):
    bodies = [_ids(0), np.array([101, VOCAB, 102]), _ids(2)]
    engine = FaultyEngine(minilm)
    results, *_ = await _serve(redis_url, engine, bodies)
    assert results[1].code == "INVALID_ARGUMENT" and "30522" in results[1].message
    assert results[0].ok and results[2].ok
    assert engine.forwards == [2] and VOCAB not in engine.seen_ids


@pytest.mark.parametrize("raw", [b"\x02\x00\x00", b"\x07\x00\x00\x00\x65\x00",
                                 b"\x02\x00\x00\x00\x65\x00\x01"],
                         ids=["short header", "id width 7", "half an id"])
async def test_a_malformed_entry_body_is_internal_and_the_worker_goes_on(redis_url, minilm, raw):
    """One unreadable body (a foreign or mismatched writer) killed the worker, and after its
    lease the next one: now it is answered alone, INTERNAL (the service's fault: a server
    error, which the error-rate alert counts), and its batch mates are served."""
    engine = FaultyEngine(minilm)
    results, _, exits, error, _, _ = await _serve(redis_url, engine, [_ids(0), raw, _ids(2)])
    assert error is None and exits == []
    assert results[1].code == "INTERNAL" and "malformed queue entry body" in results[1].message
    assert results[0].ok and results[2].ok and engine.forwards == [2]


async def test_out_of_memory_splits_the_batch_and_retries_after_the_exception_is_released(redis_url, minilm):
    def oom_over_4(batch):
        return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB") if batch.num_seqs > 4 else None

    bodies = [_ids(i) for i in range(16)]
    engine = FaultyEngine(minilm, oom_over_4)
    results, released, exits, error, *_ = await _serve(redis_url, engine, bodies)
    assert error is None and exits == []
    assert engine.forwards == [16, 8, 4, 4, 8, 4, 4]
    assert released == [True, True, True]  # after each OOM, with its exception gone
    for i, ids in enumerate(bodies):
        np.testing.assert_allclose(results[i].vector, _alone(minilm, ids), atol=1e-5)


async def test_oom_then_a_sticky_device_error_exits_for_the_supervisor_answering_nothing(redis_url, minilm):
    attempts = []

    def oom_then_sticky(batch):
        attempts.append(batch.num_seqs)
        if len(attempts) == 1:
            return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return CudaRuntimeError("CUDA error: an illegal memory access was encountered\n"
                            "CUDA kernel errors might be asynchronously reported")

    bodies = [_ids(i) for i in range(6)]
    engine = FaultyEngine(minilm, oom_then_sticky)
    results, released, exits, error, stats, worker = await _serve(redis_url, engine, bodies)
    assert exits == [EXIT_DEVICE_ERROR] and isinstance(error, DeviceUnhealthy)
    assert "illegal memory access" in str(error)
    assert released == [True]  # the OOM retry came after its exception was gone
    assert results == {}  # nothing answered: the batch is redone once its lease expires
    assert stats.inflight_items == len(bodies)
    assert not worker.loop.runner.healthy


async def test_nonfinite_vectors_are_never_returned_and_are_counted(redis_url, minilm):
    observer = metrics.WorkerMetrics("runner-test", "w-runner")
    labels = {"model": "runner-test", "worker": "w-runner"}
    before = REGISTRY.get_sample_value("tokq_worker_nonfinite_vectors_total", labels) or 0.0
    bodies = [_ids(0), np.array([101, NAN_TOKEN, 102]), _ids(2)]
    engine = FaultyEngine(minilm, nan_token=NAN_TOKEN)
    results, *_ = await _serve(redis_url, engine, bodies, observer=observer)
    assert results[1].code == "INTERNAL" and "non-finite" in results[1].message
    assert results[0].ok and results[2].ok and np.isfinite(results[0].vector).all()
    assert REGISTRY.get_sample_value("tokq_worker_nonfinite_vectors_total", labels) == before + 1
    observer.close()


def _sample(name: str, model: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, {"model": model, "worker": "w-runner", **labels}) or 0.0


async def _serve_observed(redis_url, minilm, model, bodies, fail=lambda batch: None, nan_token=None):
    observer = metrics.WorkerMetrics(model, "w-runner", model_config=minilm.info.config)
    engine = FaultyEngine(minilm, fail, nan_token=nan_token)
    try:
        results, _, _, _, stats, _ = await _serve(redis_url, engine, bodies, observer=observer)
        counted = {name: _sample(f"tokq_worker_{name}", model) for name in (
            "forward_tokens_total", "forward_flops_total", "batches_total", "batch_tokens_sum",
            "batch_items_sum", "batch_fill_ratio_sum")}
        counted["item_errors"] = _sample("tokq_worker_errors_total", model, kind="item")
    finally:
        observer.close()
    return results, stats.counters, counted, engine


async def test_an_item_refused_before_the_forward_is_failed_not_acked_nor_forwarded(redis_url, minilm):
    """The bug hunt's repro: a token id past MiniLM's vocabulary beside a good item."""
    bodies = [np.array([101, 40000, 102]), np.array([101, 7592, 2088, 102])]
    results, counters, counted, engine = await _serve_observed(redis_url, minilm, "runner-refused", bodies)
    assert results[0].code == "INVALID_ARGUMENT" and results[1].ok and engine.forwards == [1]
    assert (counters["acked"], counters.get("failed", 0)) == (1, 1)
    assert counted == {"forward_tokens_total": 4, "batches_total": 1, "batch_tokens_sum": 4,
                       "batch_items_sum": 1, "batch_fill_ratio_sum": pytest.approx(4 / 4096),
                       "forward_flops_total": forward_flops(minilm.info.config, [4]), "item_errors": 1}


async def test_forward_tokens_are_the_queued_tokens_without_a_shared_prompt(redis_url, minilm):
    """What the budget counts: a prompt shared by a batch is computed once (from cache), so an
    item's forwarded tokens are its queued ones, not its prompt-inclusive ids."""
    bodies = [(np.array([101, 7592, 2088, 1010, 2023, 102]), 4), np.array([101, 7592, 102])]
    _, _, counted, _ = await _serve_observed(redis_url, minilm, "runner-prefix", bodies)
    assert (counted["forward_tokens_total"], counted["batch_tokens_sum"]) == (2 + 3, 2 + 3)


async def test_a_batch_with_no_item_forwarded_is_no_forward_pass(redis_url, minilm):
    results, counters, counted, engine = await _serve_observed(
        redis_url, minilm, "runner-none", [np.array([101, VOCAB, 102])])
    assert results[0].code == "INVALID_ARGUMENT" and engine.forwards == []
    assert (counters.get("acked", 0), counters["failed"]) == (0, 1)
    assert counted == {"forward_tokens_total": 0, "forward_flops_total": 0, "batches_total": 0,
                       "batch_tokens_sum": 0, "batch_items_sum": 0, "batch_fill_ratio_sum": 0,
                       "item_errors": 1}


async def test_an_item_a_failed_forward_gave_up_on_is_failed_and_not_forwarded(redis_url, minilm):
    bodies = [_ids(0), np.array([101, POISON, 102]), _ids(2), _ids(3)]
    results, counters, counted, _ = await _serve_observed(redis_url, minilm, "runner-poison", bodies,
                                                          _poisoned)
    assert results[1].code == "INTERNAL" and all(results[i].ok for i in (0, 2, 3))
    assert (counters["acked"], counters["failed"]) == (3, 1)
    assert (counted["forward_tokens_total"], counted["batch_items_sum"]) == (15, 3)
    assert counted["forward_flops_total"] == forward_flops(minilm.info.config, [5, 5, 5])


async def test_a_nonfinite_vector_is_failed_not_acked_but_was_forwarded(redis_url, minilm):
    bodies = [_ids(0), np.array([101, NAN_TOKEN, 102]), _ids(2)]
    results, counters, counted, _ = await _serve_observed(redis_url, minilm, "runner-nan", bodies,
                                                          nan_token=NAN_TOKEN)
    assert results[1].code == "INTERNAL" and results[0].ok and results[2].ok
    assert (counters["acked"], counters["failed"]) == (2, 1)
    assert counted["forward_tokens_total"] == 13  # its tokens did run: the device's work counts


@pytest.mark.parametrize("exc,fault", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"), Fault.OUT_OF_MEMORY),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), Fault.OUT_OF_MEMORY),
    (RuntimeError("CUDA error: out of memory"), Fault.OUT_OF_MEMORY),
    (MemoryError(), Fault.OUT_OF_MEMORY),
    (RuntimeError("CUDA error: device-side assert triggered"), Fault.DEVICE),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), Fault.DEVICE),
    (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`"), Fault.DEVICE),
    (IndexError("index out of range in self"), Fault.INPUT),
    (ValueError("sequence of 300 tokens exceeds the model's max length 256"), Fault.INPUT),
])
def test_failures_are_classified(exc, fault):
    assert classify(exc) is fault
