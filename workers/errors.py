"""What a failed forward means for the worker: the device ran out of memory (split the batch
and retry), the device is broken for good (a sticky CUDA error: every later kernel fails too,
so the process must go), or the input itself is at fault (fail that item, answer the rest)."""

from __future__ import annotations

import gc
from enum import Enum

import torch


class Fault(Enum):
    OUT_OF_MEMORY = "out_of_memory"
    DEVICE = "device"  # sticky: the CUDA context is unusable until the process restarts
    INPUT = "input"


# cuBLAS/cuDNN report a failed workspace allocation with their own status, not torch's OOM.
_OOM_TEXTS = ("out of memory", "can't allocate memory", "cublas_status_alloc_failed",
              "cudnn_status_alloc_failed", "failed to allocate")
# After these the CUDA context is corrupt: every later call fails the same way.
_STICKY_TEXTS = ("cuda error", "device-side assert", "illegal memory access", "illegal address",
                 "illegal instruction", "unspecified launch failure", "misaligned address",
                 "cublas_status_execution_failed", "cudnn_status_execution_failed",
                 "uncorrectable ecc error", "nccl error")


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXTS)


def is_sticky_device_error(exc: BaseException) -> bool:
    accelerator_error = getattr(torch, "AcceleratorError", ())  # torch >= 2.8 raises this type
    if accelerator_error and isinstance(exc, accelerator_error) and not is_out_of_memory(exc):
        return True
    return (isinstance(exc, RuntimeError) and not is_out_of_memory(exc)
            and any(t in str(exc).lower() for t in _STICKY_TEXTS))


def classify(exc: BaseException) -> Fault:
    if is_out_of_memory(exc):
        return Fault.OUT_OF_MEMORY
    if is_sticky_device_error(exc):
        return Fault.DEVICE
    return Fault.INPUT


def release_memory(device: torch.device | str | None = None) -> None:
    """Free what a failed forward left behind. Call it only after the exception is gone: its
    traceback holds the forward's frames and so its activations; then hand the cached blocks
    back so the retry (or the next batch) can have them."""
    gc.collect()
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.empty_cache()
