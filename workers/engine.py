"""The model runtime a worker drives: load a local model once, then turn each PackedBatch into
``[N, hidden]`` float32 embeddings with no padding anywhere."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from tokq.batch import PackedBatch
from tokq.config import WorkerConfig
from tokq.model.flops import forward_flops
from tokq.model.info import ModelInfo
from tokq.workers import attention, cuda_graphs, pooling, prompt_attention, preempt
from tokq.workers.kernels import cpu_memory
from tokq.workers.device import check_torch_version, resolve_device, resolve_dtype, synchronize
from tokq.workers.layout import build_layout
from tokq.workers.layout import to_device
from tokq.workers.loader import load_weights
from tokq.workers.models.bert import Bert
from tokq.workers.models.qwen import Qwen
from tokq.workers.prompt_cache import PromptCache
from tokq.workers.scoring import ScoreHead, load_head

DEFAULT_PROMPT_CACHE_BYTES = 256 << 20


class Engine:
    def __init__(self, info: ModelInfo, model: Bert | Qwen, device: torch.device, dtype: torch.dtype,
                 attn_backend: str, prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
                 cuda_graph_tokens: int = 0, head: ScoreHead | None = None):
        self.info = info
        self.head = head  # a reranker's: embed() then returns one raw score per sequence
        self.model = model
        self.device = device
        self.dtype = dtype
        self.attn_backend = attn_backend  # the backend actually used, never "auto"
        self._attend = attention.attend_fn(attn_backend, device)
        # Shared prompts are computed once only where that is exact: causal attention, and the
        # last token pooled (mean or CLS pooling would need the prompt tokens' own states).
        self.prompt_cache = (PromptCache(prompt_cache_bytes, _fingerprint(info))
                             if model.causal and info.pooling == "last" else None)
        self.tokens_computed = 0  # tokens run through the model: what a prefix saves shows here
        self.last_graphed = False  # the last embed() replayed a CUDA graph
        # CPU: batches of at most this many tokens run on one thread (workers/models/layers.py)
        self.one_thread_tokens = getattr(model.linear, "threaded_rows", 0) if device.type == "cpu" else 0
        # CUDA, varlen attention: batches of at most cuda_graph_tokens replay captured graphs
        graphed = device.type == "cuda" and attn_backend in cuda_graphs.GRAPH_BACKENDS
        # the forward as a partial of the model's, not a lambda holding self: no reference cycle
        # keeps a dropped engine's graph pool alive until a garbage collection
        self.graphs = (cuda_graphs.CudaGraphs(functools.partial(model.forward, attend=self._attend), device,
                                              cuda_graph_tokens, info.max_length)
                       if cuda_graph_tokens and graphed else None)

    @property
    def linear_backend(self) -> str:
        """Kernel of the linear layers: c | onednn | torch."""
        return self.model.linear.name

    @classmethod
    def load(cls, path: str | Path | None = None, *, device: str | torch.device = "auto",
             dtype: str | torch.dtype = "auto", attn_backend: str = "auto",
             name: str | None = None, linear: str = "auto", revision: str | None = None,
             prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
             cuda_graph_tokens: int = WorkerConfig.cuda_graph_tokens) -> Engine:
        """Load a model directory or Hugging Face repo id at ``revision`` (None: the bundled
        all-MiniLM-L6-v2); UnsupportedModel names the supported architectures. ``linear``: the linear
        layers' kernel (workers/models/layers.py); ``cuda_graph_tokens``: workers/cuda_graphs.py."""
        check_torch_version()
        info = ModelInfo.load(path, name, revision)
        resolved_device = resolve_device(device)
        resolved_dtype = resolve_dtype(dtype, resolved_device)
        if resolved_device.type == "cpu":
            cpu_memory.keep_freed_memory()  # no page faults on each forward's activations
        backend = attention.choose_backend(attn_backend, resolved_device, resolved_dtype)
        model_cls = Bert if info.family == "bert" else Qwen
        weights = load_weights(info.path, model_cls.ANCHOR, dtype=resolved_dtype)  # on the host
        if model_cls is Bert:
            model = Bert(info.config, weights, linear, device=resolved_device)
        else:
            model = Qwen(info.config, weights, info.family, info.max_length, linear, device=resolved_device)
        head = load_head(info, weights, resolved_device) if info.is_reranker else None
        return cls(info, model, resolved_device, resolved_dtype, backend, prompt_cache_bytes,
                   cuda_graph_tokens, head)

    @torch.inference_mode()
    def embed(self, batch: PackedBatch) -> np.ndarray:
        """float32 ``[N, hidden]``: rows with ``dimensions`` d > 0 hold d values then zeros;
        rows with ``normalize`` have unit norm over their first d values. A reranker's: float32
        ``[N, 1]``, each sequence's raw score (before the activation)."""
        threads = torch.get_num_threads()
        if threads == 1 or batch.num_tokens > self.one_thread_tokens:
            return self._embed(batch)
        # Few tokens: their linears run on the C kernel, on this thread; a second thread for the
        # few torch ops left costs an OpenMP hand-off and gains nothing.
        torch.set_num_threads(1)
        try:
            return self._embed(batch)
        finally:
            torch.set_num_threads(threads)

    def _embed(self, batch: PackedBatch) -> np.ndarray:
        if batch.max_seqlen > self.info.max_length:
            raise ValueError(f"sequence of {batch.max_seqlen} tokens exceeds the model's "
                             f"max length {self.info.max_length}")
        # A heavy batch's forward may run light work between its layers' steps (workers/preempt.py).
        checkpoint = preempt.current_checkpoint()
        if batch.prompt_lens is not None and self.prompt_cache is not None:
            pooled, computed = prompt_attention.forward_pooled(
                self.model, batch, self.prompt_cache, self.attn_backend, self.device, self.dtype,
                checkpoint)
            self.tokens_computed += computed
            self.last_graphed = False
            return self._finish(pooled, batch)
        layout = build_layout(batch, self.device, self.attn_backend, causal=self.model.causal,
                              dtype=self.dtype)
        hidden = None
        token_types = _layout_token_types(batch, layout, self.device)
        # A graph has no checkpoint between its steps: a heavy forward (it has one) runs
        # eagerly, so light work can still run inside it. Nor has it segment ids.
        graphed = self.graphs is not None and checkpoint is preempt.no_checkpoint and token_types is None
        if graphed and self.graphs.covers(batch.num_tokens):
            hidden = self.graphs.forward(layout)
        replayed = hidden is not None
        if hidden is None:
            extra = {"token_types": token_types} if token_types is not None else {}
            hidden = self.model.forward(layout, self._attend, checkpoint=checkpoint, **extra)
        self.last_graphed = replayed  # after any batch nested in this forward set it
        self.tokens_computed += batch.num_tokens
        return self._finish(pooling.pool(hidden, layout, self.info.pooling), batch)

    def _finish(self, pooled: torch.Tensor, batch: PackedBatch) -> np.ndarray:
        if self.head is not None:
            return self.head(pooled).cpu().numpy()
        return pooling.finish(pooled, batch.normalize, batch.dimensions)

    def batch_flops(self, batch: PackedBatch) -> float:
        """FLOPs of one forward over ``batch`` (tokq.model.flops.forward_flops); a cached shared
        prompt is not computed, so it counts only as keys its queries attend to."""
        cached = batch.prompt_lens if batch.prompt_lens is not None and self.prompt_cache is not None else None
        return float(forward_flops(self.info.config, batch.seqlens, cached))

    def capture_graphs(self, max_tokens: int | None = None) -> int:
        """Capture the CUDA graphs of short-query batch shapes now, so no early batch waits for a
        capture; with ``max_tokens`` (the worker's budget) only shapes such a batch may need.
        Returns how many were captured (0 without graphs)."""
        graphs = self.graphs
        if graphs is None:
            return 0
        before = graphs.num_graphs
        out_of_memory = graphs.out_of_memory
        for shape in graphs.warm_shapes(max_tokens):
            full = graphs.num_graphs >= graphs.max_graphs
            if graphs.failed or full or graphs.out_of_memory > out_of_memory:
                break  # out of memory: the rest are captured on first use, memory allowing
            per_seq, extra = divmod(shape.num_tokens, shape.num_seqs)
            self.embed(self._synthetic_batch([per_seq + (i < extra) for i in range(shape.num_seqs)]))
        synchronize(self.device)
        return graphs.num_graphs - before

    def warmup(self, num_tokens: int) -> None:
        """Run one full-budget batch (max-length sequences, then the remainder) so allocator
        pools and kernels are ready before the first real batch."""
        max_len = self.info.max_length
        lens = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
        self.embed(self._synthetic_batch(lens))
        synchronize(self.device)

    def _synthetic_batch(self, lens: list[int]) -> PackedBatch:
        """Sequences of these lengths, valid token ids counting up (warm-ups, captures)."""
        vocab = int(self.info.config.get("vocab_size", 1000))
        return PackedBatch.pack([np.arange(1, n + 1, dtype=np.int64) % vocab for n in lens])


def _layout_token_types(batch: PackedBatch, layout, device: torch.device) -> torch.Tensor | None:
    """The batch's segment ids in the layout's token order (it may sort sequences by length)."""
    if batch.token_type_ids is None:
        return None
    types = to_device(batch.token_type_ids, device)
    if layout.restore is None:
        return types
    # token t of the layout is token positions[t] of sequence order[seq_index[t]] in the batch
    order = torch.argsort(layout.restore)
    starts = to_device(batch.cu_seqlens.astype(np.int64), device)
    return types[starts[order[layout.seq_index]] + layout.positions]


def _fingerprint(info: ModelInfo) -> str:
    """What the shared-prompt cache keys by besides the token ids (one engine serves one model)."""
    return getattr(info, "fingerprint", None) or f"{info.name}:{info.path}"
