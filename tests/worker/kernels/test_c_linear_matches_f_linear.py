"""The C fp32 linear (workers/kernels/cpu_linear.c) against F.linear: every row count's remainder of its
row blocks, an output width its panels do not divide, bias or none, the residual add, strided
inputs, the activations, and its work split over threads."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tiny_models import build
from tokq.batch import PackedBatch
from tokq.workers.kernels import cpu_linear
from tokq.workers.engine import Engine
from tokq.workers.models import layers

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(cpu_linear.unavailable_reason(CPU, torch.float32) is not None,
                                reason=str(cpu_linear.unavailable_reason(CPU, torch.float32)))
TOL = dict(atol=1e-4, rtol=1e-4)


def _weights(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.1, torch.randn(n, generator=gen)


@pytest.mark.parametrize("n", [96, 100, 7])  # whole panels, a narrow last one, a lone narrow one
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 64])
def test_matches_f_linear(n, rows):
    w, b = _weights(n, 40)
    x = torch.randn(rows, 40)
    residual = torch.randn(rows, n)
    ours = cpu_linear.CLinear()
    packed = ours.pack(w)
    assert packed.shape == w.shape and not torch.equal(packed, w)  # same size, panel order
    torch.testing.assert_close(ours(x, packed, b), F.linear(x, w, b), **TOL)
    torch.testing.assert_close(ours(x, packed), F.linear(x, w), **TOL)
    torch.testing.assert_close(ours.add(x, packed, b, residual), F.linear(x, w, b) + residual, **TOL)


def test_strided_input_and_residual_are_read_correctly():
    w, b = _weights(64, 48)
    wide = torch.randn(9, 96)
    x = wide[:, 48:]  # a column slice: row stride 96
    residual = torch.randn(9, 128)[:, 64:]
    ours = cpu_linear.CLinear()
    torch.testing.assert_close(ours.add(x, ours.pack(w), b, residual), F.linear(x, w, b) + residual, **TOL)
    x_t = torch.randn(48, 9).t()  # not contiguous along a row: copied first
    torch.testing.assert_close(ours(x_t, ours.pack(w), b), F.linear(x_t, w, b), **TOL)


@pytest.mark.parametrize("act_name", sorted(layers.ACTIVATIONS))
def test_activations_match_torch(act_name):
    w, b = _weights(80, 32)
    x = torch.randn(11, 32)
    ours = cpu_linear.CLinear()
    torch.testing.assert_close(ours.act(x, ours.pack(w), b, act_name),
                               layers.ACTIVATIONS[act_name](F.linear(x, w, b)), **TOL)


def test_work_is_split_over_threads_by_panels():
    w, b = _weights(1000, 64)  # 1000 columns: panels enough for several parts, a narrow last one
    x = torch.randn(20, 64)
    ours = cpu_linear.CLinear()
    packed = ours.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        torch.testing.assert_close(ours(x, packed, b), F.linear(x, w, b), **TOL)
    finally:
        torch.set_num_threads(threads)


def test_auto_picks_it_for_fp32_on_one_thread_of_avx2_without_avx512_only():
    assert cpu_linear.preferred({"avx2", "fma", "sse2"}, threads=1)
    assert not cpu_linear.preferred({"avx2", "fma", "sse2"}, threads=2)  # oneDNN's threads win
    assert not cpu_linear.preferred({"avx2", "fma", "avx512f"}, threads=1)  # not measured there
    assert not cpu_linear.preferred({"sse2"}, threads=1)
    expected = "c" if cpu_linear.preferred() else ("onednn" if layers._onednn_works() else "torch")
    assert layers.linear_kernels(CPU, torch.float32).name == expected
    assert layers.linear_kernels(CPU, torch.float32, "c").name == "c"
    assert layers.linear_kernels(CPU, torch.bfloat16).name != "c"
    with pytest.raises(ValueError, match="takes float32"):
        layers.linear_kernels(CPU, torch.bfloat16, "c")


@pytest.mark.parametrize("model", ["bert", "qwen2_causal_lm", "qwen3_model"])  # Qwen: the residual add
def test_a_model_on_the_c_linear_matches_the_torch_linear(tmp_path, model):
    build(model, tmp_path)
    batch = PackedBatch.pack([np.arange(5, 5 + n) for n in (3, 9, 1, 17)])
    c = Engine.load(tmp_path, device="cpu", dtype="float32", linear="c")
    ref = Engine.load(tmp_path, device="cpu", dtype="float32", linear="torch")
    assert c.linear_backend == "c"
    np.testing.assert_allclose(c.embed(batch), ref.embed(batch), atol=1e-5)


def test_shapes_and_dtypes_are_checked_before_the_kernel_reads_memory():
    w, b = _weights(32, 16)
    ours = cpu_linear.CLinear()
    packed = ours.pack(w)
    for bad in (lambda: ours(torch.randn(4, 17), packed, b),  # k differs from the weight's
                lambda: ours.add(torch.randn(4, 16), packed, b, torch.randn(32)),  # residual [n]
                lambda: ours(torch.randn(4, 16, dtype=torch.float64), packed, b),
                lambda: ours(torch.randn(4, 16), packed, torch.randn(31))):
        with pytest.raises(ValueError, match="the C linear takes float32"):
            bad()


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_a_worker_says_which_linear_kernel_its_threads_got(redis_url, threads):
    """The threads are set before the model loads, so ``auto`` sees them; the start line says
    what it chose."""
    budget = ["--token-budget", "300"] if threads == 2 else []
    run = subprocess.run([sys.executable, "-m", "tokq.cli", "worker", "--device", "cpu", "--threads",
                          str(threads), *budget, "--burst"], env={**os.environ, "TOKQ_REDIS_URL": redis_url},
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    if cpu_linear.preferred(threads=threads):
        expected = "c"
    else:
        expected = "onednn" if layers._onednn_works() else "torch"
    assert "(torch.float32, attention " in run.stderr and f", linear {expected})" in run.stderr
    # a set budget is known at start; else the line says it is read, not the default it has then
    assert ("), budget 300 tokens, queue " if budget else
            "), budget: the published one, else the 1024-token default fitted to its goal, queue ") in run.stderr
