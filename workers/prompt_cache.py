"""A worker's cache of shared-prompt K/V, keyed by the model's fingerprint and the shared prompt's
token ids (its K/V depend on nothing else), least recently used first out, within ``max_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch


class PromptCache:
    def __init__(self, max_bytes: int, fingerprint: str = "") -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self._entries: OrderedDict[tuple[str, bytes], torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.hits = 0  # tests read it: a prompt computed once, then served from here

    def key(self, prefix_ids: np.ndarray) -> tuple[str, bytes]:
        return self.fingerprint, np.ascontiguousarray(prefix_ids, dtype=np.int64).tobytes()

    def get(self, key: tuple[str, bytes]) -> torch.Tensor | None:
        """``[layers, 2, p, kv_heads, head_dim]`` (keys, values) or None; a hit becomes the most
        recently used entry."""
        kv = self._entries.get(key)
        if kv is None:
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return kv

    def put(self, key: tuple[str, bytes], kv: torch.Tensor) -> None:
        """Store ``kv``, evicting the least recently used entries to stay within the bound; an
        entry larger than the whole bound is not stored."""
        size = kv.numel() * kv.element_size()
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old.numel() * old.element_size()
        while self._entries and self.num_bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.numel() * evicted.element_size()
        self._entries[key] = kv
        self.num_bytes += size

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, bytes]) -> bool:
        return key in self._entries
