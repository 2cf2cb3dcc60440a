"""Attention over a packed batch: every backend takes q ``[T, Hq, D]`` and k, v ``[T, Hkv, D]``
(Hq a multiple of Hkv: grouped-query attention) and returns ``[T, Hq, D]``; no sequence ever
attends to a neighbour's tokens, and nothing outside attention is ever padded.

Backends (``auto`` picks the first that can run, in this order):
  CUDA: ``flash_attn``    flash-attn's ``flash_attn_varlen_func`` (fp16/bf16, sm80+), when it
                          imports (one built for another torch is skipped, with a log line)
        ``torch_varlen``  ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, fp16/bf16;
                          its keywords differ per version, checked one by one)
  CPU (and CUDA fallback: k, v heads repeated, since enable_gqa would drop CUDA SDPA to its
  math kernel), sequences sorted by length once per batch:
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

import functools
import importlib
import importlib.util
import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokq.batch import PackedBatch

log = logging.getLogger("tokq.attention")

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


AttendFn = Callable[..., torch.Tensor]


def _sdpa_attend(expand_kv: bool) -> AttendFn:
    """The sdpa backends. ``expand_kv``: repeat k, v up to q's heads instead of passing
    ``enable_gqa`` (CUDA: SDPA's flash and memory-efficient kernels refuse enable_gqa, so it
    would drop to the math kernel and its full [B, H, L, L] scores: OOM on long batches)."""
    def attend(q, k, v, layout: Layout, causal: bool, scale: float) -> torch.Tensor:
        if expand_kv and q.shape[1] != k.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return _sdpa_runs(q, k, v, layout, causal, scale)
    return attend


def _flash_attn_attend() -> AttendFn:
    from flash_attn import flash_attn_varlen_func  # flash-attn 2.6 .. 2.8: one signature

    def attend(q, k, v, layout: Layout, causal: bool, scale: float) -> torch.Tensor:
        cu, max_len = layout.cu_seqlens, layout.max_seqlen
        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale,
                                      causal=causal)
    return attend


def _torch_varlen_attend() -> AttendFn:
    """torch's varlen_attn, called with the keywords this torch's signature has, each checked
    on its own (looked up once here, not per call): 2.10 takes ``is_causal`` (``scale`` not
    in its first form); 2.11 replaced it by ``window_size`` (keyword-only); 2.12 added
    ``enable_gqa``. Without ``enable_gqa``, k and v are repeated up to q's heads."""
    from torch.nn.attention import varlen

    varlen_attn = varlen.varlen_attn
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal_kwargs = {True: {"window_size": (-1, 0)}, False: {"window_size": (-1, -1)}}
    elif "is_causal" in params:
        causal_kwargs = {True: {"is_causal": True}, False: {"is_causal": False}}
    else:
        raise TypeError(f"torch {torch.__version__}: varlen_attn takes neither window_size "
                        "nor is_causal")
    has_scale, has_gqa = "scale" in params, "enable_gqa" in params

    def attend(q, k, v, layout: Layout, causal: bool, scale: float) -> torch.Tensor:
        cu, max_len = layout.cu_seqlens, layout.max_seqlen
        kwargs = dict(causal_kwargs[causal])
        if has_scale:
            kwargs["scale"] = scale
        elif not math.isclose(scale, q.shape[-1] ** -0.5):
            raise ValueError(f"torch {torch.__version__}: varlen_attn has no scale argument")
        if q.shape[1] != k.shape[1]:
            if has_gqa:
                kwargs["enable_gqa"] = True
            else:
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
    return attend


def attend_fn(backend: str, device: torch.device | str = "cpu") -> AttendFn:
    """``fn(q, k, v, layout, causal, scale) -> [T, Hq, D]`` for a backend name on ``device``.
    The backend's function is imported and its signature read here, once per model."""
    if backend == "flash_attn":
        return _flash_attn_attend()
    if backend == "torch_varlen":
        return _torch_varlen_attend()
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}")
    return _sdpa_attend(expand_kv=torch.device(device).type == "cuda")


@functools.cache
def _import_error(module: str) -> str | None:
    """Why ``module`` is present but cannot be imported (e.g. flash-attn built against
    another torch: "undefined symbol"), or None when it imports. Tried once per process."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


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
    if _cuda_capability(device) < (8, 0):
        return f"{backend} needs an sm80+ GPU"
    if backend == "flash_attn":
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed (pip install flash-attn)"
        error = _import_error("flash_attn")
        return f"flash-attn is installed but does not import ({error})" if error else None
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs >= 2.10)"
    try:
        _torch_varlen_attend()
    except TypeError as exc:
        return str(exc)
    return None


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend to use: ``requested`` if it can run here (else ValueError), or for
    ``auto`` the first of BACKENDS that can."""
    if requested != "auto":
        reason = unavailable_reason(requested, device, dtype)
        if reason:
            raise ValueError(reason)
        return requested
    skipped = []
    for backend in BACKENDS:
        reason = unavailable_reason(backend, device, dtype)
        if reason is None:
            if device.type == "cuda" and skipped:  # one line: why not the faster kernel
                log.warning("attention backend %s (%s)", backend, "; ".join(skipped))
            return backend
        skipped.append(f"not {backend}: {reason}")
    raise AssertionError("the sdpa backends always run")
