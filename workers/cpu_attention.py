"""Varlen attention on CPU through a small C kernel (workers/cpu_attention.c), compiled with
this machine's C compiler on first use and cached; bf16 and fp32.

torch has no CPU varlen attention (``varlen_attn`` is CUDA-only), and on short-query batches
the padded-row matmuls of ``matmul_attention`` spend their time on gathers, empty slots and
per-op overhead rather than arithmetic. The kernel reads each sequence's q, k, v in place from
the packed ``[T, H, D]`` views and writes ``[T, Hq, D]``. When no compiler is at hand (or the
build fails, or the cache directory is not writable: ``$TOKQ_CACHE_DIR``, else
``$XDG_CACHE_HOME/tokq``, else ``~/.cache/tokq``) the worker keeps the torch backends;
``unavailable_reason`` says why.

Threads: the C call releases the GIL (ctypes), so with torch set to N threads the batch's
kv heads (then, past their number, the sequences) are split into N parts of about equal work,
run on a pool of N - 1 threads and the caller's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("tokq.attention")

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-shared", "-std=c11")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    if os.environ.get("TOKQ_CACHE_DIR"):
        return Path(os.environ["TOKQ_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "tokq"


def _cpu_flags() -> str:
    """The CPU's feature flags: -march=native builds for them, so they key the cache (a home
    shared by different machines gets one build per CPU kind)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded kernel, None) or (None, why not). Built once per source, flags and CPU."""
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (cc/gcc)"
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + cc.encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    path = _cache_dir() / f"cpu_attention-{key}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                built = Path(tmp) / path.name
                subprocess.run([cc, *FLAGS, "-o", str(built), str(SOURCE), "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                os.replace(built, path)  # atomic: concurrent workers never load half a file
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", "") or str(exc)).strip().splitlines()
            first_error = next((line for line in detail if "error" in line), detail[-1:] or "")
            return None, f"building {SOURCE.name} failed: {first_error}"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"loading {path} failed: {exc}"
    fn = lib.tokq_varlen_attention
    i64, c_int = ctypes.c_int64, ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [c_int, ctypes.c_void_p] + [c_int] * 7 + [i64] * 6 + [
        c_int, ctypes.c_float]
    fn.restype = c_int
    return lib, None


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"cpu_varlen runs on CPU (have {device})"
    if dtype not in DTYPES:
        return f"cpu_varlen takes float32 or bfloat16 (have {dtype})"
    return _library()[1]


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="cpu-attention")


def _even(n: int, parts: int) -> list[tuple[int, int]]:
    edges = [n * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if a < b]


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
    heads = _even(num_kv_heads, min(threads, num_kv_heads))
    seqs = _seq_chunks(cu, max(1, threads // len(heads)))
    return [(a, b, h0, h1) for a, b in seqs for h0, h1 in heads]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
           causal: bool, scale: float) -> torch.Tensor:
    """``[T, Hq, D]`` attention of each sequence (``cu_seqlens``) to itself."""
    lib, reason = _library()
    if lib is None:
        raise RuntimeError(reason)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise TypeError(f"cpu_varlen takes float32 or bfloat16 (have {q.dtype})")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise ValueError("cpu_varlen needs each head's D values contiguous")
    out = torch.empty(q.shape, dtype=q.dtype)
    cu = cu_seqlens.to(torch.int64).contiguous()
    cu_np = cu.numpy()
    num_seqs = len(cu_np) - 1
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), DTYPES[q.dtype],
            cu.data_ptr())
    rest = (q.shape[1], k.shape[1], q.shape[2], q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), int(causal), scale)
    fn = lib.tokq_varlen_attention
    threads = torch.get_num_threads()
    parts = _parts(cu_np, k.shape[1], threads) if threads > 1 else [(0, num_seqs, 0, k.shape[1])]
    futures = [_pool(threads).submit(fn, *args, *part, *rest) for part in parts[1:]]
    codes = [fn(*args, *parts[0], *rest)] + [f.result() for f in futures]
    if any(codes):
        raise MemoryError("cpu_varlen: no memory for its scratch rows")
    return out
