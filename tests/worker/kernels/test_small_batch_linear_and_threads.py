"""Small batches on CPU: the C linear in bf16 (workers/kernels/cpu_linear.c) against a fp32 reference
and oneDNN, oneDNN's linear handing inputs of few rows to the C kernel, and forwards of few tokens
run on one thread."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tiny_models import build
from tokq.batch import PackedBatch
from tokq.workers.engine import Engine
from tokq.workers.kernels import cpu_linear
from tokq.workers.models import layers

CPU = torch.device("cpu")
BF16 = torch.bfloat16
NO_BF16 = cpu_linear.small_rows_unavailable_reason(CPU, BF16)
needs_c_bf16 = pytest.mark.skipif(NO_BF16 is not None, reason=str(NO_BF16))
needs_onednn = pytest.mark.skipif(not layers._onednn_works(BF16), reason="torch built without oneDNN bf16 linear")
TOL = dict(atol=2e-2, rtol=1e-2)  # bf16 outputs: a rounding apart, sums in another order


def _weights(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * 0.2).to(BF16), torch.randn(n, generator=gen).to(BF16)


def _reference(x, w, b=None, residual=None):
    """The bf16 values in fp32, rounded to bf16 once at the end."""
    y = F.linear(x.float(), w.float(), None if b is None else b.float())
    return (y if residual is None else y + residual.float()).to(BF16)


@needs_c_bf16
@pytest.mark.parametrize("n, k", [(96, 40), (100, 41), (7, 3)])  # whole panels; narrow last, odd k; one narrow
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 64])
def test_bf16_matches_reference(n, k, rows):
    w, b = _weights(n, k)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    residual = torch.randn(rows, n, generator=gen).to(BF16)
    ours = cpu_linear.CLinear()
    packed = ours.pack(w)
    assert packed.shape == w.shape and packed.dtype == BF16  # a view of its padded panels
    for out, ref in ((ours(x, packed, b), _reference(x, w, b)), (ours(x, packed), _reference(x, w)),
                     (ours.add(x, packed, b, residual), _reference(x, w, b, residual))):
        assert out.dtype == BF16 and out.shape == (rows, n)
        torch.testing.assert_close(out.float(), ref.float(), **TOL)


@needs_c_bf16
def test_bf16_strided_input_activation_and_threads():
    w, b = _weights(1000, 64)  # panels enough for several parts, a narrow last one
    wide = torch.randn(9, 128).to(BF16)
    x = wide[:, 64:]  # a column slice: row stride 128
    ours = cpu_linear.CLinear()
    packed = ours.pack(w)
    torch.testing.assert_close(ours(x, packed, b).float(), _reference(x, w, b).float(), **TOL)
    torch.testing.assert_close(ours.act(x, packed, b, "gelu").float(),
                               F.gelu(_reference(x, w, b).float()).to(BF16).float(), **TOL)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        torch.testing.assert_close(ours(x, packed, b).float(), _reference(x, w, b).float(), **TOL)
    finally:
        torch.set_num_threads(threads)


@needs_c_bf16
def test_bf16_shapes_and_dtypes_are_checked():
    w, b = _weights(32, 16)
    ours = cpu_linear.CLinear()
    packed = ours.pack(w)
    for bad in (lambda: ours(torch.randn(4, 16), packed, b),  # fp32 x, bf16 weight
                lambda: ours(torch.randn(4, 17).to(BF16), packed, b),
                lambda: ours.add(torch.randn(4, 16).to(BF16), packed, b, torch.randn(4, 31).to(BF16))):
        with pytest.raises(ValueError, match="the C linear takes float32"):
            bad()


@needs_c_bf16
@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_onednn_hands_few_rows_to_the_c_kernel(dtype, monkeypatch):
    w, b = (t.to(dtype) for t in _weights(96, 64))
    linear = layers.OneDnnLinear(cpu_linear.CLinear(split=False), small_rows=8, threaded_rows=2)
    packed = linear.pack(w)
    assert packed.is_mkldnn  # the models' weights stay oneDNN's; the C kernel's copy is kept aside
    plain = layers.OneDnnLinear()
    calls = []
    run = cpu_linear.CLinear._run
    monkeypatch.setattr(cpu_linear.CLinear, "_run", lambda self, *a: calls.append(a[0].shape[0]) or run(self, *a))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else TOL
    threads = torch.get_num_threads()
    try:
        for num_threads, c_rows in ((1, [1, 2, 8]), (2, [1, 2])):  # more threads: at most threaded_rows
            torch.set_num_threads(num_threads)
            calls.clear()
            for rows in (1, 2, 8, 9, 40):
                x = torch.randn(rows, 64).to(dtype)
                residual = torch.randn(rows, 96).to(dtype)
                for out, ref in ((linear(x, packed, b), plain(x, w, b)),
                                 (linear.act(x, packed, b, "gelu"), plain.act(x, w, b, "gelu")),
                                 (linear.add(x, packed, b, residual), plain.add(x, w, b, residual))):
                    torch.testing.assert_close(out.float(), ref.float(), **tol)
            assert calls == [r for r in c_rows for _ in range(3)]  # the rest: oneDNN
        torch.set_num_threads(1)
        calls.clear()
        linear(torch.randn(2, 64).to(dtype), w, b)  # a weight it did not pack: oneDNN's own call
        assert calls == []
    finally:
        torch.set_num_threads(threads)


@needs_c_bf16
@needs_onednn
def test_auto_keeps_the_second_copy_only_for_models_that_fit():
    small = layers.linear_kernels(CPU, BF16, num_params=10_000_000)
    assert small.name == "onednn" and small.small_rows == layers.SMALL_ROWS[BF16]
    assert small.threaded_rows == min(layers.THREADED_ROWS, small.small_rows)
    too_big = layers.SMALL_ROWS_MAX_BYTES // BF16.itemsize + 1
    assert layers.linear_kernels(CPU, BF16, num_params=too_big).small_rows == 0
    assert layers.linear_kernels(CPU, BF16, "onednn", num_params=10_000_000).small_rows == 0  # forced: oneDNN only
    assert layers.linear_kernels(CPU, BF16).small_rows == 0  # size unknown


@needs_c_bf16
@needs_onednn
@pytest.mark.parametrize("model", ["bert", "qwen3_model"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_few_token_forwards_run_on_one_thread_and_match(tmp_path, model, dtype):
    build(model, tmp_path)
    engine = Engine.load(tmp_path, device="cpu", dtype=dtype)
    assert engine.model.linear.small_rows > 0
    assert engine.one_thread_tokens == engine.model.linear.threaded_rows == layers.THREADED_ROWS
    reference = Engine.load(tmp_path, device="cpu", dtype=dtype, linear="onednn")  # oneDNN at any size
    assert reference.model.linear.small_rows == 0
    seen = []
    forward = engine.model.forward
    engine.model.forward = lambda *a, **kw: seen.append(torch.get_num_threads()) or forward(*a, **kw)
    threads = torch.get_num_threads()
    small = PackedBatch.pack([np.arange(5, 5 + n) for n in (3, 1, 2)])
    large = PackedBatch.pack([np.arange(5, 5 + n) for n in (40, 30)])
    try:
        torch.set_num_threads(2)
        for batch in (small, large):
            ours, ref = engine.embed(batch), reference.embed(batch)
            if dtype == "float32":
                np.testing.assert_allclose(ours, ref, atol=1e-5)
            else:  # unit vectors: cosine similarity
                assert (ours * ref).sum(1).min() > 0.999
            assert torch.get_num_threads() == 2  # put back
    finally:
        torch.set_num_threads(threads)
    assert seen == [1, 2]  # the 6-token batch on one thread, the 70-token one on both
    assert layers.THREADED_ROWS < 70


@needs_c_bf16
@pytest.mark.parametrize("flags", [("-mno-avx512bf16",), ("-mno-avx512f",)], ids=["no-dot-products", "avx2-width"])
def test_bf16_other_builds_match_reference(flags):
    """The kernel as CPUs without AVX512-BF16 (fp32 FMAs on converted pairs) or without AVX-512
    (8-float vectors, panels of 16 columns) build it."""
    from tokq.workers.kernels import cpu_build

    try:
        pack = cpu_build.function("cpu_linear", "tokq_pack_weight_bf16", cpu_linear.PACK_ARGTYPES, flags)
        run = cpu_build.function("cpu_linear", "tokq_linear_bf16", cpu_linear.ARGTYPES, flags)
        lanes = cpu_build.vector_lanes("cpu_linear", flags)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    for n, k, rows in ((100, 41, 1), (100, 41, 7), (33, 64, 13)):
        w, b = _weights(n, k)
        x = torch.randn(rows, k).to(BF16)
        panels = -(-n // (2 * lanes))
        packed = torch.empty(panels * 2 * lanes * 2 * -(-k // 2), dtype=BF16)
        pack(w.data_ptr(), packed.data_ptr(), n, k)
        out = torch.empty(rows, n, dtype=BF16)
        run(x.data_ptr(), k, rows, k, packed.data_ptr(), n, b.data_ptr(), None, 0, out.data_ptr(), 0, panels)
        torch.testing.assert_close(out.float(), _reference(x, w, b).float(), **TOL)
