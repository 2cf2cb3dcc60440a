"""The CUDA attention call paths on CPU, through contract fakes carrying the real signatures of
every flash-attn and torch version tokq supports (tests/cuda_fakes.py): a whole Engine forward
on tiny BERT / Qwen2 / Qwen3 goes through each backend's call site and matches the sdpa path;
auto falls back when flash-attn is present but broken; the CUDA SDPA fallback never asks for
enable_gqa; signatures are read once per model, not per layer call."""

from __future__ import annotations

import inspect
import logging
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cuda_fakes import (FLASH_ATTN_SIGNATURES, TORCH_VARLEN_SIGNATURES, FlashAttnVarlenFake,
                        TorchVarlenFake, installed_torch_varlen_signature, reference_attention,
                        signature)
from tiny_models import SEQ_LENS, VOCAB, build
from tokq.batch import PackedBatch
from tokq.workers import attention
from tokq.workers.layout import build_layout
from tokq.workers.engine import Engine

MODELS = ("bert", "qwen2_causal_lm", "qwen3_model")
VARLEN_VERSIONS = (*TORCH_VARLEN_SIGNATURES, "installed")


@pytest.fixture(scope="module", params=MODELS)
def tiny_bf16(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build(request.param, path)
    return Engine.load(path, device="cpu", dtype="bfloat16")


def _install(monkeypatch, backend: str, version: str):
    if backend == "flash_attn":
        fake = FlashAttnVarlenFake(version)
        module = types.ModuleType("flash_attn")
        module.flash_attn_varlen_func = fake
        monkeypatch.setitem(sys.modules, "flash_attn", module)
    else:
        from torch.nn.attention import varlen

        fake = TorchVarlenFake(version)
        monkeypatch.setattr(varlen, "varlen_attn", fake)
    return fake


def _batch(seed: int = 0) -> PackedBatch:
    rng = np.random.default_rng(seed)
    return PackedBatch.pack([rng.integers(1, VOCAB, size=n) for n in SEQ_LENS])


CALL_PATHS = ([("flash_attn", v) for v in FLASH_ATTN_SIGNATURES]
              + [("torch_varlen", v) for v in VARLEN_VERSIONS])


@pytest.mark.parametrize("backend,version", CALL_PATHS, ids=[f"{b}-{v}" for b, v in CALL_PATHS])
def test_engine_forward_through_cuda_call_path_matches_sdpa(tiny_bf16, monkeypatch, backend, version):
    fake = _install(monkeypatch, backend, version)
    engine = tiny_bf16
    cuda_path = Engine(engine.info, engine.model, engine.device, engine.dtype, backend)
    sdpa = Engine(engine.info, engine.model, engine.device, engine.dtype, "sdpa_loop")
    batch = _batch()
    got, want = cuda_path.embed(batch), sdpa.embed(batch)
    model = engine.model
    assert len(fake.calls) == len(model.layers)  # every layer went through the fake
    kv_heads = getattr(model, "num_kv_heads", model.num_heads)
    if backend == "torch_varlen" and "enable_gqa" not in fake.signature.parameters:
        kv_heads = model.num_heads  # no GQA before torch 2.12: k, v repeated up to q's heads
    assert {(c["causal"], c["heads"]) for c in fake.calls} == {(model.causal, (model.num_heads, kv_heads))}
    assert all(c["scale"] == pytest.approx(model.head_dim ** -0.5) for c in fake.calls)
    # both bf16; they differ only in how attention rounds (float64 in the fake)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert np.isfinite(got).all() and cos.min() >= 0.999, cos.min()


def test_shared_prompt_path_through_flash_attn_call_matches_sdpa(tmp_path, monkeypatch):
    """The decoder prefix path (a prompt's K/V computed once, queries attending to prompt +
    own keys: cu_seqlens_k != cu_seqlens_q, causal aligned bottom-right) through flash-attn's
    call on CPU."""
    fake = _install(monkeypatch, "flash_attn", "flash-attn 2.6-2.8")
    build("qwen3_model", tmp_path)
    loaded = Engine.load(tmp_path, device="cpu", dtype="bfloat16")
    flash = Engine(loaded.info, loaded.model, loaded.device, loaded.dtype, "flash_attn")
    sdpa = Engine(loaded.info, loaded.model, loaded.device, loaded.dtype, "sdpa_packed")
    rng = np.random.default_rng(4)
    prompt = rng.integers(1, VOCAB, size=9).tolist()
    seqs = [prompt + rng.integers(1, VOCAB, size=n).tolist() for n in (1, 5, 17, 3)]
    seqs.append(rng.integers(1, VOCAB, size=6).tolist())  # no prompt
    batch = PackedBatch.pack(seqs, prompt_lens=[9, 9, 9, 9, 0])
    for _ in range(2):  # first computes the prompt, second takes it from the cache
        got, want = flash.embed(batch), sdpa.embed(batch)
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert np.isfinite(got).all() and cos.min() >= 0.999, cos.min()
    assert fake.calls and all(c["causal"] for c in fake.calls)


@pytest.mark.parametrize("version", VARLEN_VERSIONS)
@pytest.mark.parametrize("causal", [False, True])
def test_torch_varlen_call_binds_each_version_and_matches_reference(monkeypatch, version, causal):
    fake = _install(monkeypatch, "torch_varlen", version)
    batch = PackedBatch.pack([np.arange(n) for n in (5, 1, 12, 7)])
    layout = build_layout(batch, torch.device("cpu"), "torch_varlen")
    gen = torch.Generator().manual_seed(0)
    # strided q/k/v: column slices of one fused projection, as the models pass them
    qkv = torch.randn(batch.num_tokens, (4 + 2 * 2) * 16, generator=gen).bfloat16()
    q = qkv[:, :64].view(-1, 4, 16)
    k, v = qkv[:, 64:96].view(-1, 2, 16), qkv[:, 96:].view(-1, 2, 16)
    out = attention.attend_fn("torch_varlen")(q, k, v, layout, causal, 16 ** -0.5)
    ref = reference_attention(q, k, v, batch.cu_seqlens, causal, 16 ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert fake.calls[0]["causal"] is causal


def test_a_keyword_a_version_lacks_raises_like_the_real_call():
    fake = TorchVarlenFake("torch 2.11")
    q = torch.zeros(3, 2, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(TypeError, match="enable_gqa"):
        fake(q, q, q, cu, cu, 3, 3, window_size=(-1, 0), enable_gqa=True)
    with pytest.raises(TypeError):
        TorchVarlenFake("torch 2.10")(q, q, q, cu, cu, 3, 3, window_size=(-1, 0))


def test_the_copied_2_12_signature_is_the_installed_torchs():
    real = installed_torch_varlen_signature()
    copied = signature(TORCH_VARLEN_SIGNATURES["torch 2.12"])
    if "enable_gqa" not in real.parameters:
        pytest.skip(f"torch {torch.__version__} predates enable_gqa")
    assert [(p.name, p.kind, p.default) for p in copied.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in real.parameters.values()]


def test_signatures_are_read_once_per_model_not_per_layer_call(tiny_bf16, monkeypatch):
    _install(monkeypatch, "torch_varlen", "installed")
    engine = Engine(tiny_bf16.info, tiny_bf16.model, tiny_bf16.device, tiny_bf16.dtype, "torch_varlen")
    calls = []
    real_signature = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: calls.append(a) or real_signature(*a, **k))
    engine.embed(_batch(1))
    assert calls == []


def _broken_flash_attn(tmp_path, monkeypatch):
    """A flash_attn package that is found but fails at import, as one built for another torch."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(
        'raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    attention._import_error.cache_clear()


def test_auto_falls_back_to_torch_varlen_when_flash_attn_does_not_import(tmp_path, monkeypatch, caplog):
    _broken_flash_attn(tmp_path, monkeypatch)
    monkeypatch.setattr(attention, "_cuda_capability", lambda device: (9, 0))
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger="tokq.attention"):
        assert attention.choose_backend("auto", cuda, torch.bfloat16) == "torch_varlen"
    lines = [r.getMessage() for r in caplog.records if r.name == "tokq.attention"]
    assert len(lines) == 1 and "torch_varlen" in lines[0] and "undefined symbol" in lines[0], lines
    with pytest.raises(ValueError, match="does not import"):
        attention.choose_backend("flash_attn", cuda, torch.bfloat16)
    attention._import_error.cache_clear()


def test_auto_on_an_old_gpu_or_in_fp32_takes_sdpa(monkeypatch):
    monkeypatch.setattr(attention, "_cuda_capability", lambda device: (7, 5))
    cuda = torch.device("cuda")
    assert attention.choose_backend("auto", cuda, torch.float16) == "sdpa_packed"
    monkeypatch.setattr(attention, "_cuda_capability", lambda device: (9, 0))
    assert attention.choose_backend("auto", cuda, torch.float32) == "sdpa_packed"


@pytest.mark.parametrize("backend", ["sdpa_packed", "sdpa_grouped", "sdpa_loop"])
def test_cuda_sdpa_fallback_repeats_kv_heads_instead_of_enable_gqa(monkeypatch, backend):
    """On CUDA, SDPA's fused kernels refuse enable_gqa and it drops to the math kernel (full
    [B, H, L, L] scores); the fallback hands SDPA equal head counts instead."""
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1], kwargs.get("enable_gqa", False)))
        return real_sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    batch = PackedBatch.pack([np.arange(n) for n in (3, 7, 7, 40, 70)])  # sorted: no reorder
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch.num_tokens, 6, 16, generator=gen)
    k, v = (torch.randn(batch.num_tokens, 2, 16, generator=gen) for _ in range(2))
    layout = build_layout(batch, torch.device("cpu"), backend, causal=True)
    attend = attention.attend_fn(backend, torch.device("cuda"))  # the CUDA variant, run on CPU
    assert layout.restore is None
    out = attend(q, k, v, layout, True, 0.25)
    ref = reference_attention(q, k, v, batch.cu_seqlens, True, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert seen and all(hq == hkv and not gqa for hq, hkv, gqa in seen), seen


# -- on a real GPU (marked cuda: skipped here) -------------------------------------------------
# The first GPU run checks the decoder path too: Qwen2/Qwen3 in bf16 through both varlen
# backends, strided q/k/v views, fp16, and the SDPA fallback without the math kernel.

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda_engine_or_skip(path, dtype: str, backend: str) -> Engine:
    reason = attention.unavailable_reason(backend, torch.device("cuda"), getattr(torch, dtype))
    if reason:
        pytest.skip(reason)
    return Engine.load(path, device="cuda", dtype=dtype, attn_backend=backend)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    dirs = {}
    for name in ("qwen2_causal_lm", "qwen3_model", "bert"):
        dirs[name] = tmp_path_factory.mktemp(f"gpu-{name}")
        build(name, dirs[name])
    return dirs


@cuda
@needs_cuda
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "sdpa_packed"])
@pytest.mark.parametrize("model", ["qwen2_causal_lm", "qwen3_model", "bert"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_engine_matches_cpu_fp32(tiny_dirs, model, backend, dtype):
    gpu = _cuda_engine_or_skip(tiny_dirs[model], dtype, backend)
    cpu = Engine.load(tiny_dirs[model], device="cpu", dtype="float32")
    batch = _batch(3)
    got, want = gpu.embed(batch), cpu.embed(batch)
    assert np.isfinite(got).all()
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.99, cos.min()
    alone = gpu.embed(PackedBatch.pack([batch.input_ids[:int(batch.cu_seqlens[1])]]))
    np.testing.assert_allclose(alone[0], got[0], atol=3e-2)


@cuda
@needs_cuda
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "sdpa_packed"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_backends_take_strided_qkv_views_of_one_projection(backend, causal):
    cuda_dev = torch.device("cuda")
    if reason := attention.unavailable_reason(backend, cuda_dev, torch.bfloat16):
        pytest.skip(reason)
    batch = PackedBatch.pack([np.arange(n) for n in (3, 300, 1, 17, 129, 64)])
    heads, kv_heads, dim = 8, 2, 64
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(batch.num_tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(cuda_dev, torch.bfloat16)
    q = qkv[:, :heads * dim].view(-1, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(-1, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(-1, kv_heads, dim)
    assert not q.is_contiguous() and not v.is_contiguous()
    layout = build_layout(batch, cuda_dev, backend, causal=causal, dtype=torch.bfloat16)
    if layout.restore is not None:
        pytest.skip("this layout reorders sequences; covered by "
                    "tests/worker/test_attention_backends_match_reference.py")
    out = attention.attend_fn(backend, cuda_dev)(q, k, v, layout, causal, dim ** -0.5)
    ref = reference_attention(q, k, v, batch.cu_seqlens, causal, dim ** -0.5)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


@cuda
@needs_cuda
@pytest.mark.parametrize("backend", ["sdpa_packed", "sdpa_grouped", "sdpa_loop"])
def test_cuda_sdpa_fallback_runs_without_the_math_kernel(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda_dev = torch.device("cuda")
    batch = PackedBatch.pack([np.arange(n) for n in (3, 7, 7, 40, 70, 512)])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch.num_tokens, 8, 64, generator=gen).to(cuda_dev, torch.float16)
    k, v = (torch.randn(batch.num_tokens, 2, 64, generator=gen).to(cuda_dev, torch.float16) for _ in range(2))
    layout = build_layout(batch, cuda_dev, backend, causal=True, dtype=torch.float16)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # math refused
        out = attention.attend_fn(backend, cuda_dev)(q, k, v, layout, True, 0.125)
    ref = reference_attention(q, k, v, batch.cu_seqlens, True, 0.125)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)
