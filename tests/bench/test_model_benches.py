"""The model benchmarks (`tokq bench runtime`, `dtypes`, `linear`, `prefix`) run at their smallest
size; the GPU ones (`tokq bench graphs`, `gpu`) say there is no GPU here, and `tokq bench gpu
--resume` renders its section from saved results, as it does after a GPU lease."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tokq.profiling.bench import gpu, prefix, runtime
from tokq.profiling.bench.dtypes import BLOCK as DTYPES, dtypes_command
from tokq.profiling.bench.graphs import graphs_command
from tokq.profiling.bench.linear import BLOCK as LINEAR, linear_command
from tokq.workers.kernels import cpu_linear
from tokq.workers.models import layers


def test_runtime(bench, monkeypatch):
    # the CPU's peak and the linear-layer limit on small shapes: what is timed, not how long
    monkeypatch.setattr(runtime, "matmul_peak_flops", functools.partial(runtime.matmul_peak_flops, 64, 1))
    for name in ("linear_only_tokens_per_s", "forward_linears_tokens_per_s"):
        monkeypatch.setattr(runtime, name, functools.partial(getattr(runtime, name), num_tokens=16, repeats=1))
    args = ["--num-queries", "6", "--rounds", "1", "--token-budgets", "64", "--threads", "1", "--dtype", "float32"]
    text = bench(runtime.runtime_command, args, runtime.block_name("float32"))
    assert f"Command: `tokq bench runtime {' '.join(args)} --results-md" in text
    assert re.search(r"^\| packed 64 \| [\d,]+ \|", text, re.M) and "| st one at a time |" in text
    assert "where the packed 1024 forward's time goes" in text and "attention alone, ms per layer" in text
    # forward time against batch tokens up to the budget: tokq's engine, then ONNX Runtime on one query
    assert re.search(r"^\| 1 \(1 query\) \| [\d.]+ \| [\d,]+ \| [\d.]+ \| [\d,]+ \|$", text, re.M)
    assert "| 64 (6 queries) |" in text and "| 128 " not in text


def test_dtypes(bench):
    text = bench(dtypes_command, ["--num-queries", "16", "--rounds", "1", "--dtype", "bfloat16", "--threads", "1"],
                 DTYPES)
    assert re.search(r"^\| float32 \| \w+ \| 1\.000000 \|", text, re.M) and "| bfloat16 |" in text


@pytest.mark.skipif(cpu_linear.unavailable_reason(torch.device("cpu"), torch.float32) is not None
                    or not layers._onednn_works(), reason="needs the C linear and oneDNN")
def test_linear(bench):
    from tokq.host import vector_extension

    text = bench(linear_command, ["--rows", "3,40", "--rounds", "1", "--threads", "1"],
                 f"{LINEAR} ({vector_extension()})")
    rows = re.findall(r"^\| (3|40) \| ([\d.]+) ms \| ([\d.]+) ms \|", text, re.M)
    assert [r[0] for r in rows] == ["3", "40"] and all(float(a) > 0 and float(b) > 0 for _, a, b in rows)


def test_prefix(bench, monkeypatch):
    def tiny(path, num_layers):  # the 0.6B widths cost minutes here
        import transformers

        torch.manual_seed(0)
        transformers.Qwen3Model(transformers.Qwen3Config(
            vocab_size=prefix.VOCAB, hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=256)).save_pretrained(path)
    monkeypatch.setattr(prefix, "build_model", tiny)
    args = ["--layers", "1", "--token-budget", "64", "--queries", "6", "--threads", "1", "--rounds", "1"]
    text = bench(prefix.prefix_command, args, prefix.block_name("cpu"))
    assert f"Command: `tokq bench prefix {' '.join(args)} --results-md" in text
    assert f" A shared {os.cpu_count()}-CPU machine: the ratios" in text
    assert "| instruction (20 tok) + 10-token queries | prompt computed once | 1 | 180 | 60 |" in text
    # batches are counted as the queue counts them: the prompt's tokens are not queued on the prefix path
    seqs = [np.concatenate([np.arange(1, 21), np.arange(100, 110)]) for _ in range(10)]
    assert [b.num_seqs for b in prefix.batches(seqs, [20] * 10, budget=100, shared=False)] == [3, 3, 3, 1]
    assert [b.num_queued_tokens for b in prefix.batches(seqs, [20] * 10, budget=100, shared=True)] == [100]


def test_graphs_and_gpu_without_a_gpu_say_so_and_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    results = tmp_path / "gpu.md"
    for command, args in ((graphs_command, []), (gpu.gpu_command, ["--out-dir", str(tmp_path / "gpu")])):
        out = CliRunner().invoke(command, [*args, "--results-md", str(results)])
        assert out.exit_code == 0 and "no CUDA GPU" in out.output, out.output
    assert not results.exists() and not (tmp_path / "gpu").exists()


def _profile(budget=4096):
    points = [{"num_tokens": n, "median_ms": ms, "tokens_per_s": n / ms * 1000, "gflop_per_s": g}
              for n, ms, g in ((1024, 2.0, 50_000.0), (4096, 5.0, 90_000.0), (16384, 19.0, 95_000.0))]
    return {"points": points, "recommended_budget": budget, "dtype": "bfloat16", "summary": "a paragraph.",
            "device_name": "NVIDIA H100 80GB HBM3", "started_at": "2026-11-26T09:58:22+00:00",
            "sweep": {"target_s_per_point": 0.3}}


def _system(kind, rps, *, steps=(), limit="p99 600 ms > SLO 500 ms", **kw):
    return {"kind": kind, "name": f"{kind} {kw.get('token_budget', '')}", "sustainable_rps": rps, "limit": limit,
            "steps": [{"offered_rps": offered, "throughput_rps": served} for offered, served in steps], **kw}


def _bench(*systems):
    return {"meta": {"options": {"step_duration_s": 2.0, "start_rate": 50.0, "step_factor": 1.5, "max_steps": 12,
                                 "generator_procs": 3}, "started_at": "2026-11-26T09:59:00+00:00"},
            "systems": list(systems)}


def test_gpu_resume_renders_saved_results_with_lower_bounds_and_links(bench, tmp_path, monkeypatch):
    """MFU at the profiled budget; '>=' where no step failed or the generator could not offer the
    next rate; a one-at-a-time that met the SLO at no step bounds the ratio below."""
    out = tmp_path / "gpu"
    out.mkdir()
    cores = {"gateway": 0.98, "worker": 0.7, "redis": 0.2, "load generator": 0.9}
    saved = {"all-MiniLM-L6-v2": _bench(
                 _system("tokq", 2883.0, token_budget=4096, budget_source="set", gateway_procs=4, generator_limited=True,
                         vectors={"min_cos": 0.99987, "counts": False}, sustainable={"cpu_cores": cores}),
                 _system("one-at-a-time", 92.0)),
             gpu.QWEN3_NAME: _bench(
                 _system("tokq", 4325.0, token_budget=4096, budget_source="set", gateway_procs=4,
                         limit="no step failed up to 4325 req/s"),
                 _system("one-at-a-time", 0.0, steps=((75.0, 31.0), (50.0, 30.7))))}
    for name, saved_bench in saved.items():
        (out / f"gpu-profile-{name}.json").write_text(json.dumps(_profile()))
        (out / f"gpu-bench-{name}.json").write_text(json.dumps(saved_bench))
    monkeypatch.delenv("TOKQ_DEVICE_PEAK_FLOPS", raising=False)
    text = bench(gpu.gpu_command, ["--resume", "--out-dir", str(out)], gpu.BLOCK)
    assert "GPU: **NVIDIA H100 80GB HBM3**, dense 16-bit peak 989 TFLOP/s" in text  # the name the profile saved
    assert ("| all-MiniLM-L6-v2 | bfloat16 | 4096 | 5.00 ms | 90.0 TFLOP/s | 9.1% | >= 2883 | – | 92 | >= 31.3x "
            "| 0.99987 (below the bench bar, 0.9999) |") in text
    assert "| >= 4325 | – | 0 | > 86x (one-at-a-time met the SLO at no step, not even 50 req/s; it served" in text
    assert "tokq with 4 gateway processes, load from 3 processes. CPU at tokq 4096's 2883 req/s, in cores: " \
           "gateway 0.98, worker 0.70, redis 0.20, load generator 0.90." in text
    assert "[all-MiniLM-L6-v2 profile](gpu/gpu-profile-all-MiniLM-L6-v2.json) and [bench](gpu/gpu-bench-" in text
    # a profile newer than its bench, or with another budget, is not paired with it
    (out / f"gpu-profile-{gpu.QWEN3_NAME}.json").write_text(json.dumps(_profile(budget=8192)))
    assert gpu.saved_result(gpu.QWEN3_NAME, out) is None and gpu.saved_result("all-MiniLM-L6-v2", out, 1) is None


def test_gpu_runs_each_model_defaults_first_and_reports_a_failed_one(tmp_path, monkeypatch):
    calls = []

    def tokq(*args):
        calls.append(args)
        if "qwen" in " ".join(args):
            raise subprocess.CalledProcessError(1, [sys.executable, "-m", "tokq.cli", *args])
        (tmp_path / args[args.index("--out") + 1].rsplit("/", 1)[1]).write_text(
            json.dumps(_profile(budget=8192) if args[0] == "profile" else _bench()))
    monkeypatch.setattr(gpu, "_tokq", tokq)
    monkeypatch.setattr("tokq.host.usable_cpus", lambda: 16)
    results = gpu.run_models([("m", lambda: None), ("qwen", lambda: tmp_path)], tmp_path, quick=True, gateway_procs=4)
    service = calls[1]
    assert [service[i + 1] for i, a in enumerate(service) if a == "--system"] == ["tokq-defaults", "tokq",
                                                                                 "one-at-a-time"]
    assert service[service.index("--token-budgets") + 1] == "8192" and service[service.index("--gateway-procs") + 1] == "4"
    assert service[service.index("--generator-procs") + 1] == "3"  # one Python process sends ~3,000 calls/s
    assert results[1] == {"name": "qwen", "error": "`tokq profile` exited 1"}
    assert "| qwen | failed: `tokq profile` exited 1 |" in gpu.markdown_section("GPU", None, results, "c")


def test_the_qwen3_shaped_model_is_served_alike_by_tokq_and_sentence_transformers(tmp_path):
    from tokq.batch import PackedBatch
    from tokq.model.info import ModelInfo
    from tokq.profiling.bench.baselines.server import load_model
    from tokq.workers.engine import Engine

    path = gpu.build_qwen3_shaped(tmp_path / "qwen3", num_hidden_layers=1, vocab_size=30522)  # the full one: 28, 151,669
    info = ModelInfo.load(path)
    assert (info.family, info.hidden_size, info.pooling, info.normalize, info.max_length) == ("qwen3", 1024, "last",
                                                                                             True, 256)
    texts = ["red running shoes", "how do I reset my password on the website"]
    st = load_model(str(path))
    want = st.encode(texts, batch_size=1, normalize_embeddings=True)
    got = Engine.load(path, device="cpu", dtype="float32").embed(PackedBatch.pack([st.tokenizer(t)["input_ids"]
                                                                                   for t in texts]))
    assert ((got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))).min() >= 0.9999


@pytest.mark.parametrize("model,dtype", [("bert", "bfloat16"), ("qwen3_model", "float32")])
def test_the_runtime_limit_covers_every_linear_weight_and_the_split_leaves_the_engine_as_it_was(tmp_path, model, dtype):
    from tiny_models import build
    from tokq.batch import PackedBatch
    from tokq.workers.engine import Engine

    build(model, tmp_path)
    engine = Engine.load(tmp_path, device="cpu", dtype=dtype)
    calls = runtime.linear_calls(engine, num_tokens=8)
    assert sum(w.numel() for _, w, _ in calls) == engine.model.num_linear_params
    assert all(x.dtype == engine.dtype and x.shape == (8, w.shape[1]) for x, w, _ in calls)
    fused = runtime.forward_linear_calls(engine, num_tokens=8)  # the same weights, each once, epilogues included
    assert sum(args[1].numel() for _, args in fused) == engine.model.num_linear_params
    # BERT fuses its activation (and its residual add, unless its C norms add it); Qwen its residual add
    if model == "bert":
        assert runtime.fused_epilogues(engine) == ("activation" if engine.model.norm.name == "c"
                                                   else "activation, residual add")
    else:
        assert runtime.fused_epilogues(engine) == "residual add"
    kernel, attend, batch = engine.model.linear, engine._attend, PackedBatch.pack([[1, 2, 3], [4, 5], [6]])
    before = engine.embed(batch)
    split = runtime.time_split(engine, [batch, batch])
    assert split[runtime.LINEAR] > 0 and split["attention"] > 0 and len(split) == 3
    assert engine.model.linear is kernel and engine._attend is attend and (engine.embed(batch) == before).all()
