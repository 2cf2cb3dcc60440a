"""The C LayerNorm (workers/kernels/cpu_norm.c) against a float64 reference and torch's own, and its
fallback to torch's when it cannot be built."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokq.batch import PackedBatch
from tokq.workers.kernels import cpu_build, cpu_norm
from tokq.workers.engine import Engine

CPU = torch.device("cpu")
NO_CPU_NORM = cpu_norm.unavailable_reason(CPU, torch.float32)
needs_cpu_norm = pytest.mark.skipif(bool(NO_CPU_NORM), reason=f"cpu_norm: {NO_CPU_NORM}")


def _inputs(rows: int, n: int, dtype: torch.dtype, offset: float = 0.0):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(rows, n, generator=gen) * 3 + offset
    weight, bias = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    return x.to(dtype), weight.to(dtype), bias.to(dtype)


def _reference(x, weight, bias, eps):
    return F.layer_norm(x.double(), weight.shape, weight.double(), bias.double(), eps)


@needs_cpu_norm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [384, 100, 24, 7], ids=["n384", "n100", "n24", "n7"])  # whole
def test_layer_norm_matches_reference(dtype, n):  # steps of 32 values, steps and the rest, rest
    x, weight, bias = _inputs(50, n, dtype, offset=40.0)  # an offset: the variance is about the mean
    out = cpu_norm.layer_norm(x, weight, bias, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    ref = _reference(x, weight, bias, 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    else:  # no further from the exact value than torch's own bf16 result (its rounding)
        torch_err = (F.layer_norm(x, (n,), weight, bias, 1e-5).double() - ref).abs()
        assert ((out.double() - ref).abs() <= torch_err.max() + 1e-6).all()
        torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=1e-2)


@needs_cpu_norm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [384, 100, 7], ids=["n384", "n100", "n7"])
def test_layer_norm_adds_the_residual_as_torch_would(dtype, n):
    x, weight, bias = _inputs(50, n, dtype, offset=5.0)
    residual = _inputs(50, n, dtype, offset=-2.0)[0].flip(0)
    out = cpu_norm.layer_norm(x, weight, bias, 1e-12, residual=residual)
    expected = F.layer_norm(x + residual, (n,), weight, bias, 1e-12)  # the sum rounded to dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(out, expected, **tol)
    if dtype == torch.bfloat16:  # the same rounded sum: nearly every value is torch's own bits
        assert (out == expected).float().mean() > 0.99


@needs_cpu_norm
def test_layer_norm_in_place_writes_over_its_input():
    x, weight, bias = _inputs(300, 384, torch.bfloat16)
    residual = torch.roll(x, 1, 0)
    expected = cpu_norm.layer_norm(x, weight, bias, 1e-12, residual=residual)
    out = cpu_norm.layer_norm(x, weight, bias, 1e-12, residual=residual, in_place=True)
    assert out.data_ptr() == x.data_ptr() and torch.equal(out, expected)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_norm.layer_norm(x[:, :128], weight[:128].contiguous(), bias[:128].contiguous(),
                            1e-12, in_place=True)


@needs_cpu_norm
def test_layer_norm_reads_strided_rows():
    x, weight, bias = _inputs(9, 2 * 64, torch.bfloat16)
    view = x[:, 64:]  # every row's second half: a row stride of 128
    out = cpu_norm.layer_norm(view, weight[64:].contiguous(), bias[64:].contiguous(), 1e-12)
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.layer_norm(view, (64,), weight[64:], bias[64:], 1e-12),
                               atol=0.02, rtol=0.01)


@needs_cpu_norm
def test_layer_norm_gives_the_same_bits_on_any_number_of_threads():
    x, weight, bias = _inputs(1000, 384, torch.bfloat16)  # enough rows to split
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_norm.layer_norm(x, weight, bias, 1e-12)
        for threads_now in (2, 4):
            torch.set_num_threads(threads_now)
            assert torch.equal(cpu_norm.layer_norm(x, weight, bias, 1e-12), one)
    finally:
        torch.set_num_threads(threads)


@needs_cpu_norm
def test_layer_norm_of_no_rows():
    x, weight, bias = _inputs(0, 384, torch.bfloat16)
    assert cpu_norm.layer_norm(x, weight, bias, 1e-12).shape == (0, 384)


@needs_cpu_norm
def test_layer_norm_refuses_other_dtypes_and_layouts():
    x, weight, bias = _inputs(3, 32, torch.float16)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        cpu_norm.layer_norm(x, weight, bias, 1e-12)
    x, weight, bias = _inputs(3, 32, torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_norm.layer_norm(x.t(), weight[:3].contiguous(), bias[:3].contiguous(), 1e-12)


def test_models_take_the_kernel_on_cpu_and_torch_elsewhere(monkeypatch):
    expected = "torch" if NO_CPU_NORM else "c"
    for dtype in (torch.float32, torch.bfloat16):
        assert cpu_norm.norm_kernels(CPU, dtype).name == expected
    assert cpu_norm.norm_kernels(CPU, torch.float16).name == "torch"
    assert cpu_norm.norm_kernels(torch.device("cuda"), torch.bfloat16).name == "torch"
    # no compiler: torch's, which gives the same result
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    monkeypatch.setattr(cpu_build, "library", functools.cache(cpu_build.library.__wrapped__))
    assert "no C compiler" in cpu_norm.unavailable_reason(CPU, torch.float32)
    fallback = cpu_norm.norm_kernels(CPU, torch.float32)
    assert fallback.name == "torch"
    x, weight, bias = _inputs(4, 48, torch.float32)
    torch.testing.assert_close(fallback(x, weight, bias, 1e-12).double(),
                               _reference(x, weight, bias, 1e-12), atol=1e-5, rtol=1e-5)


@needs_cpu_norm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_minilm_gives_the_same_embeddings_with_either_norms(dtype):
    """The C norms (residual added in the norm, after a plain linear) against torch's LayerNorm
    after the linear's fused add, in the whole bundled model."""
    engine = Engine.load(None, device="cpu", dtype=dtype)
    assert engine.model.norm.name == "c"
    gen = np.random.default_rng(0)
    batch = PackedBatch.pack([gen.integers(1000, 20000, n) for n in (3, 17, 40, 9, 128)])
    c = engine.embed(batch)
    engine.model.norm = cpu_norm.TorchNorms()
    ref = engine.embed(batch)
    cos = (c * ref).sum(1)  # unit vectors
    assert cos.min() > (0.99999 if dtype == "float32" else 0.999)
