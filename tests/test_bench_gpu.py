"""`make bench-gpu`: on a CPU-only machine it says there is no GPU and exits 0 without touching
RESULTS.md; its Qwen3-0.6B-shaped model is a model tokq and sentence-transformers agree on; its
report computes MFU at the profiled budget and names the GPU."""

from __future__ import annotations

import subprocess
import sys

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
    from tokq.model_info import ModelInfo
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


def test_report_gives_mfu_at_the_profiled_budget_and_the_gpu_name():
    points = [{"num_tokens": n, "median_ms": ms, "tokens_per_s": n / ms * 1000, "gflop_per_s": g}
              for n, ms, g in ((1024, 2.0, 50_000.0), (4096, 5.0, 90_000.0), (16384, 19.0, 95_000.0))]
    profile = {"points": points, "recommended_budget": 4096, "dtype": "bfloat16", "summary": "a paragraph."}
    at = mfu_at(profile, 4000, 989e12)
    assert at["tokens"] == 4096 and at["mfu"] == pytest.approx(90e12 / 989e12)

    def system(kind, rps, **kw):
        return {"kind": kind, "name": f"{kind} {kw.get('token_budget', '')}", "sustainable_rps": rps, **kw}

    bench = {"systems": [system("tokq", 3000.0, token_budget=4096), system("tokq", 2500.0, token_budget=0),
                         system("one-at-a-time", 500.0)]}
    md = markdown_section("NVIDIA H100 80GB HBM3", 989e12, [{"name": "m", "profile": profile, "bench": bench}],
                          "make bench-gpu")
    assert md.startswith(SECTION_START) and md.rstrip().endswith(SECTION_END)
    assert "NVIDIA H100 80GB HBM3" in md and "989 TFLOP/s" in md
    assert "| m | bfloat16 | 4096 | 5.00 ms | 90.0 TFLOP/s | 9.1% | 3000 | 500 | 6.00x" in md
