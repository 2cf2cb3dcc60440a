"""bench_runtime's own ceiling: the model's linear layers alone, every one of them, through the
engine's kernels and dtype; and its per-op profile (no timings asserted)."""

from __future__ import annotations

import pytest

from tiny_models import build
from tokq.batch import PackedBatch
from tokq.profiling.bench import runtime as bench_runtime
from tokq.workers.engine import Engine


@pytest.mark.parametrize("model,dtype", [("bert", "bfloat16"), ("qwen3_model", "float32")])
def test_linear_limit_runs_every_linear_weight_in_the_engines_dtype(tmp_path, model, dtype):
    build(model, tmp_path)
    engine = Engine.load(tmp_path, device="cpu", dtype=dtype)
    calls = bench_runtime.linear_calls(engine, num_tokens=8)
    assert sum(w.numel() for _, w, _ in calls) == engine.model.num_linear_params
    assert all(x.dtype == engine.dtype and x.shape == (8, w.shape[1]) for x, w, _ in calls)
    assert bench_runtime.linear_only_tokens_per_s(engine, num_tokens=8, repeats=1) > 0
    # the forward's own linear calls, epilogues included: the same weights, every one once
    fused = bench_runtime.forward_linear_calls(engine, num_tokens=8)
    assert sum(args[1].numel() for _, args in fused) == engine.model.num_linear_params
    kinds = {fn.__name__ for fn, _ in fused if hasattr(fn, "__name__")}
    assert ("act" in kinds) == (model == "bert")  # Qwen: SwiGLU outside
    # the residual add: fused into the linear, unless BERT's C norms add it in their own pass
    assert ("add" in kinds) == (model != "bert" or engine.model.norm.name == "torch")
    if model == "bert":
        expected = "activation" if engine.model.norm.name == "c" else "activation, residual add"
    else:
        expected = "residual add"
    assert bench_runtime.fused_epilogues(engine) == expected
    assert all(args[0].shape == (8, args[1].shape[1]) for _, args in fused)
    assert engine.model.linear is not None and type(engine.model.linear).__name__ != "Recorder"
    assert bench_runtime.forward_linears_tokens_per_s(engine, num_tokens=8, repeats=1) > 0
    table = bench_runtime.op_table(engine, [PackedBatch.pack([[1, 2, 3], [4, 5]])])
    assert "Self CPU" in table
    if engine.linear_backend != "c":  # the C linear runs through ctypes: not a torch op
        assert "linear" in table or "addmm" in table or "mm" in table


@pytest.mark.parametrize("model,dtype", [("bert", "bfloat16"), ("qwen3_model", "float32")])
def test_time_split_clocks_the_forwards_own_linear_and_attention_calls_and_restores_them(tmp_path, model, dtype):
    build(model, tmp_path)
    engine = Engine.load(tmp_path, device="cpu", dtype=dtype)
    kernel, attend = engine.model.linear, engine._attend
    batch = PackedBatch.pack([[1, 2, 3], [4, 5], [6]])
    before = engine.embed(batch)
    split = bench_runtime.time_split(engine, [batch, batch])
    assert list(split) == ["linear layers (epilogues included)", "attention",
                           "everything else (embedding, norms, layout, pooling)"]
    assert split["linear layers (epilogues included)"] > 0 and split["attention"] > 0
    assert split["everything else (embedding, norms, layout, pooling)"] >= 0
    assert engine.model.linear is kernel and engine._attend is attend
    assert (engine.embed(batch) == before).all()
