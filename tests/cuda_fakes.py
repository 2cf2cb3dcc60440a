"""Contract fakes of the two CUDA varlen attention functions tokq calls (no tests here).

Each fake carries the real signature of a released version (copied from flash-attn's
``flash_attn_interface.py`` at tags v2.6.0 .. v2.8.3 and from torch's
``torch/nn/attention/varlen.py`` / versioned docs; the installed torch's is read from the
function itself) and binds every call to it with ``inspect.Signature.bind``, so a keyword a
version lacks raises TypeError exactly as the real call would. It then checks what the CUDA
kernels require of their arguments and answers with attention computed in float64, one
sequence at a time: a whole Engine forward runs through a CUDA backend's call path on CPU.
"""

from __future__ import annotations

import inspect

import torch

# flash-attn 2.6.0 through 2.8.3 (every tag in between has this same signature)
FLASH_ATTN_SIGNATURES = {
    "flash-attn 2.6-2.8": "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
                          "dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                          "softcap=0.0, alibi_slopes=None, deterministic=False, "
                          "return_attn_probs=False, block_table=None)",
}
_TORCH_HEAD = "(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, "
TORCH_VARLEN_SIGNATURES = {
    # pytorch#164502 as merged (the first varlen_attn): causal flag, no scale
    "torch 2.10 (first form)": _TORCH_HEAD + "is_causal=False, return_aux=None)",
    "torch 2.10": _TORCH_HEAD + "is_causal=False, return_aux=None, scale=None)",
    # pytorch#172238/#172245: keyword-only, is_causal replaced by window_size
    "torch 2.11": _TORCH_HEAD + "*, return_aux=None, scale=None, window_size=(-1, -1))",
    "torch 2.12": _TORCH_HEAD + "*, return_aux=None, scale=None, window_size=(-1, -1), "
                                "enable_gqa=False, seqused_k=None, block_table=None, num_splits=None)",
}


def installed_torch_varlen_signature() -> inspect.Signature:
    from torch.nn.attention.varlen import varlen_attn

    return inspect.signature(varlen_attn)


def signature(text: str | inspect.Signature) -> inspect.Signature:
    if isinstance(text, inspect.Signature):
        return text
    namespace: dict = {}
    exec(f"def f{text}: pass", namespace)  # noqa: S102 - our own literal signatures above
    return inspect.signature(namespace["f"])


def reference_attention(q, k, v, cu_seqlens, causal: bool, scale: float,
                        cu_seqlens_k=None) -> torch.Tensor:
    """float64 attention, each sequence on its own; k, v heads shared by groups of q heads.
    With ``cu_seqlens_k`` a sequence may have more keys than queries (a shared prompt's K/V
    first); the causal mask is then aligned to the bottom right, as flash-attn's is."""
    q, k, v = (x.detach().double().cpu() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.full_like(q, float("nan"))  # rows in no sequence: never written, as the kernels
    cu_q = [int(c) for c in cu_seqlens]
    cu_k = cu_q if cu_seqlens_k is None else [int(c) for c in cu_seqlens_k]
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)  # [H, Lq, D]
        ks, vs = (x[cu_k[i]:cu_k[i + 1]].transpose(0, 1) for x in (k, v))
        scores = qs @ ks.transpose(1, 2) * scale
        if causal:
            lq, lk = qs.shape[1], ks.shape[1]
            scores = scores.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(lk - lq + 1),
                                        float("-inf"))
        out[cu_q[i]:cu_q[i + 1]] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def _check_qkv(q, k, v) -> None:
    assert q.dim() == k.dim() == v.dim() == 3, "q, k, v must be [total_tokens, heads, head_dim]"
    assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert q.dtype in (torch.float16, torch.bfloat16), f"the CUDA kernels take fp16/bf16, got {q.dtype}"
    assert q.device == k.device == v.device
    assert k.shape == v.shape
    assert q.shape[2] == k.shape[2] <= 256, "head_dim must match and be <= 256"
    assert q.shape[1] % k.shape[1] == 0, "q heads must be a multiple of kv heads"
    for x in (q, k, v):
        assert x.stride(-1) == 1, "the last dimension must be contiguous"


def _check_cu(cu, q, max_len, name: str, padded: bool = False) -> None:
    """Without ``padded``: exactly the batch (every row in a sequence, none empty, ``max_len``
    the longest), as an eager forward passes it. With it, what a CUDA graph's padded shape
    passes and the kernels accept: empty sequences, rows past the last sequence, ``max_len``
    an upper bound."""
    assert isinstance(cu, torch.Tensor) and cu.dtype == torch.int32, f"{name} must be int32"
    assert cu.dim() == 1 and cu.is_contiguous(), f"{name} must be a contiguous 1-d tensor"
    assert cu.device == q.device, f"{name} on {cu.device}, q on {q.device}"
    lens = cu[1:] - cu[:-1]
    assert type(max_len) is int, f"max length must be a Python int, got {type(max_len).__name__}"
    assert int(cu[0]) == 0 and (lens >= 0).all()
    if padded:
        assert int(cu[-1]) <= q.shape[0] and max_len >= int(lens.max()), (int(cu[-1]), max_len)
    else:
        assert int(cu[-1]) == q.shape[0] and (lens > 0).all()
        assert max_len == int(lens.max()), (max_len, int(lens.max()))


class _VarlenFake:
    """One version of a varlen attention function: calls are bound to its ``signature`` (a
    keyword it lacks raises TypeError, as the real call would), recorded in ``calls`` and
    answered with ``reference_attention``. ``padded``: accept a CUDA graph's padded batch
    (``_check_cu``); rows in no sequence come back NaN, so a forward that reads them shows."""

    padded = False

    def __init__(self, version: str, sig: inspect.Signature) -> None:
        self.version = version
        self.signature = sig
        self.__signature__ = sig  # what inspect.signature(fake) reports
        self.calls: list[dict] = []

    def _bind(self, args, kwargs) -> dict:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def _answer(self, q, k, v, cu_q, cu_k, causal: bool, scale: float | None) -> torch.Tensor:
        assert isinstance(causal, bool)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        self.calls.append({"causal": causal, "heads": (q.shape[1], k.shape[1]), "scale": scale,
                           "tokens": q.shape[0]})
        return reference_attention(q, k, v, cu_q, causal, scale, cu_seqlens_k=cu_k).to(q.dtype)


class FlashAttnVarlenFake(_VarlenFake):
    """``flash_attn.flash_attn_varlen_func`` of one version."""

    def __init__(self, version: str = "flash-attn 2.6-2.8") -> None:
        super().__init__(version, signature(FLASH_ATTN_SIGNATURES[version]))

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        a = self._bind(args, kwargs)
        q, k, v = a["q"], a["k"], a["v"]
        _check_qkv(q, k, v)
        _check_cu(a["cu_seqlens_q"], q, a["max_seqlen_q"], "cu_seqlens_q", self.padded)
        _check_cu(a["cu_seqlens_k"], k, a["max_seqlen_k"], "cu_seqlens_k", self.padded)
        assert a["dropout_p"] == 0.0 and tuple(a["window_size"]) == (-1, -1) and a["softcap"] == 0.0
        assert a["alibi_slopes"] is None and not a["return_attn_probs"] and a["block_table"] is None
        return self._answer(q, k, v, a["cu_seqlens_q"], a["cu_seqlens_k"], a["causal"], a["softmax_scale"])


class TorchVarlenFake(_VarlenFake):
    """``torch.nn.attention.varlen.varlen_attn`` of one version ("installed": this torch's)."""

    def __init__(self, version: str) -> None:
        super().__init__(version, installed_torch_varlen_signature() if version == "installed"
                         else signature(TORCH_VARLEN_SIGNATURES[version]))

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        a = self._bind(args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        _check_qkv(q, k, v)
        _check_cu(a["cu_seq_q"], q, a["max_q"], "cu_seq_q", self.padded)
        _check_cu(a["cu_seq_k"], k, a["max_k"], "cu_seq_k", self.padded)
        assert a["return_aux"] is None
        if "window_size" in a:
            window = a["window_size"]
            # torch decides causality by ``window_size == (-1, 0)``: a list would not match
            assert window in ((-1, -1), (-1, 0)), f"window_size {window!r}: only full or causal"
            causal = window == (-1, 0)
        else:
            causal = a["is_causal"]
        if q.shape[1] != k.shape[1]:
            # torch >= 2.12 raises ValueError without enable_gqa; earlier versions have no GQA
            assert a.get("enable_gqa", False), "GQA heads without enable_gqa=True"
        for unused in ("seqused_k", "block_table", "num_splits"):
            assert a.get(unused) is None, unused
        return self._answer(q, k, v, a["cu_seq_q"], a["cu_seq_k"], causal, a.get("scale"))
