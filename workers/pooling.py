"""From the last hidden state ``[T, hidden]`` to one vector per sequence, vectorized over the
batch: one index op pools every sequence, one masked multiply truncates (Matryoshka), one
division normalizes, and the result crosses to the host once."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tokq.workers.layout import Layout

_MIN_NORM = 1e-12  # an all-zero vector stays zero instead of becoming NaN


def pool(hidden: torch.Tensor, layout: Layout, pooling: str) -> torch.Tensor:
    """fp32 ``[N, hidden]`` in the batch's original sequence order."""
    if pooling == "mean" and layout.cu_seqlens.shape[0] == 2:  # one sequence: its mean, no scatter
        return hidden.float().mean(0, keepdim=True)
    cu = layout.cu_seqlens.long()
    if pooling == "mean":
        num_seqs = cu.shape[0] - 1
        sums = hidden.new_zeros((num_seqs, hidden.shape[1]), dtype=torch.float32)
        sums.index_add_(0, layout.seq_index, hidden.float())
        pooled = sums / (cu[1:] - cu[:-1]).unsqueeze(1)
    elif pooling == "cls":
        pooled = hidden[cu[:-1]].float()
    elif pooling == "last":
        pooled = hidden[cu[1:] - 1].float()
    else:
        raise ValueError(f"unknown pooling {pooling!r}; supported: mean, cls, last")
    return pooled if layout.restore is None else pooled[layout.restore]


def finish(pooled: torch.Tensor, normalize: np.ndarray, dimensions: np.ndarray) -> np.ndarray:
    """Truncate rows with ``dimensions > 0`` to their first d values (zeros after), then scale
    rows with ``normalize`` to unit norm over what is left; float32 ``[N, hidden]`` on the host."""
    hidden = pooled.shape[1]
    if np.all(normalize) and not np.any(dimensions):  # the usual request: full vectors, unit length
        return F.normalize(pooled, dim=1, eps=_MIN_NORM).cpu().numpy()
    device = pooled.device
    dims = torch.from_numpy(np.asarray(dimensions, dtype=np.int64)).to(device)
    dims = torch.where((dims > 0) & (dims < hidden), dims, hidden)
    keep = torch.arange(hidden, device=device).unsqueeze(0) < dims.unsqueeze(1)
    out = pooled * keep
    wants_norm = torch.from_numpy(np.asarray(normalize, dtype=bool)).to(device)
    norms = out.norm(dim=1, keepdim=True).clamp_min(_MIN_NORM)
    out = torch.where(wants_norm.unsqueeze(1), out / norms, out)
    return out.cpu().numpy()
