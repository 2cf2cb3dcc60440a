"""CUDA graphs for small batches (workers/cuda_graphs.py).

On CPU: the shape buckets, and the padded batch a graph replays, run eagerly through the CUDA
attention call paths' contract fakes (tests/cuda_fakes.py: rows in no sequence come back NaN),
against the same engine's unpadded forward; capture failure and the graph budget fall back to
eager forwards. On a GPU (marked cuda): real captures and replays against eager forwards."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import types

import numpy as np
import pytest
import torch

from cuda_fakes import FlashAttnVarlenFake, TorchVarlenFake
from tiny_models import VOCAB, build
from tokq.batch import PackedBatch
from tokq.workers import attention, cuda_graphs
from tokq.workers.cuda_graphs import CudaGraphs, token_buckets
from tokq.workers.engine import Engine

MODELS = ("bert", "qwen2_causal_lm", "qwen3_model")


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def _batch(lens, seed: int = 0) -> PackedBatch:
    rng = np.random.default_rng(seed)
    return PackedBatch.pack([rng.integers(1, VOCAB, size=n) for n in lens])


@pytest.mark.parametrize("max_tokens", [16, 100, 1000, 4096])
def test_token_buckets_fit_every_size_padding_at_most_half(max_tokens):
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens and buckets[0] >= 1
    for n in range(1, max_tokens + 1):
        bucket = next(b for b in buckets if b >= n)
        assert bucket <= max(16, 1.5 * n), (n, bucket)


def test_shape_bounds_the_batch_and_stays_within_the_model():
    graphs = CudaGraphs(None, torch.device("cpu"), 4096, 512, capture=False)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        num_tokens = int(rng.integers(1, 4097))
        num_seqs = int(rng.integers(-(-num_tokens // 512), num_tokens + 1))  # each <= 512 tokens
        longest = int(rng.integers(-(-num_tokens // num_seqs), min(num_tokens, 512) + 1))
        shape = graphs.shape_of(num_tokens, num_seqs, longest)
        assert num_tokens <= shape.num_tokens <= 4096
        assert num_seqs <= shape.num_seqs <= min(2 * num_seqs, shape.num_tokens)
        assert longest <= shape.max_seqlen <= 512 and shape.max_seqlen >= min(128, 512)


@pytest.fixture(scope="module", params=MODELS)
def tiny_bf16(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build(request.param, path)
    return Engine.load(path, device="cpu", dtype="bfloat16")


def _install(monkeypatch, backend: str):
    """The backend's call path on CPU through its padded-batch contract fake."""
    if backend == "flash_attn":
        fake = FlashAttnVarlenFake()
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake))
    else:
        from torch.nn.attention import varlen

        fake = TorchVarlenFake("installed")
        monkeypatch.setattr(varlen, "varlen_attn", fake)
    fake.padded = True
    return fake


def _engines(tiny, backend: str, max_tokens: int = 256, **kwargs) -> tuple[Engine, Engine]:
    """(eager, graphed) engines sharing the tiny model; graphed replays padded shapes eagerly."""
    eager = Engine(tiny.info, tiny.model, tiny.device, tiny.dtype, backend)
    graphed = Engine(tiny.info, tiny.model, tiny.device, tiny.dtype, backend)
    graphed.graphs = CudaGraphs(lambda layout: graphed.model.forward(layout, graphed._attend), tiny.device,
                                max_tokens, tiny.info.max_length, capture=False, **kwargs)
    return eager, graphed


@pytest.mark.parametrize("backend", cuda_graphs.GRAPH_BACKENDS)
def test_padded_shape_gives_the_unpadded_vectors(tiny_bf16, monkeypatch, backend):
    fake = _install(monkeypatch, backend)
    eager, graphed = _engines(tiny_bf16, backend)
    # 11 sequences, 173 tokens: padded to 192 rows and 16 sequences, the last 5 empty
    batch = _batch([17, 1, 5, 64, 5, 2, 33, 17, 9, 17, 3])
    want = eager.embed(batch)
    fake.calls.clear()
    got = graphed.embed(batch)
    assert np.isfinite(got).all()  # no NaN from the pad rows reached a vector
    assert _cos(got, want).min() >= 0.9999, _cos(got, want).min()
    assert graphed.graphs.num_graphs == 1 and len(fake.calls) == len(tiny_bf16.model.layers)


def test_each_batch_on_a_shape_sees_only_its_own_tokens(tiny_bf16, monkeypatch):
    """The static buffers outlive a batch: a shorter batch of the same shape leaves the longer
    one's tokens in its pad rows, and fewer sequences leave its sequence ends behind."""
    _install(monkeypatch, "torch_varlen")
    eager, graphed = _engines(tiny_bf16, "torch_varlen")
    batches = [_batch([40, 30, 25, 33], seed=1), _batch([64, 50], seed=2), _batch([40, 30, 25, 33], seed=3),
               _batch([7], seed=4), _batch([64, 64, 1], seed=5)]
    for batch in batches:
        got, want = graphed.embed(batch), eager.embed(batch)
        assert np.isfinite(got).all() and _cos(got, want).min() >= 0.9999
    shapes = {graphed.graphs.shape_of(b.num_tokens, b.num_seqs, b.max_seqlen) for b in batches}
    assert graphed.graphs.num_graphs == len(shapes) < len(batches)  # shapes were shared


def test_shapes_past_the_graph_budget_and_batches_past_max_tokens_run_eagerly(tiny_bf16, monkeypatch):
    fake = _install(monkeypatch, "torch_varlen")
    eager, graphed = _engines(tiny_bf16, "torch_varlen", max_tokens=64, max_graphs=1)
    for lens in ([10, 20], [3], [64, 64]):  # a graph, then another shape, then 128 > 64 tokens
        batch = _batch(lens)
        fake.calls.clear()
        got = graphed.embed(batch)
        padded = {c["tokens"] for c in fake.calls} != {batch.num_tokens}
        assert padded == (lens == [10, 20]), lens
        np.testing.assert_allclose(got, eager.embed(batch), atol=1e-3)
    assert graphed.graphs.num_graphs == 1


class FakeCuda:
    """torch.cuda's stream, device and graph-capture calls on a CPU, recorded: code under capture
    runs eagerly here (nothing is recorded for a replay), so a capture is checked for where it
    runs and how it fails, not for what it replays. ``end_error``: what ending the capture raises
    (CUDA's error for a capture invalidated by a failure inside it)."""

    def __init__(self, monkeypatch, end_error: Exception | None = None):
        self.events: list[tuple] = []
        self.end_error = end_error
        fake = self

        class Stream:
            def __init__(self, device=None, record: bool = True):
                self.device = device
                if record:
                    fake.events.append(("stream", device))

            def wait_stream(self, other):
                pass

        self.default = self.current = Stream("default", record=False)

        @contextlib.contextmanager
        def device(dev):
            fake.events.append(("device", dev))
            yield

        @contextlib.contextmanager
        def stream(s):
            before, fake.current = fake.current, s
            yield
            fake.current = before

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None):
            fake.events.append(("capture", pool, stream))
            fake.current = stream
            try:
                yield
            finally:  # torch's __exit__ ends the capture whatever happened inside it
                if fake.end_error is not None:
                    raise fake.end_error  # as capture_end does: the stream stays current
            fake.current = fake.default

        def set_stream(s):
            fake.current = s

        for name, value in (("Stream", Stream), ("device", device), ("stream", stream), ("graph", graph),
                            ("set_stream", set_stream), ("current_stream", lambda dev=None: fake.default),
                            ("CUDAGraph", lambda: types.SimpleNamespace(replay=lambda: None))):
            monkeypatch.setattr(torch.cuda, name, value)


def _capturing(tiny, monkeypatch, **fake_kwargs):
    _install(monkeypatch, "torch_varlen")
    fake = FakeCuda(monkeypatch, **fake_kwargs)
    eager, graphed = _engines(tiny, "torch_varlen")
    graphed.graphs.capture = True  # capture, through the fake
    return fake, eager, graphed


def test_a_capture_runs_on_the_engines_device_and_leaves_its_stream(tiny_bf16, monkeypatch):
    fake, eager, graphed = _capturing(tiny_bf16, monkeypatch)
    graphed.graphs.device = torch.device("cpu", 1)  # as an engine on cuda:1 would have it
    batch = _batch([5, 9, 30])
    got = graphed.embed(batch)  # the capture's own forward ran, eagerly, here
    np.testing.assert_allclose(got, eager.embed(batch), atol=1e-3)
    side = [e for e in fake.events if e[0] == "stream"]
    gpu1 = torch.device("cpu", 1)
    assert fake.events[0] == ("device", gpu1) and side == [("stream", gpu1)]
    capture = next(e for e in fake.events if e[0] == "capture")
    assert capture[2] is not None and capture[2].device == torch.device("cpu", 1)  # not a stream of cuda:0
    assert fake.current is fake.default and graphed.graphs.num_graphs == 1


def test_a_failed_capture_leaves_every_forward_eager_and_names_the_first_error(tiny_bf16, monkeypatch,
                                                                                caplog):
    fake, eager, graphed = _capturing(tiny_bf16, monkeypatch, end_error=RuntimeError(
        "CUDA error: operation failed due to a previous error during capture"))
    graphs = graphed.graphs
    monkeypatch.setattr(graphs, "_forward", _failing_in_capture(fake, graphs._forward, RuntimeError(
        "CUDA error: operation not permitted when stream is capturing")))
    batch = _batch([5, 9, 30])
    np.testing.assert_allclose(graphed.embed(batch), eager.embed(batch), atol=1e-3)
    assert graphs.failed and "not permitted" in graphs.failed and graphs.num_graphs == 0
    assert fake.current is fake.default  # eager work is not left on the capture's stream
    assert not graphs.covers(batch.num_tokens) and "CUDA graph capture failed" in caplog.text
    np.testing.assert_allclose(graphed.embed(_batch([4])), eager.embed(_batch([4])), atol=1e-3)


def test_a_capture_out_of_memory_runs_that_batch_eagerly_and_tries_again_later(tiny_bf16, monkeypatch):
    fake, eager, graphed = _capturing(tiny_bf16, monkeypatch, end_error=RuntimeError("previous error"))
    graphs = graphed.graphs
    forward = graphs._forward
    monkeypatch.setattr(graphs, "_forward", _failing_in_capture(fake, forward, torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 MiB")))
    batch = _batch([5, 9, 30])
    np.testing.assert_allclose(graphed.embed(batch), eager.embed(batch), atol=1e-3)
    assert graphs.failed is None and graphs.num_graphs == 0 and graphs.covers(batch.num_tokens)
    fake.end_error = None
    monkeypatch.setattr(graphs, "_forward", forward)  # memory freed since
    np.testing.assert_allclose(graphed.embed(batch), eager.embed(batch), atol=1e-3)
    assert graphs.num_graphs == 1 and sum(e[0] == "capture" for e in fake.events) == 2


def test_a_shape_whose_captures_keep_running_out_of_memory_stays_eager(tiny_bf16, monkeypatch):
    from tokq.workers.cuda_graphs import MAX_OUT_OF_MEMORY

    fake, eager, graphed = _capturing(tiny_bf16, monkeypatch)
    graphs = graphed.graphs
    monkeypatch.setattr(graphs, "_forward", _failing_in_capture(fake, graphs._forward, torch.OutOfMemoryError(
        "CUDA out of memory")))
    batch = _batch([5, 9, 30])
    for _ in range(MAX_OUT_OF_MEMORY + 3):
        np.testing.assert_allclose(graphed.embed(batch), eager.embed(batch), atol=1e-3)
    # each try costs a synchronize, an emptied cache and a forward: only MAX_OUT_OF_MEMORY of them
    assert sum(e[0] == "capture" for e in fake.events) == MAX_OUT_OF_MEMORY
    assert graphs.failed is None and graphs.num_graphs == 0


def test_the_warm_set_stops_at_the_first_capture_out_of_memory(tiny_bf16, monkeypatch):
    fake, eager, graphed = _capturing(tiny_bf16, monkeypatch)
    graphs = graphed.graphs
    monkeypatch.setattr(graphs, "_forward", _failing_in_capture(fake, graphs._forward, torch.OutOfMemoryError(
        "CUDA out of memory")))
    assert len(graphs.warm_shapes()) > 1
    assert graphed.capture_graphs() == 0 and sum(e[0] == "capture" for e in fake.events) == 1


def _failing_in_capture(fake: FakeCuda, forward, error: Exception):
    """``forward``, raising ``error`` when called under a capture (not in the warm-up before it)."""
    def run(layout):
        if any(e[0] == "capture" for e in fake.events[-1:]):
            raise error
        return forward(layout)
    return run


def test_a_heavy_forward_runs_eagerly_and_light_work_nested_in_it_replays_a_graph(tiny_bf16, monkeypatch):
    """Pre-emption needs the heavy forward's checkpoints, which a graph has not: the heavy batch
    runs eagerly, a light batch offered meanwhile runs inside it through its graph."""
    from tokq.workers.preempt import Preemption

    fake = _install(monkeypatch, "torch_varlen")
    eager, graphed = _engines(tiny_bf16, "torch_varlen")
    heavy, light = _batch([60, 50, 40], seed=1), _batch([7, 3], seed=2)
    preemption = Preemption(graphed.embed)
    loop = asyncio.new_event_loop()
    offered = []

    def heavy_forward():
        offered.append(preemption.offer(light, loop))  # arrives while the heavy forward runs
        return graphed.embed(heavy)

    try:
        got = preemption.heavy(heavy_forward)
        loop.run_until_complete(asyncio.sleep(0))  # the nested batch's outcome is resolved here
    finally:
        loop.close()
    tokens = [c["tokens"] for c in fake.calls]
    layers = len(tiny_bf16.model.layers)
    # the light batch (10 tokens, padded to 16: its graph's shape) ran at the heavy one's first
    # checkpoint, before its first attention; every layer of the heavy batch saw its 150
    # tokens, unpadded
    assert tokens == [16] * layers + [150] * layers, tokens
    assert graphed.last_graphed is False  # the heavy batch's, set after the nested one's
    np.testing.assert_allclose(got, eager.embed(heavy), atol=1e-3)
    np.testing.assert_allclose(offered[0].result(), eager.embed(light), atol=1e-3)


def test_a_batch_outcome_says_whether_its_forward_replayed_a_graph(tiny_bf16, monkeypatch):
    """What the worker counts in tokq_worker_graphed_batches_total."""
    from tokq.workers.runner import BatchRunner

    _install(monkeypatch, "torch_varlen")
    _, graphed = _engines(tiny_bf16, "torch_varlen", max_tokens=64)

    def outcome(lens):
        return BatchRunner(graphed).run(_claim(lens))

    assert outcome([5, 9]).graphed is True
    assert outcome([60, 60]).graphed is False  # 120 tokens: past the graphs' 64
    assert outcome([5, 9]).graphed is True

    def fails(batch):
        raise RuntimeError("the model fails on this input")

    monkeypatch.setattr(graphed, "embed", fails)
    failed = outcome([5, 9])  # every forward fails (bisected down to each item)
    assert failed.num_failed == 2 and failed.graphed is False  # not the last batch's flag


def test_a_heavy_batch_outcome_is_not_graphed_by_the_light_batch_nested_in_it(tiny_bf16, monkeypatch):
    """One runner runs both (the worker's): the nested light batch replays a graph, the heavy
    one around it does not, and each outcome says so of its own forward."""
    from tokq.workers.preempt import Preemption
    from tokq.workers.runner import BatchRunner

    _install(monkeypatch, "torch_varlen")
    _, graphed = _engines(tiny_bf16, "torch_varlen")
    runner = BatchRunner(graphed)
    preemption = Preemption(runner.run)
    loop = asyncio.new_event_loop()
    offered = []

    def heavy_run():
        offered.append(preemption.offer(_claim([7, 3], batch_id="light"), loop))
        return runner.run(_claim([60, 50, 40], batch_id="heavy"))

    try:
        heavy = preemption.heavy(heavy_run)
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    assert offered[0].result().graphed is True and heavy.graphed is False
    assert heavy.num_failed == 0 and offered[0].result().num_failed == 0


def _claim(lens, batch_id: str = "b"):
    """A claim of one entry per length (random token ids), as the queue hands a worker."""
    from tokq.queue.wire import encode_body, format_entry, parse_entry

    rng = np.random.default_rng(0)
    bodies = [encode_body(rng.integers(1, VOCAB, size=n)) for n in lens]
    entries = [parse_entry(format_entry(n, 0, f"r{i}", 0, 0, 0, body))
               for i, (n, body) in enumerate(zip(lens, bodies))]
    return types.SimpleNamespace(entries=entries, batch_id=batch_id, now_ms=0)


@pytest.mark.slow
def test_captured_before_serving_every_short_query_batch_finds_its_graph(tiny_bf16, monkeypatch):
    fake = _install(monkeypatch, "torch_varlen")
    eager, graphed = _engines(tiny_bf16, "torch_varlen", max_tokens=128)
    graphs = graphed.graphs
    warm = graphs.warm_shapes()
    assert graphed.capture_graphs() == len(warm) == graphs.num_graphs
    assert graphed.capture_graphs() == 0  # all there already
    rng = np.random.default_rng(3)
    for _ in range(40):  # short queries (<= 64 tokens here, the model's max), up to 128 tokens a batch
        lens, total = [], 0
        while (n := int(rng.integers(1, 65))) + total <= 128 and len(lens) < int(rng.integers(1, 40)):
            lens.append(n)
            total += n
        batch = _batch(lens or [1], seed=int(rng.integers(1 << 30)))
        fake.calls.clear()
        got = graphed.embed(batch)
        assert {c["tokens"] for c in fake.calls} == {graphs.shape_of(batch.num_tokens, batch.num_seqs,
                                                                     batch.max_seqlen).num_tokens}
        np.testing.assert_allclose(got, eager.embed(batch), atol=2e-3)
    assert graphs.num_graphs == len(warm)  # no shape was new


@pytest.mark.parametrize("budget", [1, 16, 100, 128, 5000])
def test_the_warm_set_stops_at_the_bucket_a_full_budget_batch_takes(budget):
    graphs = CudaGraphs(None, torch.device("cpu"), 128, 64, capture=False)
    sizes = {shape.num_tokens for shape in graphs.warm_shapes(budget)}
    full = graphs.shape_of(min(budget, 128), 1, 1).num_tokens
    assert max(sizes) == full and sizes == {b for b in graphs.buckets if b <= full}


def test_engines_without_graphs_capture_nothing_before_serving(tiny_bf16):
    assert tiny_bf16.graphs is None and tiny_bf16.capture_graphs() == 0


def test_only_cuda_varlen_engines_get_graphs(tiny_bf16):
    assert Engine(tiny_bf16.info, tiny_bf16.model, tiny_bf16.device, tiny_bf16.dtype, "torch_varlen",
                  cuda_graph_tokens=4096).graphs is None  # on CPU


@pytest.mark.parametrize("size", [1, 16, 700, 4096])
def test_bench_batches_hold_exactly_their_token_count(size):
    from tokq.profiling.bench.graphs import workload_batch

    batch = workload_batch(size, max_length=256, vocab=VOCAB)
    assert batch.num_tokens == size and batch.max_seqlen <= 256 and batch.input_ids.max() < VOCAB


def test_bench_without_a_gpu_says_so_and_writes_nothing(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from tokq.profiling.bench.graphs import graphs_command

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    results = tmp_path / "RESULTS.md"
    out = CliRunner().invoke(graphs_command, ["--results-md", str(results)])
    assert out.exit_code == 0 and "no CUDA GPU" in out.output and not results.exists()


def test_bench_block_gives_each_size_and_the_ratio():
    from tokq.profiling.bench.graphs import markdown

    rows = [{"tokens": 64, "sequences": 4, "graphed": True, "graphs_ms": 2.0, "eager_ms": 8.0,
             "graphs_cpu_ms": 1.0, "eager_cpu_ms": 7.5, "min_cos": 0.99991},
            {"tokens": 8192, "sequences": 500, "graphed": False, "graphs_ms": 50.0, "eager_ms": 50.0,
             "graphs_cpu_ms": 9.0, "eager_cpu_ms": 9.0, "min_cos": 1.0}]
    model = {"name": "m", "dtype": "bfloat16", "attention": "torch_varlen", "layers": 6, "rows": rows,
             "graphs": {"count": 3, "capture_s": 0.4, "failed": None}}
    text = markdown("NVIDIA H100 80GB HBM3", "2.11.0", [model], 20, "tokq bench graphs")
    assert "| 64 | 4 | 2.00 | 8.00 | **4.00x** | 1.00 | 7.50 | 0.99991 |" in text
    assert "| 8,192 (both eager) | 500 |" in text and "3 graphs captured in 0.4 s" in text
    assert text.startswith("<!-- tokq bench graphs: start") and "NVIDIA H100 80GB HBM3" in text


# -- on a real GPU (marked cuda: skipped here) -------------------------------------------------

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_engines(path, backend: str) -> tuple[Engine, Engine]:
    if reason := attention.unavailable_reason(backend, torch.device("cuda"), torch.bfloat16):
        pytest.skip(reason)
    graphed = Engine.load(path, device="cuda", dtype="bfloat16", attn_backend=backend)
    eager = Engine.load(path, device="cuda", dtype="bfloat16", attn_backend=backend, cuda_graph_tokens=0)
    assert graphed.graphs is not None and eager.graphs is None
    return eager, graphed


@cuda
@needs_cuda
@pytest.mark.parametrize("backend", cuda_graphs.GRAPH_BACKENDS)
@pytest.mark.parametrize("model", MODELS)
def test_cuda_graph_replays_match_eager_forwards(tmp_path, model, backend):
    build(model, tmp_path)
    eager, graphed = _gpu_engines(tmp_path, backend)
    rng = np.random.default_rng(0)
    batches = [_batch(rng.integers(1, 65, size=int(rng.integers(1, 40))), seed=i) for i in range(30)]
    batches += [batches[3], batches[0]]  # shapes met again, after others
    for batch in batches:
        got, want = graphed.embed(batch), eager.embed(batch)
        assert np.isfinite(got).all()
        assert _cos(got, want).min() >= 0.999, _cos(got, want).min()
    assert graphed.graphs.failed is None and 1 <= graphed.graphs.num_graphs < len(batches)


@cuda
@needs_cuda
def test_cuda_graphs_on_the_bundled_model_match_eager_over_a_workload():
    from tokq.profiling import workload

    eager, graphed = _gpu_engines(None, "torch_varlen")
    lens_all = [min(q.num_tokens, eager.info.max_length) for q in workload.generate(600, seed=2)]
    rng = np.random.default_rng(1)
    start = 0
    worst = 1.0
    while start < len(lens_all):
        size = int(rng.integers(1, 64))
        lens = lens_all[start:start + size]
        batch = PackedBatch.pack([rng.integers(1000, 30000, size=n) for n in lens])
        got, want = graphed.embed(batch), eager.embed(batch)
        worst = min(worst, float(_cos(got, want).min()))
        start += size
    assert worst >= 0.999, worst
    assert graphed.graphs.failed is None and graphed.graphs.num_graphs >= 2
