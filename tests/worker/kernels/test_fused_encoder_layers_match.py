"""The C encoder layers in one call (workers/kernels/cpu_layers.c) against the layer-by-layer path
and torch's ops, when a BERT forward takes them, and the kernel build key that follows the sources
they include."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tiny_models import build
from tokq.batch import PackedBatch
from tokq.workers.engine import Engine
from tokq.workers.kernels import cpu_build, cpu_layers
from tokq.workers.kernels.cpu_linear import CLinear
from tokq.workers.layout import build_layout
from tokq.workers.models.bert import BertLayer

CPU = torch.device("cpu")
NO_LAYERS = cpu_layers.unavailable_reason(CPU, torch.float32)
needs_layers = pytest.mark.skipif(NO_LAYERS is not None, reason=str(NO_LAYERS))


@pytest.fixture
def threads():
    """Set torch's threads inside a test; put back after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _engine(tmp_path, dtype: str) -> Engine:
    build("bert", tmp_path)
    engine = Engine.load(tmp_path, device="cpu", dtype=dtype)
    assert engine.model._fused is not None and engine.model.fused_rows > 0
    return engine


def _count_calls(model) -> list[int]:
    calls, fused = [], model._fused
    model._fused = lambda x, *rest: calls.append(x.shape[0]) or fused(x, *rest)
    return calls


@needs_layers
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_few_tokens_match_the_layer_by_layer_forward(tmp_path, dtype, threads):
    threads(1)
    engine = _engine(tmp_path, dtype)
    rows = engine.model.fused_rows
    calls = _count_calls(engine.model)
    rng = np.random.default_rng(0)
    for lens in ([1], [3], [5, 1, 2], [rows], [rows // 2, rows - rows // 2]):
        batch = PackedBatch.pack([rng.integers(1, 200, n) for n in lens])
        ours = engine.embed(batch)
        engine.model.fused_rows = 0  # layer by layer
        ref = engine.embed(batch)
        engine.model.fused_rows = rows
        if dtype == "float32":
            np.testing.assert_allclose(ours, ref, atol=2e-6)
        else:
            assert (ours * ref).sum(1).min() > 0.9999
    assert calls == [1, 3, 8, rows, rows]


@needs_layers
def test_taken_only_for_few_tokens_on_one_thread_without_checkpoints_on_cpu_varlen(tmp_path, threads):
    engine = _engine(tmp_path, "float32")
    rows = engine.model.fused_rows
    calls = _count_calls(engine.model)
    small, large = (PackedBatch.pack([np.arange(1, 1 + n)]) for n in (3, rows + 1))
    threads(1)
    engine.embed(large)  # past its rows
    layout = build_layout(small, CPU, engine.attn_backend)
    with torch.inference_mode():
        engine.model.forward(layout, engine._attend, checkpoint=lambda: None)  # a heavy forward's steps
    threads(2)
    engine.one_thread_tokens = 0  # the engine keeps both threads for it: the linears go to oneDNN
    engine.embed(small)
    assert calls == []
    threads(1)
    sdpa = Engine.load(tmp_path, device="cpu", dtype="float32", attn_backend="sdpa_packed")
    sdpa_calls = _count_calls(sdpa.model)
    sdpa.embed(small)
    assert sdpa_calls == []
    engine.embed(small)
    assert calls == [3]


def _torch_layer(w: dict, x: torch.Tensor, bounds, heads: int, dtype) -> torch.Tensor:
    """One BERT layer in torch's ops, rounding to ``dtype`` where the kernels store it."""
    t, hidden = x.shape
    d = hidden // heads

    def lin(a, name):
        return F.linear(a.float(), w[f"{name}_weight"].float(), w[f"{name}_bias"].float()).to(dtype)

    def norm(a, residual, name):
        summed = (a.float() + residual.float()).to(dtype).float()
        return F.layer_norm(summed, (hidden,), w[f"{name}_norm_weight"].float(),
                            w[f"{name}_norm_bias"].float(), 1e-12).to(dtype)

    qkv = lin(x, "qkv").view(t, 3, heads, d)
    attn = torch.empty(t, heads, d, dtype=dtype)
    for a, b in bounds:
        q, k, v = (qkv[a:b, i].transpose(0, 1).float() for i in range(3))
        attn[a:b] = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).to(dtype)
    y = norm(lin(attn.reshape(t, hidden), "out"), x, "attn")
    h = F.gelu(lin(y, "up").float()).to(dtype)
    return norm(lin(h, "down"), y, "mlp")


@needs_layers
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_layer_matches_torch_ops(dtype, threads):
    """Inputs wide enough to reach GELU's tails and erf's whole range."""
    threads(1)
    hidden, heads, inter = 64, 2, 96
    gen = torch.Generator().manual_seed(0)
    shapes = dict(qkv=(3 * hidden, hidden), out=(hidden, hidden), up=(inter, hidden), down=(hidden, inter))
    w = {}
    for name, shape in shapes.items():
        w[f"{name}_weight"] = torch.randn(shape, generator=gen) * 0.3
        w[f"{name}_bias"] = torch.randn(shape[0], generator=gen)
    for name in ("attn", "mlp"):
        w[f"{name}_norm_weight"] = 1 + 0.2 * torch.randn(hidden, generator=gen)
        w[f"{name}_norm_bias"] = torch.randn(hidden, generator=gen)
    w = {k: v.to(dtype) for k, v in w.items()}
    linear = CLinear(split=False)
    layer = BertLayer(**{k: linear.pack(v) if v.dim() == 2 else v for k, v in w.items()})
    x = (torch.randn(9, hidden, generator=gen) * 2).to(dtype)
    ours = cpu_layers.BertLayers([layer], linear.c_weight, heads, 1e-12)(
        x.clone(), torch.tensor([0, 4, 9], dtype=torch.int64), (hidden // heads) ** -0.5)
    ref = _torch_layer(w, x, ((0, 4), (4, 9)), heads, dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=3e-2)
    torch.testing.assert_close(ours.float(), ref.float(), **tol)


@needs_layers
def test_inputs_are_checked():
    layer_args = dict(num_heads=2, eps=1e-12)
    linear = CLinear(split=False)
    w = {name: torch.randn(shape) for name, shape in dict(
        qkv_weight=(96, 32), qkv_bias=(96,), out_weight=(32, 32), out_bias=(32,), attn_norm_weight=(32,),
        attn_norm_bias=(32,), up_weight=(48, 32), up_bias=(48,), down_weight=(32, 48), down_bias=(32,),
        mlp_norm_weight=(32,), mlp_norm_bias=(32,)).items()}
    layer = BertLayer(**{k: linear.pack(v) if v.dim() == 2 else v for k, v in w.items()})
    layers = cpu_layers.BertLayers([layer], linear.c_weight, **layer_args)
    cu = torch.tensor([0, 3], dtype=torch.int64)
    for x, c in ((torch.randn(3, 31), cu), (torch.randn(3, 32).bfloat16(), cu), (torch.randn(3, 32), cu.int()),
                 (torch.randn(32, 3).t(), cu)):
        with pytest.raises(ValueError, match="the C encoder layers take"):
            layers(x, c, 0.25)
    with pytest.raises(ValueError, match="every weight and bias"):
        cpu_layers.BertLayers([layer], lambda weight: None, **layer_args)


def test_build_key_follows_the_sources_it_includes(tmp_path):
    for name in ("a.c", "b.c"):
        (tmp_path / name).write_text("int f(void) { return 1; }\n")
    (tmp_path / "top.c").write_text('#include "a.c"\n')
    key = cpu_build.build_key(tmp_path / "top.c", "cc")
    (tmp_path / "b.c").write_text("int g(void) { return 2; }\n")  # not included: same key
    assert cpu_build.build_key(tmp_path / "top.c", "cc") == key
    (tmp_path / "a.c").write_text("int f(void) { return 3; }\n")
    assert cpu_build.build_key(tmp_path / "top.c", "cc") != key
