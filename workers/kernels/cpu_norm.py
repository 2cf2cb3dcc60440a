"""LayerNorm on CPU through a small C kernel (workers/kernels/cpu_norm.c), bf16 and fp32, with the
residual add before it in the same pass, cheaper than torch's (profiling/RESULTS.md). Where it
cannot be built, the models keep torch's LayerNorm (``norm_kernels``).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from tokq.workers.kernels import cpu_build
from tokq.workers.kernels.cpu_build import DTYPES

ROWS_PER_PART = 128  # fewer rows than this a thread: not worth handing to another thread
# tokq_layer_norm's parameters (workers/kernels/cpu_norm.c)
ARGTYPES = ((ctypes.c_void_p,) * 5 + (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                      ctypes.c_int64, ctypes.c_int64, ctypes.c_float))


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    return cpu_build.unavailable_reason("cpu_norm", "the C LayerNorm", device, dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None, in_place: bool = False) -> torch.Tensor:
    """``F.layer_norm`` of each row of ``x`` ``[T, n]`` (or of ``x + residual``, the sum
    rounded to the dtype as torch's add would); rows may be strided; a contiguous result,
    written over ``x`` with ``in_place`` (x contiguous): no new memory to bring into cache."""
    dtype = x.dtype  # plain comparisons: this runs twice a layer, for every forward
    if ((dtype is not torch.float32 and dtype is not torch.bfloat16) or weight.dtype != dtype
            or bias.dtype != dtype or (residual is not None and residual.dtype != dtype)):
        inputs = (x, weight, bias) if residual is None else (x, weight, bias, residual)
        raise TypeError(f"cpu_norm takes float32 or bfloat16 (have {[t.dtype for t in inputs]})")
    if (x.dim() != 2 or x.stride(1) != 1 or not (weight.is_contiguous() and bias.is_contiguous())
            or (residual is not None and (residual.shape != x.shape or residual.stride(1) != 1))):
        raise ValueError("cpu_norm takes [T, n] rows (a residual of the same shape) with the n "
                         "values contiguous")
    if in_place and not x.is_contiguous():
        raise ValueError("cpu_norm writes in place only over contiguous rows")
    fn = cpu_build.function("cpu_norm", "tokq_layer_norm", ARGTYPES)
    rows, n = x.shape
    out = x if in_place else torch.empty((rows, n), dtype=dtype)
    head = (x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
            bias.data_ptr(), out.data_ptr(), DTYPES[dtype])
    strides = (x.stride(0), 0 if residual is None else residual.stride(0), eps)
    parts = min(torch.get_num_threads(), rows // ROWS_PER_PART)
    if parts <= 1:  # on this thread, no hand-off
        fn(*head, 0, rows, n, *strides)
    else:
        cpu_build.run_parts(fn, [(*head, first, last, n, *strides)
                                 for first, last in cpu_build.even(rows, parts)])
    return out


class TorchNorms:
    """torch's LayerNorm; a residual is added by the linear before it (oneDNN fuses that)."""

    name = "torch"

    def __call__(self, x, weight, bias, eps):
        return F.layer_norm(x, weight.shape, weight, bias, eps)

    def linear_add_norm(self, linear, x, weight, bias, residual, norm_weight, norm_bias, eps):
        """LayerNorm(linear(x) + residual)."""
        return self(linear.add(x, weight, bias, residual), norm_weight, norm_bias, eps)


class CNorms:
    """The C kernel; a residual is added in the norm's own pass, after a plain linear."""

    name = "c"

    def __call__(self, x, weight, bias, eps):
        return layer_norm(x, weight, bias, eps)

    def linear_add_norm(self, linear, x, weight, bias, residual, norm_weight, norm_bias, eps):
        """LayerNorm(linear(x) + residual)."""
        return layer_norm(linear(x, weight, bias), norm_weight, norm_bias, eps, residual=residual,
                          in_place=True)  # the linear's output is ours and used once


def norm_kernels(device: torch.device, dtype: torch.dtype) -> TorchNorms | CNorms:
    """The C kernel where it runs (CPU, fp32/bf16, built), else torch's."""
    return CNorms() if unavailable_reason(device, dtype) is None else TorchNorms()
