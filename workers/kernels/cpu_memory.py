"""Freed memory kept in the process for the next forward (glibc's malloc), on CPU workers.

torch's CPU allocator caches nothing: every activation of a forward is malloc'ed and freed.
glibc gives blocks that large back to the kernel (each one mmap'ed, or the heap's top trimmed),
so the next forward touches fresh pages, and every page faults: ~3,000 minor faults per bf16
forward of a 1,024-token MiniLM batch, 2-4% of its time (profiling/RESULTS.md). Raising
glibc's mmap and trim thresholds keeps the blocks in the heap for reuse; the process's memory
then stays at its peak instead of shrinking between batches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling on 64-bit: larger blocks are still mmap'ed
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Set the thresholds once per process; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
