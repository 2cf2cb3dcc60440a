"""The profile sweep: grid, packed batches, repeat rule, early stops, OOM, report and figure.

Timing here runs on a simulated clock that a forward pass advances by a known latency curve,
so the sweep and fit are checked against the truth with no timed assertions. The real model
on the real clock is exercised in test_profile_cli.py.
"""

from __future__ import annotations

import gc
import io
import json
import weakref
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tokq.batch import PackedBatch
from tokq.model.info import ModelInfo
from tokq.profiling import workload
from tokq.profiling.profile.sweep import CudaEventTimer, SweepConfig, WallTimer, sweep, token_grid
from tokq.profiling.profile.run import analyze, run_profile
from tokq.profiling.profile.batches import BatchMaker, TokenIds, token_ids_for


@dataclass
class SimulatedForward:
    """A forward pass whose cost is ``latency_ms(num_tokens)`` on its own clock."""

    latency_ms: object
    now_s: float = 0.0
    calls: list[int] = field(default_factory=list)

    def clock(self) -> float:
        return self.now_s

    def __call__(self, batch: PackedBatch) -> None:
        self.calls.append(batch.num_tokens)
        self.now_s += self.latency_ms(batch.num_tokens) / 1000.0


def hinge(flat_ms=8.0, knee_tokens=600, ms_per_token=8.0 / 600):
    return lambda n: flat_ms + ms_per_token * max(0, n - knee_tokens)


def random_batches(max_length=512, seed=0):
    ids = TokenIds(vocab_ids=np.arange(1000, 2000), prefix=(101,), suffix=(102,), seed=seed)
    return BatchMaker(workload.generate(2000, seed=seed), ids, max_length)


FAST = SweepConfig(min_tokens=16, max_tokens=16384, points_per_doubling=1, warmup_runs=1,
                   min_repeats=3, max_repeats=5, target_s_per_point=0.0, stop_ms=1e9)


def test_token_grid_is_geometric_and_includes_both_ends():
    assert token_grid(16, 16384, 1) == [16 * 2**i for i in range(11)]
    grid = token_grid(16, 1000, 2)
    assert grid[0] == 16 and grid[-1] == 1000
    ratios = np.diff(np.log2(grid[:-1]))
    assert np.allclose(ratios, 0.5, atol=0.05)


def test_batches_hold_exactly_the_requested_tokens_in_workload_order():
    queries = workload.generate(3000, seed=3)
    make = BatchMaker(queries, TokenIds(vocab_ids=np.arange(5, 50)), max_length=128)
    first = make(1000)
    assert first.num_tokens == 1000
    lens = first.seqlens.tolist()
    expected = [min(q.num_tokens, 128) for q in queries[:len(lens)]]
    assert lens[:-1] == expected[:-1] and lens[-1] <= expected[-1]
    second = make(4096)
    assert second.num_tokens == 4096 and second.max_seqlen <= 128


def test_sequences_are_wrapped_in_special_tokens_with_ordinary_ids_inside():
    batch = random_batches(max_length=64)(2048)
    for start, end in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:]):
        seq = batch.input_ids[start:end]
        assert seq[0] == 101
        if seq.size >= 2:
            assert seq[-1] == 102
            assert np.all((seq[1:-1] >= 1000) & (seq[1:-1] < 2000))


def test_bundled_model_ids_come_from_its_tokenizer(bundled_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundled_model_dir))
    ids = token_ids_for(ModelInfo.load(bundled_model_dir), seed=1)
    assert ids.prefix == (tok.cls_token_id,) and ids.suffix == (tok.sep_token_id,)
    assert not set(tok.all_special_ids) & set(ids.vocab_ids.tolist())
    text = "how many tokens does this query have"
    query = workload.Query(id=7, num_tokens=999, t_s=0.0, text=text)
    assert ids(query, 512).tolist() == tok(text)["input_ids"]  # the text's own length, not "tokens"
    cut = ids(query, 4)
    assert cut.tolist() == tok(text)["input_ids"][:3] + [tok.sep_token_id]


def test_model_without_tokenizer_gets_random_ids_below_vocab_size(tmp_path):
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=64, architectures=["Qwen3Model"]).save_pretrained(tmp_path)
    ids = token_ids_for(ModelInfo.load(tmp_path))
    assert not ids.has_tokenizer and ids.prefix == () and ids.suffix == ()
    batch = BatchMaker(workload.generate(500), ids, max_length=256)(3000)
    assert batch.num_tokens == 3000
    assert batch.input_ids.min() >= 0 and batch.input_ids.max() < 300


def test_repeats_until_min_repeats_and_the_time_target():
    cfg = SweepConfig(min_tokens=64, max_tokens=64, min_repeats=3, max_repeats=50, target_s_per_point=1.0,
                      warmup_runs=2)
    for cost_ms, expected in [(125.0, 8), (1.0, 50), (600.0, 3)]:
        fwd = SimulatedForward(lambda n, c=cost_ms: c)
        [point] = sweep(fwd, random_batches(), cfg, WallTimer(fwd.clock)).points
        assert point.num_repeats == expected and len(fwd.calls) == expected + 2  # + warm-up runs
        assert point.median_ms == pytest.approx(cost_ms)


def test_repeats_are_interleaved_across_batch_sizes():
    fwd = SimulatedForward(hinge())
    cfg = SweepConfig(min_tokens=16, max_tokens=64, points_per_doubling=1, warmup_runs=1, min_repeats=3,
                      max_repeats=3, target_s_per_point=0.0)
    progress = []
    sweep(fwd, random_batches(), cfg, WallTimer(fwd.clock), on_progress=lambda *step: progress.append(step))
    # pass 1: warm-up + one timed run per size, climbing; pass 2: round-robin rounds
    assert fwd.calls == [16, 16, 32, 32, 64, 64] + [16, 32, 64] * 2
    assert progress[-1] == ("done", 6, 6) and [c for _, c, _ in progress] == sorted(c for _, c, _ in progress)


def test_out_of_memory_while_repeating_drops_that_size_and_larger():
    base = SimulatedForward(hinge())
    seen = []

    def forward(batch):
        seen.append(batch.num_tokens)
        if batch.num_tokens == 2048 and seen.count(2048) == 3:  # warm-up, pass 1, then fails in pass 2
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        base(batch)

    result = sweep(forward, random_batches(), FAST, WallTimer(base.clock))
    assert [p.num_tokens for p in result.points] == token_grid(16, 1024, 1)
    assert result.out_of_memory_tokens == 2048 and "out of memory at 2048" in result.stopped_reason
    assert all(p.num_repeats == 3 for p in result.points)


def test_sweep_and_fit_recover_the_knee_of_the_forward_pass():
    fwd = SimulatedForward(hinge(knee_tokens=600))
    result = sweep(fwd, random_batches(), FAST, WallTimer(fwd.clock))
    assert result.stopped_reason is None
    assert [p.num_tokens for p in result.points] == token_grid(16, 16384, 1)
    fit, rec = analyze(result.points)
    assert fit.kind == "knee" and abs(np.log2(fit.knee_tokens / 600)) <= 1
    assert rec.token_budget == 1024 and rec.limited_by == "throughput"  # 512 tokens: 85% of the peak


def test_points_carry_the_achieved_flop_rate_when_the_model_counts_flops():
    fwd = SimulatedForward(lambda n: 2.0)
    result = sweep(fwd, random_batches(), SweepConfig(**{**FAST.__dict__, "max_tokens": 64}), WallTimer(fwd.clock),
                   batch_flops=lambda batch: 1e6 * batch.num_tokens)
    # 16 tokens * 1 MFLOP in 2 ms = 8 GFLOP/s
    assert [p.gflop_per_s for p in result.points] == pytest.approx([8.0, 16.0, 32.0])
    assert sweep(fwd, random_batches(), FAST, WallTimer(fwd.clock)).points[0].gflop_per_s is None


def test_sweep_stops_once_a_batch_is_slower_than_the_bound():
    fwd = SimulatedForward(hinge())
    cfg = SweepConfig(**{**FAST.__dict__, "stop_ms": 50.0})
    result = sweep(fwd, random_batches(), cfg, WallTimer(fwd.clock))
    assert result.points[-1].num_tokens == 4096 and result.points[-1].median_ms > 50.0
    assert "over the 50 ms bound" in result.stopped_reason
    assert max(fwd.calls) == 4096


@pytest.mark.parametrize("error", [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
                                   MemoryError(),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ...")])
def test_out_of_memory_ends_the_sweep_with_a_report_not_a_crash(error):
    base = SimulatedForward(hinge())

    def forward(batch):
        if batch.num_tokens > 2048:
            raise error
        base(batch)

    result = sweep(forward, random_batches(), FAST, WallTimer(base.clock))
    assert [p.num_tokens for p in result.points][-1] == 2048
    assert result.out_of_memory_tokens == 4096
    assert result.stopped_reason.startswith("out of memory at 4096 tokens")


class CublasAllocError(RuntimeError):  # a Python-level class: its instances can be weakly referenced
    pass


@pytest.mark.parametrize("error_cls,message", [
    (torch.cuda.OutOfMemoryError, "CUDA out of memory. Tried to allocate 2 GiB"),
    (CublasAllocError, "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")])
@pytest.mark.parametrize("fail_at_call", [2, 7], ids=["scanning", "repeating"])
def test_cache_is_emptied_after_the_out_of_memory_exception_is_released(error_cls, message, fail_at_call):
    """The traceback holds the failed forward's activations: emptying the cache while it is
    alive frees nothing. cuBLAS's own allocation failure counts as out of memory too."""
    base = SimulatedForward(hinge())
    raised, released, calls = [], [], []

    def forward(batch):
        calls.append(batch.num_tokens)
        if batch.num_tokens >= 64 and len(calls) >= fail_at_call:
            exc = error_cls(message)
            raised.append(weakref.ref(exc))
            raise exc
        base(batch)

    def release():
        gc.collect()
        released.append(all(ref() is None for ref in raised))

    result = sweep(forward, random_batches(), FAST, WallTimer(base.clock), release=release)
    assert result.out_of_memory_tokens is not None and result.stopped_reason.startswith("out of memory")
    assert released and all(released)


def test_errors_other_than_out_of_memory_are_raised():
    def forward(batch):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        sweep(forward, random_batches(), FAST)


@dataclass
class SimulatedEngine:
    """The Engine's profile-facing surface over a simulated forward (no weights loaded)."""

    info: ModelInfo
    embed: SimulatedForward
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    attn_backend: str = "simulated"


def test_report_and_figure_of_a_profile(bundled_model_dir, tmp_path):
    from matplotlib.image import imread

    from tokq.profiling.profile.plot import plot_profile

    fwd = SimulatedForward(hinge(knee_tokens=600))
    engine = SimulatedEngine(ModelInfo.load(bundled_model_dir), fwd)
    report = run_profile(engine, workload.generate(1000), FAST, timer=WallTimer(fwd.clock))
    report = json.loads(json.dumps(report))  # what --out writes
    assert report["model"] == "all-MiniLM-L6-v2" and report["dtype"] == "float32"
    assert report["recommended_budget"] == 1024 and report["fit"]["kind"] == "knee"
    assert report["flat_ms"] == pytest.approx(8.0, rel=0.01)
    assert report["workload"]["token_ids"] == "random" and len(report["points"]) == 11
    assert "Recommended token budget: 1024" in report["summary"] and "limited by throughput" in report["summary"]
    assert report["slo_p99_ms"] == 500.0 and report["max_batch_ms"] == 250.0 and report["limited_by"] == "throughput"
    assert report["recommendation"]["latency_cap_tokens"] == 16384
    assert report["saturation"] == {"fraction": 0.95, "tokens": 1024, "peak_tokens_per_s": pytest.approx(75_000, rel=0.01)}
    png = plot_profile(report, tmp_path / "p.png")
    assert imread(png).shape[:2] == (700, 800)


def test_figure_and_summary_without_a_fit(bundled_model_dir, tmp_path):
    from matplotlib.image import imread

    from tokq.profiling.profile.plot import plot_profile

    fwd = SimulatedForward(hinge())
    cfg = SweepConfig(**{**FAST.__dict__, "max_tokens": 32})
    report = run_profile(SimulatedEngine(ModelInfo.load(bundled_model_dir), fwd), workload.generate(100), cfg,
                         timer=WallTimer(fwd.clock))
    assert report["fit"] is None and report["recommended_budget"] is None
    assert "Too few points" in report["summary"]
    assert imread(plot_profile(report, tmp_path / "p.png")).shape[:2] == (700, 800)


def test_a_workload_with_some_texts_is_labelled_mixed(bundled_model_dir):
    from tokq.profiling.profile.cli import markdown_block

    queries = [workload.Query(q.id, q.num_tokens, q.t_s, text=f"query {q.id}" if q.id < 300 else None)
               for q in workload.generate(1000)]
    fwd = SimulatedForward(hinge())
    report = run_profile(SimulatedEngine(ModelInfo.load(bundled_model_dir), fwd), queries, FAST,
                         timer=WallTimer(fwd.clock))
    label = "mixed: text for 300 of 1000 queries, random for the rest"
    assert report["workload"]["token_ids"] == label  # was "random"
    assert f"token ids {label}." in markdown_block(report, "tokq profile")
    from tokq.profiling.profile.run import token_ids_label

    assert token_ids_label(queries, has_tokenizer=False) == "random"  # no tokenizer reads the texts


def test_a_10_second_goal_prints_plainly_in_summary_table_and_results_md(bundled_model_dir):
    from rich.console import Console

    from tokq.profiling.profile.cli import budget_table, markdown_block

    fwd = SimulatedForward(hinge())
    engine = SimulatedEngine(ModelInfo.load(bundled_model_dir), fwd)
    report = run_profile(engine, workload.generate(1000), FAST, slo_p99_ms=10_000.0, timer=WallTimer(fwd.clock))
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(budget_table(report))
    table, block = console.export_text(), markdown_block(report, "tokq profile")
    assert "Latency goal p99 <= 10,000 ms: a forward may take 5,000 ms" in report["summary"]
    assert "10,000 ms" in table and "5,000 ms" in table and "| 10,000 ms | 5,000 ms |" in block
    assert "flat at 8 ms" in report["summary"]  # small values as before
    assert "e+" not in report["summary"] + table + block


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_event_timer_times_work_on_the_gpu():
    weight = torch.randn(1024, 1024, device="cuda")

    def forward(batch):
        x = torch.randn(batch.num_tokens, 1024, device="cuda")
        for _ in range(8):
            x = x @ weight
        x.sum().item()

    cfg = SweepConfig(min_tokens=64, max_tokens=65536, points_per_doubling=1, target_s_per_point=0.05)
    result = sweep(forward, random_batches(), cfg, CudaEventTimer("cuda"))
    assert len(result.points) == 11 and all(p.median_ms > 0 for p in result.points)
    assert result.points[-1].median_ms > result.points[0].median_ms
