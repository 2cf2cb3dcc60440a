"""Which device and dtype a model runs on, and the torch versions tokq supports.

``auto``: CUDA when a GPU is present, else CPU, in the dtype the hardware runs natively (bf16 on
sm80+ or a CPU with native bf16 dot products, fp16 on sm70-sm75, else fp32; docs/internals.md).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator

import torch

from tokq.config import DTYPES
from tokq.host import cpu_flags, usable_cpus

# The oldest torch tokq runs on: F.scaled_dot_product_attention(enable_gqa=) and F.rms_norm.
# Tested on 2.13; torch.nn.attention.varlen (CUDA) is used from 2.10 on.
MIN_TORCH = (2, 6)
TESTED_TORCH = "2.13"
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def torch_version_error(version: str = torch.__version__) -> str | None:
    """One line saying why this torch is unsupported, or None when it is supported."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match and (int(match[1]), int(match[2])) >= MIN_TORCH:
        return None
    floor = ".".join(map(str, MIN_TORCH))
    return (f"tokq needs torch >= {floor} (tested on {TESTED_TORCH}); this is torch {version}: "
            f"pip install 'torch>={floor}'")


def check_torch_version(version: str = torch.__version__) -> None:
    error = torch_version_error(version)
    if error:
        raise RuntimeError(error)


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


def cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool:
    """AVX512_BF16 or AMX among ``flags``; without flags, this CPU's, asked of torch's own
    CPU probe, else read from /proc/cpuinfo."""
    if flags is not None:
        return bool(set(_BF16_CPU_FLAGS) & flags)
    return _this_cpu_has_native_bf16()


@functools.cache
def _this_cpu_has_native_bf16() -> bool:
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(torch.cpu, probe, None)
        if fn is not None and fn():
            return True
    return cpu_has_native_bf16(cpu_flags())


def auto_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        capability = cuda_capability(device)
        if capability >= (8, 0):
            return torch.bfloat16
        return torch.float16 if capability >= (7, 0) else torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device)
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return _DTYPES[dtype]


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a timer around a forward pass measures the pass."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker_threads(configured: int, usable: int | None = None) -> int:
    """A worker's torch CPU threads: ``configured`` (``--threads``), else torch's default capped by
    the CPUs this process may use, since torch's default ignores a container's CPU quota."""
    if configured:
        return configured
    return max(1, min(torch.get_num_threads(), usable or usable_cpus()))


@contextlib.contextmanager
def use_threads(threads: int | None) -> Iterator[None]:
    """torch's CPU threads set to ``threads`` for the block (0 or None: left as they are), then
    put back: the setting is process-wide, and a caller's later work should not inherit it."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
