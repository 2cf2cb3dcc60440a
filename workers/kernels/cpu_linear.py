"""Linear layers on CPU through a small C kernel (workers/kernels/cpu_linear.c), fp32 or bf16, bias
and residual add in the kernel. Picked for fp32 on one thread of an AVX2 CPU without AVX-512, where
oneDNN is slow at a short query's few rows (``preferred``), and beside oneDNN for batches of few
rows (workers/models/layers.py; docs/internals.md).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokq.host import cpu_flags
from tokq.workers.kernels import cpu_build

PANELS_PER_PART = 4  # fewer panels than this a thread: not worth handing to another thread
# tokq_linear's parameters (workers/kernels/cpu_linear.c)
ARGTYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int64)
PACK_ARGTYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_SYMBOLS = {torch.float32: "tokq_linear", torch.bfloat16: "tokq_linear_bf16"}

# hidden_act -> torch's in-place op on the linear's output (it is ours and used once)
_IN_PLACE = {
    "gelu": torch.ops.aten.gelu_, "gelu_new": lambda y: torch.ops.aten.gelu_(y, approximate="tanh"),
    "gelu_pytorch_tanh": lambda y: torch.ops.aten.gelu_(y, approximate="tanh"),
    "relu": torch.ops.aten.relu_, "silu": torch.ops.aten.silu_, "swish": torch.ops.aten.silu_,
}


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if dtype != torch.float32:
        return f"the C linear takes float32 (have {dtype})"
    return cpu_build.unavailable_reason("cpu_linear", "the C linear", device, dtype)


def small_rows_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the C kernel does not take batches of few rows in ``dtype`` here: fp32 where it builds,
    bf16 where it also runs on the CPU's bf16 dot products (measured faster than oneDNN there)."""
    reason = cpu_build.unavailable_reason("cpu_linear", "the C linear", device, dtype)
    if reason is None and dtype == torch.bfloat16 and not bf16_dot_products():
        return "the C linear's bf16 runs on AVX512-BF16 dot products only where it is used beside oneDNN"
    return reason


def bf16_dot_products() -> bool:
    """Whether the built kernel's bf16 runs on vdpbf16ps (AVX512-BF16)."""
    return bool(cpu_build.function("cpu_linear", "tokq_linear_bf16_dot_products", ())())


def preferred(flags: set[str] | None = None, threads: int | None = None) -> bool:
    """Where ``auto`` picks the C linear over oneDNN: one torch thread on an AVX2 CPU without
    AVX-512, where it measured faster; with more threads oneDNN's runtime wins (profiling/RESULTS.md)."""
    flags = cpu_flags() if flags is None else flags
    threads = torch.get_num_threads() if threads is None else threads
    return threads == 1 and "avx2" in flags and "fma" in flags and "avx512f" not in flags


@functools.cache
def _kernel(dtype: torch.dtype):
    return cpu_build.function("cpu_linear", _SYMBOLS[dtype], ARGTYPES)


@functools.cache
def panel_columns() -> int:
    """Output columns per packed panel: two vectors of the built kernel."""
    return 2 * cpu_build.vector_lanes("cpu_linear")


class CLinear:
    """The C kernel, on weights packed into its panels (``pack``). A packed weight keeps the
    shape ``[n, k]`` of the weight it came from; only its order in memory differs (bf16: a
    view of a larger buffer, its panels padded to whole ones)."""

    name = "c"

    def __init__(self, split: bool = True):
        self.split = split  # False: always on the calling thread (inputs of few rows: no hand-off)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        weight = weight.contiguous()
        if weight.dtype == torch.bfloat16:  # panels of pairs of k values, zero-padded to whole panels
            (n, k), columns = weight.shape, panel_columns()
            storage = torch.empty(-(-n // columns) * columns * 2 * -(-k // 2), dtype=torch.bfloat16)
            fn = cpu_build.function("cpu_linear", "tokq_pack_weight_bf16", PACK_ARGTYPES)
            fn(weight.data_ptr(), storage.data_ptr(), n, k)
            return storage.as_strided((n, k), (k, 1))
        packed = torch.empty_like(weight)
        fn = cpu_build.function("cpu_linear", "tokq_pack_weight", PACK_ARGTYPES)
        fn(weight.data_ptr(), packed.data_ptr(), *weight.shape)
        return packed

    def _run(self, x, weight, bias, residual=None) -> torch.Tensor:
        # The kernel reads raw memory: shapes and dtypes are checked here, as F.linear would.
        # Plain comparisons, no generator: this runs for every linear of every forward.
        (m, k), n, dtype = x.shape, weight.shape[0], weight.dtype
        if ((dtype is not torch.float32 and dtype is not torch.bfloat16) or x.dtype != dtype
                or weight.shape[1] != k
                or (bias is not None and (bias.dtype != dtype or bias.shape != (n,)))
                or (residual is not None and (residual.dtype != dtype or residual.shape != (m, n)))):
            given = [(tuple(t.shape), t.dtype) for t in (x, weight, bias, residual) if t is not None]
            raise ValueError(f"the C linear takes float32 (or bfloat16) x [m, k], weight [n, k], bias [n], "
                             f"residual [m, n], all of one dtype (have {given})")
        if x.stride(-1) != 1:
            x = x.contiguous()
        if bias is not None and bias.stride(0) != 1:
            bias = bias.contiguous()
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        out = torch.empty((m, n), dtype=dtype)
        fn = _kernel(dtype)
        head = (x.data_ptr(), x.stride(0), m, k, weight.data_ptr(), n,
                None if bias is None else bias.data_ptr(),
                None if residual is None else residual.data_ptr(),
                0 if residual is None else residual.stride(0), out.data_ptr())
        panels = -(-n // panel_columns())
        parts = min(torch.get_num_threads(), panels // PANELS_PER_PART) if self.split else 1
        if parts <= 1:  # on this thread, no hand-off
            fn(*head, 0, panels)
        else:
            cpu_build.run_parts(fn, [(*head, first, last) for first, last in cpu_build.even(panels, parts)])
        return out

    def c_weight(self, weight):
        """``weight`` as this kernel reads it: a weight it packed is its own."""
        return weight

    def __call__(self, x, weight, bias=None):
        return self._run(x, weight, bias)

    def act(self, x, weight, bias, act_name: str):
        return _IN_PLACE[act_name](self._run(x, weight, bias))

    def add(self, x, weight, bias, residual):
        return self._run(x, weight, bias, residual)
