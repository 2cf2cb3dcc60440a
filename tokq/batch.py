"""The packed batch: the only contract between the queue side and the model side.

Token ids of N sequences are concatenated into one flat ``[T]`` array with no padding;
``cu_seqlens`` (``[0, l1, l1+l2, ..., T]``) marks where each sequence starts, as flash-attn's
varlen kernels expect.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PackedBatch:
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T], 0-based within each sequence
    cu_seqlens: np.ndarray  # int32 [N+1]
    max_seqlen: int
    normalize: np.ndarray  # bool [N]: L2-normalize this sequence's embedding
    dimensions: np.ndarray  # int32 [N]: Matryoshka truncation, 0 = full dimension
    # int32 [N] or None: the first prompt_lens[i] tokens of sequence i are a shared prompt a
    # causal model may compute once (workers/prompt_attention.py); the ids stay complete
    prompt_lens: np.ndarray | None = None
    # int64 [T] or None (all 0): each token's segment, as a tokenizer's pair template gives it (a
    # cross-encoder's query is segment 0, its document 1)
    token_type_ids: np.ndarray | None = None

    @classmethod
    def pack(cls, sequences: Sequence[Sequence[int]], *, normalize: bool | Sequence[bool] = True,
             dimensions: int | Sequence[int] = 0,
             prompt_lens: int | Sequence[int] = 0,
             segment_starts: int | Sequence[int] = 0) -> PackedBatch:
        """``segment_starts``: per sequence, the first token of its second segment (0: one segment)."""
        if not sequences:
            raise ValueError("a batch needs at least one sequence")
        seqs = [np.asarray(s, dtype=np.int64) for s in sequences]
        lens = np.fromiter((s.size for s in seqs), dtype=np.int32, count=len(seqs))
        if (lens == 0).any():
            raise ValueError("empty sequence in batch")
        cu = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        # positions: 0..len-1 within each sequence, built without a Python loop
        positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], lens)
        n = len(seqs)
        shared_lens = np.broadcast_to(np.asarray(prompt_lens, dtype=np.int32), (n,))
        if ((shared_lens < 0) | (shared_lens >= lens)).any():
            raise ValueError("a shared prompt must leave at least one token of its sequence")
        starts = np.broadcast_to(np.asarray(segment_starts, dtype=np.int64), (n,))
        if ((starts < 0) | (starts >= lens)).any():
            raise ValueError("a second segment must start inside its sequence")
        types = (positions >= np.repeat(starts, lens)) & np.repeat(starts > 0, lens) if starts.any() else None
        return cls(
            input_ids=np.concatenate(seqs),
            positions=positions,
            cu_seqlens=cu,
            max_seqlen=int(lens.max()),
            normalize=np.broadcast_to(np.asarray(normalize, dtype=bool), (n,)).copy(),
            dimensions=np.broadcast_to(np.asarray(dimensions, dtype=np.int32), (n,)).copy(),
            prompt_lens=shared_lens.copy() if shared_lens.any() else None,
            token_type_ids=types.astype(np.int64) if types is not None else None,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def num_queued_tokens(self) -> int:
        """The tokens the queue counts for this batch: shared prompts are computed once and
        cached by the worker, so they are not counted."""
        return self.num_tokens - (int(self.prompt_lens.sum()) if self.prompt_lens is not None else 0)

    @property
    def seqlens(self) -> np.ndarray:
        return np.diff(self.cu_seqlens)
