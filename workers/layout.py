"""Batch-to-device staging: a PackedBatch becomes a ``Layout``, the tensors every layer and the
pooling read, built once per batch. For the packed/grouped SDPA backends (workers/attention.py)
the sequences are sorted by length and cut into ``SeqRun``s those backends loop over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokq.batch import PackedBatch

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
    # what an attention backend derives from the batch once and every layer reuses
    # (workers/matmul_attention.py), keyed by the backend
    plans: dict = field(default_factory=dict, compare=False, repr=False)


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
        restore = to_device(np.argsort(order), device)
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
        input_ids=to_device(np.ascontiguousarray(ids, dtype=np.int64), device),
        positions=to_device(np.ascontiguousarray(positions, dtype=np.int64), device),
        cu_seqlens=to_device(cu.astype(np.int32), device),
        max_seqlen=int(batch.max_seqlen),
        seq_index=to_device(np.repeat(np.arange(num_seqs, dtype=np.int64), lens), device),
        runs=runs,
        restore=restore,
    )


def _packed_run(cu: np.ndarray, lens: np.ndarray, first: int, last: int, row_len: int, causal: bool,
                dtype: torch.dtype, device: torch.device) -> SeqRun:
    """Sequences ``first..last`` (sorted, each <= row_len) packed into rows of ``row_len`` slots,
    best fit, longest first, since every slot costs attention work, filled or not; a slot attends
    only to slots of its own sequence (and, causal, not ahead)."""
    start, num_tokens = int(cu[first]), int(cu[last] - cu[first])
    run_lens = lens[first:last]
    row_of_seq = np.empty(last - first, dtype=np.int64)
    slot_of_seq = np.empty(last - first, dtype=np.int64)
    free: list[int] = []  # free slots of each row
    rows_by_free: list[list[int]] = [[] for _ in range(row_len)]  # rows with 1..row_len-1 free
    for i in np.argsort(-run_lens, kind="stable").tolist():
        n = int(run_lens[i])
        fits = next((f for f in range(n, row_len) if rows_by_free[f]), None)
        if fits is None:
            row = len(free)
            free.append(row_len)
        else:
            row = rows_by_free[fits].pop()
        row_of_seq[i], slot_of_seq[i] = row, row_len - free[row]
        free[row] -= n
        if free[row]:
            rows_by_free[free[row]].append(row)
    num_rows = len(free)
    seq_of_token = np.repeat(np.arange(last - first), run_lens)
    pos_of_token = np.arange(num_tokens) - np.repeat(cu[first:last] - start, run_lens)
    token_row, token_slot = row_of_seq[seq_of_token], slot_of_seq[seq_of_token] + pos_of_token
    gather = np.full((num_rows, row_len), start, dtype=np.int64)  # empty slots: any real row
    gather[token_row, token_slot] = start + np.arange(num_tokens)
    # which sequence fills each slot; each empty slot a class of its own, so it attends to itself
    # (finite output, never read) and no real token attends to it
    slot_seq = -1 - np.arange(num_rows * row_len).reshape(num_rows, row_len)
    slot_seq[token_row, token_slot] = seq_of_token
    allowed = slot_seq[:, :, None] == slot_seq[:, None, :]
    if causal:
        allowed &= np.tri(row_len, dtype=bool)[None]
    mask = np.where(allowed, 0.0, -np.inf).astype(np.float32)[:, None]
    return SeqRun(start, num_rows, row_len, num_tokens,
                  gather=to_device(gather.reshape(-1), device),
                  mask=to_device(mask, device).to(dtype),
                  scatter=to_device(token_row * row_len + token_slot, device))


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host array as a tensor on ``device`` (CUDA: through pinned memory, without blocking)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
