"""Attention over a packed batch: q ``[T, Hq, D]`` and k, v ``[T, Hkv, D]`` in, ``[T, Hq, D]`` out;
no sequence attends to a neighbour's tokens, and nothing outside attention is padded.

Backends, first usable for ``auto``: flash_attn, torch_varlen (CUDA); cpu_varlen, sdpa_packed,
sdpa_grouped, sdpa_loop (CPU and CUDA fallback). How each works: docs/internals.md.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokq.workers import matmul_attention
from tokq.workers.kernels import cpu_attention
from tokq.workers.layout import Layout

log = logging.getLogger("tokq.attention")

BACKENDS = ("flash_attn", "torch_varlen", "cpu_varlen", "sdpa_packed", "sdpa_grouped", "sdpa_loop")


# CPU, bf16/fp16: runs of at most this many slots attend through plain batched matmuls + softmax
# (workers/matmul_attention.py), where SDPA's fixed costs dominate (profiling/RESULTS.md).
MATMUL_MAX_SEQLEN = 192


def _sdpa_runs(q, k, v, layout: Layout, causal: bool, scale: float) -> torch.Tensor:
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    gqa = num_q_heads != num_kv_heads
    out = q.new_empty(q.shape)
    runs = layout.runs
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and MATMUL_MAX_SEQLEN:
        runs = matmul_attention.attend(q, k, v, layout, causal, scale, MATMUL_MAX_SEQLEN, out)
    for run in runs:
        rows = slice(run.start, run.start + run.num_tokens)
        shape = (run.num_seqs, run.seqlen)
        if run.gather is None and run.seqlen == 1:  # softmax over one key is 1: out = its value
            out[rows] = v[rows].repeat_interleave(num_q_heads // num_kv_heads, dim=1) if gqa else v[rows]
            continue
        if run.gather is None:  # equal lengths: [B*L] rows view as [B, L, H, D]
            qr, kr, vr = (x[rows].unflatten(0, shape).transpose(1, 2) for x in (q, k, v))
        else:
            # index_select, not x[index]: faster on these strided [T, H, D] views
            qr, kr, vr = (x.index_select(0, run.gather).unflatten(0, shape).transpose(1, 2)
                          for x in (q, k, v))
        # a packed run's mask already holds the causal rule
        o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=run.mask,
                                           is_causal=causal and run.mask is None, scale=scale,
                                           enable_gqa=gqa)
        o = o.transpose(1, 2)
        if run.gather is None:
            out[rows].unflatten(0, shape).copy_(o)
        else:
            torch.index_select(o.reshape(-1, *o.shape[2:]), 0, run.scatter, out=out[rows])
    return out


AttendFn = Callable[..., torch.Tensor]


def _sdpa_attend(expand_kv: bool) -> AttendFn:
    """The sdpa backends. ``expand_kv``: repeat k, v up to q's heads instead of passing
    ``enable_gqa`` (CUDA: SDPA's flash and memory-efficient kernels refuse enable_gqa, so it
    would drop to the math kernel and its full [B, H, L, L] scores: OOM on long batches)."""
    def attend(q, k, v, layout: Layout, causal: bool, scale: float) -> torch.Tensor:
        if expand_kv and q.shape[1] != k.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return _sdpa_runs(q, k, v, layout, causal, scale)
    return attend


def _flash_attn_attend() -> AttendFn:
    from flash_attn import flash_attn_varlen_func  # flash-attn 2.6 .. 2.8: one signature

    def attend(q, k, v, layout: Layout, causal: bool, scale: float) -> torch.Tensor:
        cu, max_len = layout.cu_seqlens, layout.max_seqlen
        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale,
                                      causal=causal)
    return attend


def _torch_varlen_attend() -> AttendFn:
    """torch's varlen_attn, called with the keywords this torch's signature has (``is_causal`` or
    ``window_size``, ``scale``, ``enable_gqa``: they differ by version), read once here. Without
    ``enable_gqa``, k and v are repeated up to q's heads."""
    from torch.nn.attention import varlen

    varlen_attn = varlen.varlen_attn
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal_kwargs = {True: {"window_size": (-1, 0)}, False: {"window_size": (-1, -1)}}
    elif "is_causal" in params:
        causal_kwargs = {True: {"is_causal": True}, False: {"is_causal": False}}
    else:
        raise TypeError(f"torch {torch.__version__}: varlen_attn takes neither window_size "
                        "nor is_causal")
    has_scale, has_gqa = "scale" in params, "enable_gqa" in params

    def attend(q, k, v, layout: Layout, causal: bool, scale: float) -> torch.Tensor:
        cu, max_len = layout.cu_seqlens, layout.max_seqlen
        kwargs = dict(causal_kwargs[causal])
        if has_scale:
            kwargs["scale"] = scale
        elif not math.isclose(scale, q.shape[-1] ** -0.5):
            raise ValueError(f"torch {torch.__version__}: varlen_attn has no scale argument")
        if q.shape[1] != k.shape[1]:
            if has_gqa:
                kwargs["enable_gqa"] = True
            else:
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
    return attend


def cpu_varlen_cu(layout: Layout) -> torch.Tensor:
    """The batch's cu_seqlens in int64, as the C kernels read them: converted once per batch."""
    cu = layout.plans.get("cpu_varlen")
    if cu is None:
        cu = layout.plans["cpu_varlen"] = layout.cu_seqlens.to(torch.int64)
    return cu


def cpu_varlen_attend(q, k, v, layout: Layout, causal: bool, scale: float) -> torch.Tensor:
    return cpu_attention.attend(q, k, v, cpu_varlen_cu(layout), causal, scale)


def attend_fn(backend: str, device: torch.device | str = "cpu") -> AttendFn:
    """``fn(q, k, v, layout, causal, scale) -> [T, Hq, D]`` for a backend name on ``device``.
    The backend's function is imported and its signature read here, once per model."""
    if backend == "flash_attn":
        return _flash_attn_attend()
    if backend == "torch_varlen":
        return _torch_varlen_attend()
    if backend == "cpu_varlen":
        return cpu_varlen_attend
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}")
    return _sdpa_attend(expand_kv=torch.device(device).type == "cuda")


@functools.cache
def _import_error(module: str) -> str | None:
    """Why ``module`` is present but cannot be imported (e.g. flash-attn built against
    another torch: "undefined symbol"), or None when it imports. Tried once per process."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot run here, or None when it can."""
    if backend not in BACKENDS:
        return f"unknown attention backend {backend!r}; known: auto, {', '.join(BACKENDS)}"
    if backend.startswith("sdpa_"):
        return None
    if backend == "cpu_varlen":
        return cpu_attention.unavailable_reason(device, dtype)
    if device.type != "cuda":
        return f"{backend} needs a CUDA device (have {device})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{backend} needs float16 or bfloat16 (have {dtype})"
    if _cuda_capability(device) < (8, 0):
        return f"{backend} needs an sm80+ GPU"
    if backend == "flash_attn":
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed (pip install flash-attn)"
        error = _import_error("flash_attn")
        return f"flash-attn is installed but does not import ({error})" if error else None
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs >= 2.10)"
    try:
        _torch_varlen_attend()
    except TypeError as exc:
        return str(exc)
    return None


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend to use: ``requested`` if it can run here (else ValueError), or for
    ``auto`` the first of BACKENDS that can."""
    if requested != "auto":
        reason = unavailable_reason(requested, device, dtype)
        if reason:
            raise ValueError(reason)
        return requested
    skipped = []
    for backend in BACKENDS:
        reason = unavailable_reason(backend, device, dtype)
        if reason is None:
            if device.type == "cuda" and skipped:  # one line: why not the faster kernel
                log.warning("attention backend %s (%s)", backend, "; ".join(skipped))
            return backend
        skipped.append(f"not {backend}: {reason}")
    raise AssertionError("the sdpa backends always run")
