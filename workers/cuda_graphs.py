"""CUDA: a small batch's forward replayed from a CUDA graph, all its kernels in one launch,
because a small eager forward is launch-bound. Batches are padded to shape buckets whose pad rows
belong to no sequence (docs/internals.md).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokq.workers.layout import Layout

log = logging.getLogger("tokq.cuda_graphs")

GRAPH_BACKENDS = ("flash_attn", "torch_varlen")
MAX_GRAPHS = 256  # the warm set (``warm_shapes``, 127 up to 4,096 tokens) and room to spare
MAX_OUT_OF_MEMORY = 2  # captures of one shape that ran out of memory, before it stays eager
MIN_LEN_BUCKET = 128  # flash attention's query block: shorter maxima give the same grid
_SMALLEST_BUCKET = 16


def token_buckets(max_tokens: int) -> list[int]:
    """16, 24, 32, 48, 64, 96, ... (pads at most half a batch, a third from 32 on), ending at
    ``max_tokens``."""
    sizes = set()
    size = _SMALLEST_BUCKET
    while size < max_tokens:
        sizes.update((size, size * 3 // 2))
        size *= 2
    return sorted(s for s in sizes if s < max_tokens) + [max_tokens]


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class Shape:
    """A graph's static shape: token rows, sequences, and the longest sequence it allows."""

    num_tokens: int
    num_seqs: int
    max_seqlen: int


class CudaGraphs:
    """Forwards of at most ``max_tokens`` tokens replayed from graphs captured per ``Shape``;
    ``forward(layout)`` gives ``[T, hidden]``, or None when the batch must run eagerly.
    ``capture=False`` runs the padded batch eagerly: the same buffers and shapes, testable on a CPU."""

    def __init__(self, forward: Callable[[Layout], torch.Tensor], device: torch.device, max_tokens: int,
                 max_length: int, *, capture: bool = True, max_graphs: int = MAX_GRAPHS):
        self._forward = forward
        self.device = device
        self.max_tokens = max_tokens
        self.max_length = max_length
        self.capture = capture
        self.max_graphs = max_graphs
        self.buckets = token_buckets(max_tokens)
        # one set of static inputs for every graph: each reads a prefix of them
        self._ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._cu = torch.zeros(max_tokens + 1, dtype=torch.int32, device=device)
        # and one output, which each graph's last node writes (allocated at the first capture)
        self._out: torch.Tensor | None = None
        self._graphs: dict[Shape, torch.cuda.CUDAGraph | None] = {}  # None: replayed eagerly
        self._out_of_memory: dict[Shape, int] = {}  # captures that ran out of memory, per shape
        self.out_of_memory = 0  # all shapes
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.failed: str | None = None  # why capture was given up
        self.capture_s = 0.0  # time spent capturing, all graphs

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def covers(self, num_tokens: int) -> bool:
        return self.failed is None and 0 < num_tokens <= self.max_tokens

    def warm_shapes(self, max_tokens: int | None = None) -> list[Shape]:
        """Every shape of a batch of at most ``max_tokens`` tokens (None: ``self.max_tokens``) whose
        sequences are all at most ``MIN_LEN_BUCKET`` tokens (short queries), captured before the
        worker serves so first calls do not wait for captures."""
        longest = min(MIN_LEN_BUCKET, self.max_length)
        limit = min(max_tokens or self.max_tokens, self.max_tokens)
        shapes = []
        for tokens in self.buckets[:bisect.bisect_left(self.buckets, limit) + 1]:
            counts = {tokens} | {1 << i for i in range(tokens.bit_length()) if 1 << i < tokens}
            shapes += [Shape(tokens, n, longest) for n in sorted(counts) if n * longest >= tokens]
        return shapes

    def shape_of(self, num_tokens: int, num_seqs: int, max_seqlen: int) -> Shape:
        tokens = self.buckets[bisect.bisect_left(self.buckets, num_tokens)]
        seqs = min(_next_pow2(num_seqs), tokens)
        longest = min(max(MIN_LEN_BUCKET, _next_pow2(max_seqlen)), self.max_length)
        return Shape(tokens, seqs, longest)

    def forward(self, layout: Layout) -> torch.Tensor | None:
        num_tokens = layout.input_ids.shape[0]
        num_seqs = layout.cu_seqlens.shape[0] - 1
        shape = self.shape_of(num_tokens, num_seqs, layout.max_seqlen)
        if shape not in self._graphs and (self.failed or len(self._graphs) >= self.max_graphs
                                          or self._out_of_memory.get(shape, 0) >= MAX_OUT_OF_MEMORY):
            return None
        self._ids[:num_tokens].copy_(layout.input_ids, non_blocking=True)
        self._positions[:num_tokens].copy_(layout.positions, non_blocking=True)
        self._cu[:num_seqs + 1].copy_(layout.cu_seqlens, non_blocking=True)
        self._cu[num_seqs + 1:shape.num_seqs + 1].fill_(num_tokens)  # the pad sequences: empty
        if shape not in self._graphs and not self._capture(shape):
            return None
        graph = self._graphs[shape]
        if graph is None:
            self._write_out(self._forward(self._static_layout(shape)))
        else:
            graph.replay()
        return self._out[:num_tokens]

    def _static_layout(self, shape: Shape) -> Layout:
        return Layout(input_ids=self._ids[:shape.num_tokens], positions=self._positions[:shape.num_tokens],
                      cu_seqlens=self._cu[:shape.num_seqs + 1], max_seqlen=shape.max_seqlen,
                      seq_index=self._ids[:0], runs=(), restore=None)

    def _write_out(self, hidden: torch.Tensor) -> None:
        if self._out is None:
            self._out = hidden.new_empty((self.max_tokens, hidden.shape[1]))
        self._out[:hidden.shape[0]].copy_(hidden)

    def _capture(self, shape: Shape) -> bool:
        """Capture ``shape``'s graph from the batch now in the static inputs. False: it failed,
        and the batch runs eagerly; after out of memory a later batch of that shape tries again
        (``MAX_OUT_OF_MEMORY`` tries in all), any other failure turns graphs off for good."""
        if not self.capture:
            self._graphs[shape] = None
            return True
        static = self._static_layout(shape)
        start = time.perf_counter()
        first_error: BaseException | None = None  # the forward's, not capture_end's after it
        try:
            # On the engine's GPU, not the thread's current one (cuda:0 unless set): capture
            # and replay follow the capture stream's device.
            with torch.cuda.device(self.device):
                before = torch.cuda.current_stream(self.device)
                try:
                    # One eager run on a side stream first: lazy set-up (cuBLAS workspaces,
                    # kernel selection) must not happen inside the capture.
                    side = torch.cuda.Stream(self.device)
                    side.wait_stream(before)
                    with torch.cuda.stream(side):
                        self._write_out(self._forward(static))
                    before.wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool, stream=side):
                        # The graph's own output goes back to the pool after the capture; only
                        # the copy into the shared output outlives a replay.
                        try:
                            self._write_out(self._forward(static))
                        except BaseException as exc:
                            first_error = exc
                            raise
                finally:
                    # a capture that failed to end leaves its stream current: not for eager work
                    torch.cuda.set_stream(before)
        except Exception as exc:  # noqa: BLE001 - any failure: this batch runs eagerly
            cause = first_error or exc
            reason = f"{type(cause).__name__}: {cause}".splitlines()[0][:300]
            if isinstance(cause, torch.OutOfMemoryError):
                # Each try costs a synchronize, an emptied cache and a forward: a few, then eager.
                tries = self._out_of_memory[shape] = self._out_of_memory.get(shape, 0) + 1
                self.out_of_memory += 1
                log.warning("CUDA graph capture for %s ran out of memory (%d of %d tries); this batch "
                            "runs eagerly: %s", shape, tries, MAX_OUT_OF_MEMORY, reason)
            else:
                self.failed = reason
                log.warning("CUDA graph capture failed for %s; forwards run eagerly from now on: %s",
                            shape, reason)
            return False
        took = time.perf_counter() - start
        self.capture_s += took
        self._graphs[shape] = graph
        log.info("CUDA graph %d captured: %d tokens, %d sequences, longest %d, in %.0f ms",
                 len(self._graphs), shape.num_tokens, shape.num_seqs, shape.max_seqlen, took * 1000)
        return True
