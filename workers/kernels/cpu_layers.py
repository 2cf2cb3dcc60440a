"""A BERT encoder's layers in one C call (workers/kernels/cpu_layers.c), for batches of few tokens on
one thread: the C linear, varlen attention and LayerNorm kernels the layer-by-layer path calls,
without its ~10 returns to Python per layer (models/bert.py picks it)."""

from __future__ import annotations

import ctypes

import torch

from tokq.workers.kernels import cpu_build
from tokq.workers.kernels.cpu_build import DTYPES

# tokq_bert_layers's parameters (workers/kernels/cpu_layers.c)
ARGTYPES = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_float)
# each layer's tensors, in the kernel's order: (field of models.bert.BertLayer, a linear weight)
FIELDS = (("qkv_weight", True), ("qkv_bias", False), ("out_weight", True), ("out_bias", False),
          ("attn_norm_weight", False), ("attn_norm_bias", False), ("up_weight", True), ("up_bias", False),
          ("down_weight", True), ("down_bias", False), ("mlp_norm_weight", False), ("mlp_norm_bias", False))


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    return cpu_build.unavailable_reason("cpu_layers", "the C encoder layers", device, dtype)


class BertLayers:
    """``layers`` (models.bert.BertLayer, GELU between the MLP's linears) as one call; ``c_weight``
    gives each linear weight as the C linear packed it."""

    def __init__(self, layers, c_weight, num_heads: int, eps: float):
        tensors = [c_weight(getattr(layer, name)) if linear else getattr(layer, name)
                   for layer in layers for name, linear in FIELDS]
        if any(t is None or t.dtype != tensors[0].dtype for t in tensors):
            raise ValueError("the C encoder layers need every weight and bias, in one dtype")
        self._tensors = tensors  # kept alive: the kernel reads them through these pointers
        self._pointers = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
        self.num_layers = len(layers)
        self.hidden, self.intermediate = layers[0].qkv_weight.shape[1], layers[0].up_weight.shape[0]
        self.num_heads, self.eps = num_heads, eps
        self.dtype = tensors[0].dtype
        self._fn = cpu_build.function("cpu_layers", "tokq_bert_layers", ARGTYPES)

    def __call__(self, x: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
        """The layers over contiguous ``x`` ``[T, hidden]``, in place; ``cu_seqlens`` int64."""
        if (x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.hidden or not x.is_contiguous()
                or cu_seqlens.dtype != torch.int64 or not cu_seqlens.is_contiguous()):
            raise ValueError(f"the C encoder layers take contiguous {self.dtype} x [T, {self.hidden}] and "
                             f"int64 cu_seqlens (have {x.dtype} {tuple(x.shape)}, {cu_seqlens.dtype})")
        if self._fn(x.data_ptr(), DTYPES[self.dtype], x.shape[0], cu_seqlens.data_ptr(),
                    cu_seqlens.shape[0] - 1, self.num_layers, self._pointers, self.hidden, self.num_heads,
                    self.intermediate, self.eps, scale):
            raise MemoryError("the C encoder layers: no memory for their scratch rows")
        return x
