"""Which dtype ``auto`` picks (per CPU feature / GPU capability, never assumed), the supported
torch range, and how close each dtype's embeddings stay to fp32 on all-MiniLM-L6-v2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tokq.batch import PackedBatch
from tokq.host import cpu_flags
from tokq.workers import device, pooling
from tokq.workers.engine import Engine
from tokq.workers.layout import build_layout

QUERIES = ["how do I reset my router", "cheap flights to lisbon in may", "a",
           "symptoms of vitamin d deficiency in adults", "python asyncio run blocking code in thread",
           "best hiking trails near zurich with kids", "what is the capital of australia",
           "token budgets decide how many inputs share one forward pass"]


@pytest.mark.parametrize("flags,native", [({"avx512f", "avx512_bf16"}, True), ({"amx_bf16", "amx_tile"}, True),
                                          ({"avx2", "avx512f", "avx512_vnni"}, False), (set(), False)])
def test_cpu_bf16_needs_native_bf16_dot_products(flags, native):
    assert device.cpu_has_native_bf16(flags) is native


@pytest.mark.parametrize("native", [True, False])
def test_cpu_auto_is_bf16_only_where_native(monkeypatch, native):
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda flags=None: native)
    expected = torch.bfloat16 if native else torch.float32
    assert device.resolve_dtype("auto", torch.device("cpu")) == expected


def test_this_cpus_auto_dtype_follows_its_cpuinfo_flags():
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags here")
    expected = torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32
    assert device.resolve_dtype("auto", torch.device("cpu")) == expected


@pytest.mark.parametrize("capability,expected", [((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16),
                                                 ((7, 5), torch.float16), ((7, 0), torch.float16),
                                                 ((6, 1), torch.float32)])
def test_cuda_auto_dtype_per_capability(monkeypatch, capability, expected):
    monkeypatch.setattr(device, "cuda_capability", lambda dev: capability)
    assert device.resolve_dtype("auto", torch.device("cuda")) == expected


def test_explicit_dtypes_and_an_unknown_one():
    cpu = torch.device("cpu")
    assert [device.resolve_dtype(d, cpu) for d in ("float32", "bfloat16", "float16")] == \
        [torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16"):
        device.resolve_dtype("int8", cpu)


def test_supported_torch_range():
    assert device.torch_version_error("2.13.0+cpu") is None
    assert device.torch_version_error("2.6.0") is None
    assert device.torch_version_error(torch.__version__) is None
    error = device.torch_version_error("2.5.1+cu121")
    assert "torch >= 2.6" in error and "2.5.1" in error and "\n" not in error
    with pytest.raises(RuntimeError, match="torch >= 2.6"):
        device.check_torch_version("1.13.1")


def test_worker_refuses_an_unsupported_torch_in_one_line(monkeypatch):
    from tokq.workers.cli import worker_command

    message = device.torch_version_error("2.4.0")
    monkeypatch.setattr(device, "torch_version_error", lambda: message)
    result = CliRunner().invoke(worker_command, ["--device", "cpu"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == ["Error: " + message]


def test_pyproject_floor_is_the_enforced_one():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    floor = ".".join(map(str, device.MIN_TORCH))
    assert f"torch>={floor}" in project["dependencies"]


@pytest.fixture(scope="module")
def fp32_engine():
    return Engine.load(device="cpu", dtype="float32")


def _ids(engine, texts):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine.info.path / "tokenizer.json"))
    return [e.ids for e in tok.encode_batch(texts)]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_bf16_embeddings_match_fp32(fp32_engine):
    bf16 = Engine.load(device="cpu", dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    batch = PackedBatch.pack(_ids(fp32_engine, QUERIES))
    got = bf16.embed(batch)
    assert got.dtype == np.float32  # pooled and normalized in fp32
    assert _cosines(got, fp32_engine.embed(batch)).min() >= 0.999


def test_fp16_embeddings_match_fp32_where_the_cpu_runs_fp16(fp32_engine):
    try:
        fp16 = Engine.load(device="cpu", dtype="float16")
        batch = PackedBatch.pack(_ids(fp32_engine, QUERIES))
        got = fp16.embed(batch)
    except (RuntimeError, NotImplementedError) as exc:  # an op without a CPU fp16 kernel
        pytest.skip(f"torch {torch.__version__} cannot run this model in fp16 on CPU: {exc}")
    assert np.isfinite(got).all()
    assert _cosines(got, fp32_engine.embed(batch)).min() >= 0.999


@pytest.mark.parametrize("kind", ["mean", "cls", "last"])
def test_pooling_is_done_in_fp32(kind):
    batch = PackedBatch.pack([[1, 2, 3], [4], [5, 6]])
    layout = build_layout(batch, torch.device("cpu"), "sdpa_loop")
    hidden = torch.randn(batch.num_tokens, 8).bfloat16()
    pooled = pooling.pool(hidden, layout, kind)
    assert pooled.dtype == torch.float32
    if kind == "mean":  # summed in fp32, not in bf16
        torch.testing.assert_close(pooled[0], hidden[:3].float().mean(0))


def test_accuracy_report_compares_with_fp32(tmp_path):
    from tokq.profiling.bench import dtypes as accuracy_dtype

    rng = np.random.default_rng(0)
    ref = rng.normal(size=(40, 16))
    same = accuracy_dtype.compare(ref, ref.copy())
    assert same["cos_min"] == pytest.approx(1.0) and same["nn_mean"] == 1.0 and same["finite"]
    noisy = accuracy_dtype.compare(ref, ref + rng.normal(scale=0.5, size=ref.shape))
    assert noisy["cos_min"] < 0.99 and noisy["nn_mean"] < 1.0


def test_tokq_bench_dtypes_rewrites_its_block_of_results_md(tmp_path):
    from click.testing import CliRunner

    from tokq.profiling.bench.dtypes import SECTION_START, dtypes_command

    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## Other\nkept\n")
    args = ["--num-queries", "16", "--rounds", "1", "--dtype", "bfloat16", "--threads", "1", "--results-md", str(results)]
    for _ in range(2):
        done = CliRunner().invoke(dtypes_command, args)
        assert done.exit_code == 0, done.output
    text = results.read_text()
    assert "kept" in text and text.count(SECTION_START) == 1
    assert f"`tokq bench dtypes {' '.join(args)}`" in text and "| bfloat16 |" in text
