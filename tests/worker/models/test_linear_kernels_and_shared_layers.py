"""The linear kernels (oneDNN fused vs F.linear) and the small shared layers agree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokq.workers.models import layers

onednn = pytest.mark.skipif(not layers._onednn_works(), reason="torch built without oneDNN linear")


def _inputs(rows: int = 37):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 64, generator=gen)
    return x, torch.randn(96, 64, generator=gen) * 0.2, torch.randn(96, generator=gen), torch.randn(rows, 96, generator=gen)


@onednn
@pytest.mark.parametrize("act_name", sorted(layers.ACTIVATIONS))
def test_onednn_fused_activation_matches_torch(act_name):
    x, w, b, _ = _inputs()
    fused = layers.OneDnnLinear().act(x, w, b, act_name)
    torch.testing.assert_close(fused, layers.TorchLinear().act(x, w, b, act_name), atol=1e-5, rtol=1e-5)


@onednn
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_and_residual_add_match_torch(bias):
    x, w, b, residual = _inputs(rows=300)
    b = b if bias else None
    ours, ref = layers.OneDnnLinear(), layers.TorchLinear()
    torch.testing.assert_close(ours(x, w, b), ref(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.add(x, w, b, residual), ref.add(x, w, b, residual), atol=1e-5, rtol=1e-5)
    # a strided input (a column slice of a fused projection) is read correctly
    wide = torch.cat([x, x.flip(0)], dim=1)[:, 64:]
    torch.testing.assert_close(ours(wide, w, b), F.linear(wide, w, b), atol=1e-5, rtol=1e-5)


@onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_packed_weights_give_the_plain_weights_results(dtype):
    """``pack`` (oneDNN's blocked layout, done once at load) changes speed only: every call
    the models make gives the plain weight's values (up to summation order), at any row count."""
    if not layers._onednn_works(dtype):
        pytest.skip(f"torch built without oneDNN {dtype} linear")
    ours, tol = layers.OneDnnLinear(), 1e-5 if dtype == torch.float32 else 1e-2
    for rows in (1, 37, 300):
        x, w, b, residual = (t.to(dtype) for t in _inputs(rows))
        packed = ours.pack(w)
        assert packed.is_mkldnn and packed.shape == w.shape
        for out, ref in ((ours(x, packed, b), ours(x, w, b)),
                         (ours.act(x, packed, b, "gelu"), ours.act(x, w, b, "gelu")),
                         (ours.add(x, packed, b, residual), ours.add(x, w, b, residual))):
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    assert layers.TorchLinear().pack(w) is w


def test_models_hold_weights_packed_for_their_linear_kernel(tmp_path):
    from tiny_models import build
    from tokq.workers.engine import Engine

    build("bert", tmp_path)
    from tokq.workers.kernels import cpu_linear

    c_builds = cpu_linear.unavailable_reason(torch.device("cpu"), torch.float32) is None
    for kind in ("auto", "torch") + (("c",) if c_builds else ()):
        engine = Engine.load(tmp_path, device="cpu", dtype="float32", linear=kind)
        layer = engine.model.layers[0]
        expect_packed = engine.linear_backend == "onednn"
        weights = (layer.qkv_weight, layer.out_weight, layer.up_weight, layer.down_weight)
        assert all(w.is_mkldnn == expect_packed for w in weights)
        if engine.linear_backend == "c":  # the C kernel's panels: same shape, another order
            plain = Engine.load(tmp_path, device="cpu", dtype="float32", linear="torch").model.layers[0]
            assert all(w.shape == p.shape and not torch.equal(w, p)
                       for w, p in zip(weights, (plain.qkv_weight, plain.out_weight, plain.up_weight,
                                                 plain.down_weight)))
        assert not layer.attn_norm_weight.is_mkldnn  # not a linear weight


def test_linear_kernel_choice():
    cpu = torch.device("cpu")
    assert layers.linear_kernels(cpu, torch.float32, "torch").name == "torch"
    expected = "onednn" if layers._onednn_works(torch.bfloat16) else "torch"
    # fp32: test_c_linear_matches_f_linear.py
    assert layers.linear_kernels(cpu, torch.bfloat16).name == expected
    if layers._onednn_works():
        assert layers.linear_kernels(cpu, torch.float32, "onednn").name == "onednn"
    assert layers.linear_kernels(cpu, torch.float16).name == "torch"
    with pytest.raises(ValueError, match="fp32 or bf16 on CPU"):
        layers.linear_kernels(cpu, torch.float16, "onednn")


@pytest.mark.skipif(not layers._onednn_works(torch.bfloat16), reason="torch built without oneDNN bf16 linear")
@pytest.mark.parametrize("act_name", ["gelu", "silu"])
def test_onednn_bf16_fused_linear_matches_fp32(act_name):
    x, w, b, residual = _inputs(rows=300)
    ref = layers.TorchLinear()
    bf = [t.bfloat16() for t in (x, w, b, residual)]
    ours = layers.OneDnnLinear()
    torch.testing.assert_close(ours.act(*bf[:3], act_name).float(), ref.act(x, w, b, act_name), atol=0.1, rtol=0.05)
    torch.testing.assert_close(ours.add(*bf).float(), ref.add(x, w, b, residual), atol=0.1, rtol=0.05)


def test_fused_projections_are_concatenated_on_the_host_then_moved(monkeypatch, tmp_path):
    """The parts of qkv / gate-up are joined before they reach the device (on a GPU the parts
    and the whole would otherwise coexist there: ~1.6x the weights at load). "meta" stands in
    for the device: any concatenation there would show up in the spy."""
    from tiny_models import build
    from tokq.model.info import ModelInfo
    from tokq.workers.loader import load_weights
    from tokq.workers.models.qwen import Qwen

    build("qwen2_causal_lm", tmp_path)
    info = ModelInfo.load(tmp_path)
    weights = load_weights(info.path, Qwen.ANCHOR, dtype=torch.bfloat16)
    assert {t.device.type for t in weights.values()} == {"cpu"}
    devices = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda ts, *a, **k: devices.extend(t.device.type for t in ts)
                        or real_cat(ts, *a, **k))
    model = Qwen(info.config, weights, info.family, info.max_length, device=torch.device("meta"))
    assert devices and set(devices) == {"cpu"}
    assert model.layers[0].qkv_weight.device.type == "meta"
    assert model.layers[0].gate_up_weight.device.type == "meta"


def test_rms_norm_bf16_matches_fp32_statistics():
    x = torch.randn(5, 3, 16) * 4
    w = torch.rand(16) + 0.5
    ref = F.rms_norm(x, (16,), w, 1e-6)
    torch.testing.assert_close(layers.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6).float(), ref,
                               atol=5e-2, rtol=2e-2)


def test_rotary_tables_grow_past_their_first_size():
    rotary = layers.Rotary(head_dim=8, theta=10000.0, device=torch.device("cpu"), dtype=torch.float32,
                           num_positions=4)
    positions = torch.tensor([0, 3, 9])
    cos, sin = rotary.tables(positions, max_position=9)
    angles = positions[:, None].float() * rotary.inv_freq[None, :]
    torch.testing.assert_close(cos[:, 0], angles.cos())
    torch.testing.assert_close(sin[:, 0], angles.sin())


def test_unsupported_activation_and_rope_are_refused():
    with pytest.raises(layers.UnsupportedModel, match="hidden_act"):
        layers.activation("quick_gelu")
    with pytest.raises(layers.UnsupportedModel, match="RoPE type 'yarn'"):
        layers.rope_theta({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}})
    assert layers.rope_theta({"rope_theta": 1e6, "rope_scaling": None}) == 1e6
