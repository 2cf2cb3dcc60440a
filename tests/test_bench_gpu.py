"""`make bench-gpu`: on a CPU-only machine it says there is no GPU and exits 0 without touching
RESULTS.md; its Qwen3-0.6B-shaped model is a model tokq and sentence-transformers agree on; its
report computes MFU at the profiled budget and names the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tokq.profiling.bench.gpu import SECTION_END, SECTION_START, build_qwen3_shaped, markdown_section, mfu_at


@pytest.mark.skipif(torch.cuda.is_available(), reason="this is the CPU-only behaviour")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    results = tmp_path / "RESULTS.md"
    done = subprocess.run([sys.executable, "-m", "tokq.cli", "bench", "gpu", "--results-md", str(results),
                           "--out-dir", str(tmp_path / "gpu")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU" in done.stdout
    assert not results.exists() and not (tmp_path / "gpu").exists()


def test_qwen3_shaped_model_is_served_alike_by_tokq_and_sentence_transformers(tmp_path):
    from tokq.batch import PackedBatch
    from tokq.model.info import ModelInfo
    from tokq.profiling.bench.baselines.server import load_model
    from tokq.workers.engine import Engine

    path = build_qwen3_shaped(tmp_path / "qwen3", num_hidden_layers=1, vocab_size=30522)  # the full one: 28, 151,669
    info = ModelInfo.load(path)
    assert (info.family, info.hidden_size, info.pooling, info.normalize, info.max_length) == ("qwen3", 1024, "last",
                                                                                             True, 256)
    assert info.config["num_key_value_heads"] == 8 and info.config["head_dim"] == 128
    texts = ["red running shoes", "how do I reset my password on the website"]
    st = load_model(str(path))
    want = st.encode(texts, batch_size=1, normalize_embeddings=True)
    ids = [st.tokenizer(t)["input_ids"] for t in texts]
    engine = Engine.load(path, device="cpu", dtype="float32")
    got = engine.embed(PackedBatch.pack(ids))
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999


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
    return {"meta": {"options": {"step_duration_s": 2.0, "start_rate": 50.0, "step_factor": 1.5, "max_steps": 12},
                     "started_at": "2026-11-26T09:59:00+00:00"},
            "systems": list(systems)}


def test_report_gives_mfu_at_the_profiled_budget_and_the_gpu_name():
    profile = _profile()
    at = mfu_at(profile, 4000, 989e12)
    assert at["tokens"] == 4096 and at["mfu"] == pytest.approx(90e12 / 989e12)

    vectors = {"min_cos": 0.99987, "counts": False}
    cores = {"gateway": 0.98, "worker": 0.7, "redis": 0.2, "load generator": 0.9}
    bench = _bench(_system("tokq", 3000.0, token_budget=4096, budget_source="set", vectors=vectors,
                           sustainable={"cpu_cores": cores}),
                   _system("tokq", 2500.0, token_budget=2048, budget_source="default", vectors=vectors),
                   _system("one-at-a-time", 500.0))
    md = markdown_section("NVIDIA H100 80GB HBM3", 989e12, [{"name": "m", "profile": profile, "bench": bench}],
                          "make bench-gpu")
    assert md.startswith(SECTION_START) and md.rstrip().endswith(SECTION_END)
    assert "NVIDIA H100 80GB HBM3" in md and "989 TFLOP/s" in md and "Measured: 2026-11-26T09:58:22" in md
    assert ("| m | bfloat16 | 4096 | 5.00 ms | 90.0 TFLOP/s | 9.1% | 3000 | 2500 (2048) | 500 | 6.0x "
            "| 0.99987 (below the bench bar, 0.9999) |") in md
    assert "load steps of 2.0 s from 50.0 req/s, x1.5 each" in md
    assert ("CPU at tokq 4096's 3000 req/s, in cores: gateway 0.98, worker 0.70, redis 0.20, "
            "load generator 0.90.") in md


def test_report_bounds_what_a_short_ramp_could_not_pin_down():
    """A tokq system that no step failed is 'at least' its last rate; a one-at-a-time that met
    the SLO at no step sustains less than the lowest rate it failed at, so the ratio is bounded
    below by tokq's rate over that (rounded down)."""
    bench = _bench(_system("tokq", 4325.0, token_budget=4096, budget_source="default",
                           limit="no step failed up to 4325 req/s"),
                   _system("one-at-a-time", 0.0, steps=((75.0, 31.0), (50.0, 30.7))))
    md = markdown_section("NVIDIA H100 80GB HBM3", None, [{"name": "m", "profile": _profile(), "bench": bench}], "c")
    assert ("| – | >= 4325 (4096) | 0 | > 86x (one-at-a-time met the SLO at no step, not even 50 req/s; "
            "it served at most 31.0) | – |") in md
    assert "peak FLOP/s unknown" in md


def test_a_rate_the_load_generator_could_not_offer_bounds_tokq_below():
    """A ramp that stopped because the load generator fell behind says nothing of the server's
    limit: the rate it met is 'at least', and so is the best tokq's ratio to one-at-a-time (the
    first GPU run with the warm set printed MiniLM's 2,883 and 47.1x as if measured limits)."""
    bench = _bench(_system("tokq", 2883.0, token_budget=16384, budget_source="set", generator_limited=True,
                           limit="load generator fell behind (send lag p99 44 ms): this rate was not really offered"),
                   _system("tokq", 4325.0, token_budget=4096, budget_source="default",
                           limit="no step failed up to 4325 req/s"),
                   _system("one-at-a-time", 92.0))
    md = markdown_section("NVIDIA H100 80GB HBM3", None, [{"name": "m", "profile": _profile(), "bench": bench}], "c")
    assert "| >= 2883 | >= 4325 (4096) | 92 | >= 47.0x | – |" in md
    assert "the load generator could not offer the next" in md
    measured = _bench(_system("tokq", 3000.0, token_budget=4096, budget_source="set"), _system("one-at-a-time", 500.0))
    md = markdown_section("GPU", None, [{"name": "m", "profile": _profile(), "bench": measured}], "c")
    assert "| 3000 | – | 500 | 6.0x |" in md


def test_a_failed_model_is_reported_and_the_next_still_runs(tmp_path, monkeypatch):
    from tokq.profiling.bench import gpu

    ran = []

    def run_model(name, model_dir, out_dir, quick, gateway_procs):
        ran.append((name, model_dir))
        if name == "a":
            raise subprocess.CalledProcessError(1, [sys.executable, "-m", "tokq.cli", "bench", "service", "--quiet"])
        return {"name": name, "profile": _profile(), "bench": _bench(_system("tokq", 10.0, budget_source="set"))}

    monkeypatch.setattr(gpu, "run_model", run_model)
    def unbuildable():
        raise OSError("disk full")

    results = gpu.run_models([("a", lambda: None), ("b", lambda: tmp_path), ("c", unbuildable)], tmp_path, quick=True)
    assert ran == [("a", None), ("b", tmp_path)]
    assert results[0] == {"name": "a", "error": "`tokq bench service` exited 1"} and "profile" in results[1]
    assert results[2] == {"name": "c", "error": "OSError: disk full"}
    md = markdown_section("GPU", None, results, "c")
    assert "| a | failed: `tokq bench service` exited 1 |" in md and "| b | bfloat16 |" in md


def test_resume_renders_saved_results_without_measuring_or_a_gpu(tmp_path):
    """`tokq bench gpu --resume` reads a model's saved JSON instead of measuring it; with every
    model saved it rewrites the section on any machine (here: no GPU)."""
    from tokq.profiling.bench.gpu import QWEN3_NAME

    out = tmp_path / "gpu"
    out.mkdir()
    procs = 4  # the H100 host chose 4; `--gateway-procs 0` (the default) takes what the run chose
    for name in ("all-MiniLM-L6-v2", QWEN3_NAME):
        (out / f"gpu-profile-{name}.json").write_text(json.dumps(_profile()))
        (out / f"gpu-bench-{name}.json").write_text(json.dumps(_bench(
            _system("tokq", 900.0, token_budget=4096, budget_source="set", gateway_procs=procs),
            _system("one-at-a-time", 90.0))))
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n")
    env = {k: v for k, v in os.environ.items() if k != "TOKQ_DEVICE_PEAK_FLOPS"}
    done = subprocess.run([sys.executable, "-m", "tokq.cli", "bench", "gpu", "--resume", "--results-md", str(results),
                           "--out-dir", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "not measured again" in done.stderr
    md = results.read_text()
    assert md.startswith("# Results") and SECTION_START in md and "--resume`" in md
    assert "GPU: **NVIDIA H100 80GB HBM3**, dense 16-bit peak 989 TFLOP/s" in md  # the name saved by the profile
    assert md.count("| 900 | – | 90 | 10.0x |") == 2


def test_resume_does_not_pair_a_profile_with_an_older_bench(tmp_path):
    from tokq.profiling.bench.gpu import saved_result

    (tmp_path / "gpu-profile-m.json").write_text(json.dumps(_profile()))
    bench = _bench(_system("tokq", 900.0, token_budget=4096, budget_source="set"))
    (tmp_path / "gpu-bench-m.json").write_text(json.dumps(bench))
    assert saved_result("m", tmp_path)["bench"] == bench
    (tmp_path / "gpu-profile-m.json").write_text(json.dumps(_profile(budget=8192)))  # a new profile, another budget
    assert saved_result("m", tmp_path) is None
    later = {**_profile(), "started_at": "2026-11-26T10:30:00+00:00"}  # a new profile, the same budget
    (tmp_path / "gpu-profile-m.json").write_text(json.dumps(later))
    assert saved_result("m", tmp_path) is None


def test_each_model_runs_tokq_up_defaults_before_the_profiled_budget(tmp_path, monkeypatch):
    """The first GPU run had the profiled budget first, and it served less on both models; the
    defaults now run first, so the next run tells a budget effect from an order effect."""
    from tokq.profiling.bench import gpu

    calls = []

    def tokq(*args):
        calls.append(args)
        out = Path(args[args.index("--out") + 1])
        out.write_text(json.dumps(_profile(budget=8192) if args[0] == "profile" else _bench()))

    monkeypatch.setattr(gpu, "_tokq", tokq)
    monkeypatch.setattr("tokq.host.usable_cpus", lambda: 16)
    gpu.run_model("m", None, tmp_path, quick=True)
    bench = calls[1]
    assert bench[bench.index("--generator-procs") + 1] == "3"  # one Python process sends ~3,000 calls/s
    systems = [bench[i + 1] for i, a in enumerate(bench) if a == "--system"]
    assert systems == ["tokq-defaults", "tokq", "one-at-a-time"]
    assert bench[bench.index("--token-budgets") + 1] == "8192" and "--gateway-procs" not in bench
    gpu.run_model("m", None, tmp_path, quick=True, gateway_procs=4)  # passed on to the service bench
    assert calls[3][calls[3].index("--gateway-procs") + 1] == "4"


def test_the_section_says_how_many_gateway_processes_and_resume_keeps_to_them(tmp_path):
    from tokq.profiling.bench.gpu import saved_result

    bench = _bench(_system("tokq", 900.0, token_budget=4096, budget_source="set", gateway_procs=4))
    md = markdown_section("GPU", None, [{"name": "m", "profile": _profile(), "bench": bench}], "c")
    assert "tokq with 4 gateway processes." in md
    bench["meta"]["options"]["generator_procs"] = 3
    md = markdown_section("GPU", None, [{"name": "m", "profile": _profile(), "bench": bench}], "c")
    assert "tokq with 4 gateway processes, load from 3 processes." in md
    (tmp_path / "gpu-profile-m.json").write_text(json.dumps(_profile()))
    (tmp_path / "gpu-bench-m.json").write_text(json.dumps(bench))
    assert saved_result("m", tmp_path, gateway_procs=4) is not None
    assert saved_result("m", tmp_path, gateway_procs=1) is None  # a run asked for one does not reuse it
    assert saved_result("m", tmp_path) is not None  # asked for none (tokq up's choice): the run's own


def test_make_bench_gpu_runs_the_prefix_and_graphs_benchmarks_after_tokq_bench_gpu():
    # The README's promise: `make bench-gpu` runs both after `tokq bench gpu`, which runs neither.
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    recipe = makefile.split("\nbench-gpu:", 1)[1].split("\n\n", 1)[0]
    commands = [line.split()[1:4] for line in recipe.splitlines()[1:] if line.startswith("\t")]
    assert commands == [["bench", "gpu", "--results-md"], ["bench", "prefix", "--device"],
                        ["bench", "graphs", "--results-md"]]
