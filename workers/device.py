"""Which device and dtype a model runs on: "auto" resolves to CUDA in bf16 when a GPU is
present, else CPU in fp32 (CPU bf16 matmuls are slower than fp32 on most server CPUs)."""

from __future__ import annotations

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; supported: auto, cpu, cuda, cuda:N")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a timer around a forward pass measures the pass."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
