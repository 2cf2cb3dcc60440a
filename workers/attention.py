"""Attention over a packed batch: every backend takes q ``[T, Hq, D]`` and k, v ``[T, Hkv, D]``
(Hq a multiple of Hkv: grouped-query attention) and returns ``[T, Hq, D]``; no sequence ever
attends to a neighbour's tokens, and nothing is padded.

Backends (``auto`` picks the first that can run, in this order):
  CUDA: ``flash_attn``   flash-attn's ``flash_attn_varlen_func`` (fp16/bf16, sm80+)
        ``torch_varlen`` ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, fp16/bf16)
        ``sdpa_grouped`` below
  CPU:  ``sdpa_grouped`` sequences sorted by length once per batch, so each run of equal-length
        sequences is a contiguous ``[B*L]`` slice that views as ``[B, L, H, D]`` without a copy:
        one SDPA call per distinct length, no padding at all. Measured fastest on CPU (see
        profiling/RESULTS.md) ahead of one call per sequence (``sdpa_loop``).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokq.batch import PackedBatch

BACKENDS = ("flash_attn", "torch_varlen", "sdpa_grouped", "sdpa_loop")


@dataclass(frozen=True)
class SeqRun:
    """``num_seqs`` consecutive sequences of ``seqlen`` tokens each, from token row ``start``."""

    start: int
    num_seqs: int
    seqlen: int


@dataclass(frozen=True)
class Layout:
    """The batch as the model sees it, on the model's device, in the model's token order."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int32 [N+1]
    max_seqlen: int
    seq_index: torch.Tensor  # int64 [T]: which sequence each token row belongs to
    runs: tuple[SeqRun, ...]  # what the sdpa backends loop over
    restore: torch.Tensor | None  # rows of pooled output -> batch order (None: already)


def build_layout(batch: PackedBatch, device: torch.device, backend: str) -> Layout:
    """Move one batch to the device; for ``sdpa_grouped`` sort its sequences by length."""
    lens = batch.seqlens.astype(np.int64)
    cu = batch.cu_seqlens.astype(np.int64)
    ids, positions, restore = batch.input_ids, batch.positions, None
    if backend == "sdpa_grouped" and (np.diff(lens) < 0).any():
        order = np.argsort(lens, kind="stable")
        sorted_lens = lens[order]
        sorted_cu = np.zeros_like(cu)
        np.cumsum(sorted_lens, out=sorted_cu[1:])
        # row r of the sorted batch = row (r - new start + old start) of its sequence
        token_rows = (np.arange(int(cu[-1])) + np.repeat(cu[:-1][order] - sorted_cu[:-1], sorted_lens))
        ids, positions = ids[token_rows], positions[token_rows]
        restore = _to_device(np.argsort(order), device)
        lens, cu = sorted_lens, sorted_cu
    num_seqs = len(lens)
    if backend == "sdpa_grouped":
        edges = np.concatenate(([0], np.flatnonzero(np.diff(lens)) + 1, [num_seqs]))
        runs = tuple(SeqRun(int(cu[a]), int(b - a), int(lens[a])) for a, b in zip(edges[:-1], edges[1:]))
    elif backend == "sdpa_loop":
        runs = tuple(SeqRun(int(cu[i]), 1, int(lens[i])) for i in range(num_seqs))
    else:
        runs = ()
    return Layout(
        input_ids=_to_device(np.ascontiguousarray(ids, dtype=np.int64), device),
        positions=_to_device(np.ascontiguousarray(positions, dtype=np.int64), device),
        cu_seqlens=_to_device(cu.astype(np.int32), device),
        max_seqlen=int(batch.max_seqlen),
        seq_index=_to_device(np.repeat(np.arange(num_seqs, dtype=np.int64), lens), device),
        runs=runs,
        restore=restore,
    )


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def _sdpa_runs(q, k, v, layout: Layout, causal: bool, scale: float) -> torch.Tensor:
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    gqa = num_q_heads != num_kv_heads
    out = q.new_empty(q.shape)
    for run in layout.runs:
        rows = slice(run.start, run.start + run.num_seqs * run.seqlen)
        if run.seqlen == 1:  # softmax over a single key is 1: the output is that key's value
            out[rows] = v[rows].repeat_interleave(num_q_heads // num_kv_heads, dim=1) if gqa else v[rows]
            continue
        shape = (run.num_seqs, run.seqlen)
        qr, kr, vr = (x[rows].unflatten(0, shape).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=scale, enable_gqa=gqa)
        out[rows].unflatten(0, shape).copy_(o.transpose(1, 2))
    return out


def _flash_attn(q, k, v, layout: Layout, causal: bool, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    cu, max_len = layout.cu_seqlens, layout.max_seqlen
    return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=causal)


def _torch_varlen(q, k, v, layout: Layout, causal: bool, scale: float) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cu, max_len = layout.cu_seqlens, layout.max_seqlen
    gqa = q.shape[1] != k.shape[1]
    if "window_size" in _varlen_params():  # torch >= 2.11: causal is a (-1, 0) window
        window = (-1, 0) if causal else (-1, -1)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=window,
                           enable_gqa=gqa)
    if gqa:  # torch 2.10's varlen_attn has neither a window nor GQA
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, is_causal=causal, scale=scale)


def _varlen_params() -> set[str]:
    from torch.nn.attention.varlen import varlen_attn

    return set(inspect.signature(varlen_attn).parameters)


AttendFn = Callable[..., torch.Tensor]
_ATTEND: dict[str, AttendFn] = {
    "flash_attn": _flash_attn, "torch_varlen": _torch_varlen,
    "sdpa_grouped": _sdpa_runs, "sdpa_loop": _sdpa_runs,
}


def attend_fn(backend: str) -> AttendFn:
    """``fn(q, k, v, layout, causal, scale) -> [T, Hq, D]`` for a backend name."""
    return _ATTEND[backend]


def unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot run here, or None when it can."""
    if backend not in BACKENDS:
        return f"unknown attention backend {backend!r}; known: auto, {', '.join(BACKENDS)}"
    if backend in ("sdpa_grouped", "sdpa_loop"):
        return None
    if device.type != "cuda":
        return f"{backend} needs a CUDA device (have {device})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{backend} needs float16 or bfloat16 (have {dtype})"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"{backend} needs an sm80+ GPU"
    if backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install flash-attn)"
    if backend == "torch_varlen" and importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs >= 2.10)"
    return None


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend to use: ``requested`` if it can run here (else ValueError), or for
    ``auto`` the first of BACKENDS that can."""
    if requested != "auto":
        reason = unavailable_reason(requested, device, dtype)
        if reason:
            raise ValueError(reason)
        return requested
    for backend in BACKENDS:
        if unavailable_reason(backend, device, dtype) is None:
            return backend
    raise AssertionError("sdpa_grouped always runs")
