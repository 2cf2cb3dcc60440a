"""Varlen attention on CPU through a small C kernel (workers/kernels/cpu_attention.c), bf16 and fp32:
torch has none, and padded-row matmuls waste short-query batches on gathers and empty slots.
Each sequence is read in place; work is split over torch's threads (docs/internals.md).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from tokq.workers.kernels import cpu_build
from tokq.workers.kernels.cpu_build import DTYPES


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    return cpu_build.unavailable_reason("cpu_attention", "cpu_varlen", device, dtype)


# tokq_varlen_attention's parameters (workers/kernels/cpu_attention.c)
ARGTYPES = ((ctypes.c_void_p,) * 4 + (ctypes.c_int, ctypes.c_void_p) + (ctypes.c_int,) * 7
            + (ctypes.c_int64,) * 6 + (ctypes.c_int, ctypes.c_float))


# A build whose bf16 takes the fp32-math path (attend_one), for comparisons in the same run.
WITHOUT_DOT_PRODUCTS = ("-mno-avx512bf16",)


def _kernel(extra_flags: tuple[str, ...] = ()):
    return cpu_build.function("cpu_attention", "tokq_varlen_attention", ARGTYPES, extra_flags)


def bf16_dot_products(head_dim: int) -> bool:
    """Whether bf16 with ``head_dim`` runs on the CPU's bf16 dot products (AVX512-BF16's
    vdpbf16ps: the built kernel's ``attend_one_dp``), rather than in fp32 after converting.
    Raises RuntimeError, saying why, when the kernel cannot be built here."""
    return bool(cpu_build.function("cpu_attention", "tokq_varlen_bf16_dot_products",
                                   (ctypes.c_int,))(head_dim))


# Less work than this (query-key pairs over all heads) stays on the calling thread: a hand-off to
# another thread costs more than it saves (a 32-token MiniLM query: 12,672, 30-70 us on one thread)
MIN_SPLIT_WORK = 1 << 15


def _work(cu: np.ndarray, num_heads: int) -> int:
    lengths = np.diff(cu)
    return int(lengths @ (lengths + 1)) * num_heads


def _seq_chunks(cu: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """[first, last) sequence ranges of about equal work (length^2 + length each); a sequence is
    never split, so one long one can leave a range heavier than the rest."""
    lengths = np.diff(cu).astype(np.float64)
    if parts <= 1 or len(lengths) <= 1:
        return [(0, len(lengths))]
    work = np.cumsum(lengths ** 2 + lengths)
    bounds = np.searchsorted(work, work[-1] * np.arange(1, parts) / parts, side="right")
    edges = [0, *sorted(set(int(b) for b in bounds) - {0, len(lengths)}), len(lengths)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if a < b]


def _parts(cu: np.ndarray, num_kv_heads: int, threads: int) -> list[tuple[int, int, int, int]]:
    """(first seq, last seq, first kv head, last kv head) per thread: kv heads split first
    (equal work whatever the lengths), sequences too when there are more threads than heads."""
    heads = cpu_build.even(num_kv_heads, min(threads, num_kv_heads))
    seqs = _seq_chunks(cu, max(1, threads // len(heads)))
    return [(a, b, h0, h1) for a, b in seqs for h0, h1 in heads]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
           causal: bool, scale: float, *, extra_flags: tuple[str, ...] = ()) -> torch.Tensor:
    """``[T, Hq, D]`` attention of each sequence (``cu_seqlens``) to itself. ``extra_flags``:
    a variant build of the kernel (``WITHOUT_DOT_PRODUCTS``), for comparisons."""
    dtype = q.dtype  # plain comparisons: this runs once a layer, for every forward
    if ((dtype is not torch.float32 and dtype is not torch.bfloat16) or k.dtype != dtype
            or v.dtype != dtype):
        raise TypeError(f"cpu_varlen takes float32 or bfloat16 (have {q.dtype})")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("cpu_varlen needs each head's D values contiguous")
    out = torch.empty(q.shape, dtype=dtype)
    cu = cu_seqlens
    if cu.dtype is not torch.int64 or not cu.is_contiguous():
        cu = cu.to(torch.int64).contiguous()
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), DTYPES[dtype],
            cu.data_ptr())
    rest = (q.shape[1], k.shape[1], q.shape[2], q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), int(causal), scale)
    threads = torch.get_num_threads()
    kernel = _kernel(extra_flags)
    if threads > 1 and _work(cu_np := cu.numpy(), q.shape[1]) >= MIN_SPLIT_WORK:
        failed = any(cpu_build.run_parts(kernel, [(*args, *part, *rest)
                                                  for part in _parts(cu_np, k.shape[1], threads)]))
    else:  # on this thread, no hand-off
        failed = kernel(*args, 0, cu.shape[0] - 1, 0, k.shape[1], *rest)
    if failed:
        raise MemoryError("cpu_varlen: no memory for its scratch rows")
    return out
