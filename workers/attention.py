"""Attention over a packed batch: every backend takes q ``[T, Hq, D]`` and k, v ``[T, Hkv, D]``
(Hq a multiple of Hkv: grouped-query attention) and returns ``[T, Hq, D]``; no sequence ever
attends to a neighbour's tokens, and nothing outside attention is ever padded.

Backends (``auto`` picks the first that can run, in this order):
  CUDA: ``flash_attn``    flash-attn's ``flash_attn_varlen_func`` (fp16/bf16, sm80+)
        ``torch_varlen``  ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, fp16/bf16)
  CPU (and CUDA fallback), sequences sorted by length once per batch:
        ``sdpa_packed``   sequences of <= 32 (33-64) tokens packed side by side into rows of 32
                          (64) slots, each row attending with a block-diagonal mask: all short
                          sequences in one SDPA call per layer; longer ones as ``sdpa_grouped``.
                          Empty slots exist inside attention only. Why: a CPU SDPA call costs
                          ~0.1 ms however small and a short-query batch has ~25 distinct
                          lengths; measured ~10% less attention time than ``sdpa_grouped``
                          (profiling/RESULTS.md).
        ``sdpa_grouped``  each run of equal-length sequences is a contiguous ``[B*L]`` slice that
                          views as ``[B, L, H, D]`` without a copy: one SDPA call per distinct
                          length, no empty slot at all.
        ``sdpa_loop``     one SDPA call per sequence: the simplest, the slowest.
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

BACKENDS = ("flash_attn", "torch_varlen", "sdpa_packed", "sdpa_grouped", "sdpa_loop")
_SORTED = ("sdpa_packed", "sdpa_grouped")  # backends that want sequences sorted by length
_ROW_LENS = (32, 64)  # sdpa_packed: slots per row; longer sequences are not packed


@dataclass(frozen=True)
class SeqRun:
    """Consecutive sequences holding token rows ``start .. start+num_tokens``, seen by attention
    as ``[num_seqs, seqlen]``: either sequences all exactly ``seqlen`` long (``gather`` None: a
    view, no copy) or ``num_seqs`` rows of ``seqlen`` slots holding several sequences each."""

    start: int
    num_seqs: int
    seqlen: int
    num_tokens: int
    gather: torch.Tensor | None = None  # [num_seqs*seqlen] token rows; empty slots repeat one
    mask: torch.Tensor | None = None  # [num_seqs, 1, seqlen, seqlen] additive: 0 or -inf
    scatter: torch.Tensor | None = None  # [num_tokens]: row * seqlen + slot of each token


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


def build_layout(batch: PackedBatch, device: torch.device, backend: str, *, causal: bool = False,
                 dtype: torch.dtype = torch.float32) -> Layout:
    """Move one batch to the device; for the packed/grouped SDPA backends sort its sequences by
    length (stable), so equal or similar lengths sit next to each other. ``causal`` and
    ``dtype`` (of q, k, v) shape sdpa_packed's masks. Built once, used by every layer."""
    lens = batch.seqlens.astype(np.int64)
    cu = batch.cu_seqlens.astype(np.int64)
    ids, positions, restore = batch.input_ids, batch.positions, None
    if backend in _SORTED and (np.diff(lens) < 0).any():
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
    if backend in _SORTED:
        runs = []
        num_packed = 0
        if backend == "sdpa_packed":
            tiers = np.searchsorted(np.asarray(_ROW_LENS), lens)  # sorted lengths: tiers ascend
            for tier, row_len in enumerate(_ROW_LENS):
                first, last = np.searchsorted(tiers, [tier, tier + 1])
                if last > first:
                    runs.append(_packed_run(cu, lens, first, last, row_len, causal, dtype, device))
            num_packed = int(np.searchsorted(tiers, len(_ROW_LENS)))
        edges = num_packed + np.flatnonzero(np.diff(lens[num_packed:]) != 0) + 1
        edges = np.concatenate(([num_packed], edges, [num_seqs])) if num_seqs > num_packed else []
        runs += [SeqRun(int(cu[a]), int(b - a), int(lens[a]), int(cu[b] - cu[a]))
                 for a, b in zip(edges[:-1], edges[1:])]
        runs = tuple(runs)
    elif backend == "sdpa_loop":
        runs = tuple(SeqRun(int(cu[i]), 1, int(lens[i]), int(lens[i])) for i in range(num_seqs))
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


def _packed_run(cu: np.ndarray, lens: np.ndarray, first: int, last: int, row_len: int, causal: bool,
                dtype: torch.dtype, device: torch.device) -> SeqRun:
    """Sequences ``first..last`` (sorted, each <= row_len) packed next-fit into rows of
    ``row_len`` slots; a slot attends only to slots of its own sequence (and, causal, not ahead)."""
    start, num_tokens = int(cu[first]), int(cu[last] - cu[first])
    run_lens = lens[first:last]
    row_of_seq = np.empty(last - first, dtype=np.int64)
    slot_of_seq = np.empty(last - first, dtype=np.int64)
    row, fill = 0, 0
    for i, n in enumerate(run_lens.tolist()):
        if fill + n > row_len:
            row, fill = row + 1, 0
        row_of_seq[i], slot_of_seq[i] = row, fill
        fill += n
    num_rows = row + 1
    seq_of_token = np.repeat(np.arange(last - first), run_lens)
    pos_of_token = np.arange(num_tokens) - np.repeat(cu[first:last] - start, run_lens)
    token_row, token_slot = row_of_seq[seq_of_token], slot_of_seq[seq_of_token] + pos_of_token
    gather = np.full((num_rows, row_len), start, dtype=np.int64)  # empty slots: any real row
    gather[token_row, token_slot] = start + np.arange(num_tokens)
    # which sequence fills each slot; each empty slot a class of its own, so it attends to itself
    # (finite output, never read) and no real token attends to it
    owner = -1 - np.arange(num_rows * row_len).reshape(num_rows, row_len)
    owner[token_row, token_slot] = seq_of_token
    allowed = owner[:, :, None] == owner[:, None, :]
    if causal:
        allowed &= np.tri(row_len, dtype=bool)[None]
    mask = np.where(allowed, 0.0, -np.inf).astype(np.float32)[:, None]
    return SeqRun(start, num_rows, row_len, num_tokens,
                  gather=_to_device(gather.reshape(-1), device),
                  mask=_to_device(mask, device).to(dtype),
                  scatter=_to_device(token_row * row_len + token_slot, device))


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
        rows = slice(run.start, run.start + run.num_tokens)
        shape = (run.num_seqs, run.seqlen)
        if run.gather is None and run.seqlen == 1:  # softmax over one key is 1: out = its value
            out[rows] = v[rows].repeat_interleave(num_q_heads // num_kv_heads, dim=1) if gqa else v[rows]
            continue
        if run.gather is None:  # equal lengths: [B*L] rows view as [B, L, H, D]
            qr, kr, vr = (x[rows].unflatten(0, shape).transpose(1, 2) for x in (q, k, v))
        else:
            # index_select, not x[index]: ~4x faster on these strided [T, H, D] views
            qr, kr, vr = (x.index_select(0, run.gather).unflatten(0, shape).transpose(1, 2)
                          for x in (q, k, v))
        # a packed run's mask already holds the causal rule
        o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=run.mask,
                                           is_causal=causal and run.mask is None, scale=scale,
                                           enable_gqa=gqa).transpose(1, 2)
        if run.gather is None:
            out[rows].unflatten(0, shape).copy_(o)
        else:
            torch.index_select(o.reshape(-1, *o.shape[2:]), 0, run.scatter, out=out[rows])
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
    "sdpa_packed": _sdpa_runs, "sdpa_grouped": _sdpa_runs, "sdpa_loop": _sdpa_runs,
}


def attend_fn(backend: str) -> AttendFn:
    """``fn(q, k, v, layout, causal, scale) -> [T, Hq, D]`` for a backend name."""
    return _ATTEND[backend]


def unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot run here, or None when it can."""
    if backend not in BACKENDS:
        return f"unknown attention backend {backend!r}; known: auto, {', '.join(BACKENDS)}"
    if backend.startswith("sdpa_"):
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
    raise AssertionError("the sdpa backends always run")
