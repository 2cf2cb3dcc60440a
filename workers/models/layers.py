"""Pieces the model files share: linear layers, activations, RMSNorm, rotary position embedding."""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from tokq.model.info import UnsupportedModel

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


# hidden_act -> (oneDNN post-op, its algorithm)
_ONEDNN_ACTIVATIONS = {
    "gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"), "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""), "silu": ("swish", ""), "swish": ("swish", ""),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise UnsupportedModel(f"unsupported hidden_act {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class TorchLinear:
    """``F.linear``, then the activation or the residual add as separate ops."""

    name = "torch"

    def pack(self, weight):
        return weight

    def __call__(self, x, weight, bias=None):
        return F.linear(x, weight, bias)

    def act(self, x, weight, bias, act_name: str):
        return ACTIVATIONS[act_name](F.linear(x, weight, bias))

    def add(self, x, weight, bias, residual):
        return F.linear(x, weight, bias).add_(residual)


class OneDnnLinear:
    """oneDNN's linear (fp32 or bf16) with the activation or residual add fused in: torch's fp32
    ``F.linear`` goes to MKL, whose AMD path is AVX2 (profiling/RESULTS.md). Weights are reordered
    once at load (``pack``) into oneDNN's blocked layout, which it otherwise redoes every call.

    With ``small`` (the C kernel), inputs of at most ``small_rows`` rows run on it, over a second
    copy of the weights in its panels: there oneDNN's fixed cost per call and its slower weight
    reads dominate. With more than one torch thread the limit is ``threaded_rows``: past it
    oneDNN's threads win."""

    name = "onednn"

    def __init__(self, small=None, small_rows: int = 0, threaded_rows: int = 0):
        self._op = torch.ops.mkldnn._linear_pointwise
        self.small = small
        self.small_rows = small_rows if small is not None else 0
        self.threaded_rows = min(threaded_rows, self.small_rows)
        self._small_weights: dict[int, tuple] = {}  # id(oneDNN's weight) -> (it, the C kernel's)

    def pack(self, weight):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        if self.small_rows:
            self._small_weights[id(packed)] = (packed, self.small.pack(weight))
        return packed

    def c_weight(self, weight):
        """The C kernel's copy of ``weight`` (a weight this linear packed), else None."""
        pair = self._small_weights.get(id(weight))
        return pair[1] if pair is not None else None

    def _small(self, x, weight):
        """The C kernel's copy of ``weight`` when ``x`` has few enough rows for it, else None."""
        if x.shape[0] > (self.small_rows if torch.get_num_threads() == 1 else self.threaded_rows):
            return None
        pair = self._small_weights.get(id(weight))
        return pair[1] if pair is not None else None

    def __call__(self, x, weight, bias=None):
        if (small := self._small(x, weight)) is not None:
            return self.small(x, small, bias)
        return self._op(x, weight, bias, "none", [], "")

    def act(self, x, weight, bias, act_name: str):
        if (small := self._small(x, weight)) is not None:
            return self.small.act(x, small, bias, act_name)
        attr, algorithm = _ONEDNN_ACTIVATIONS[act_name]
        return self._op(x, weight, bias, attr, [], algorithm)

    def add(self, x, weight, bias, residual):
        if (small := self._small(x, weight)) is not None:
            return self.small.add(x, small, bias, residual)
        return self._op.binary(x, residual, weight, bias, "add")


# Inputs of at most this many rows (tokens) run on the C kernel beside oneDNN (``auto``), per dtype:
# where it measured faster than oneDNN on one thread (AVX-512 CPU, all-MiniLM-L6-v2)
SMALL_ROWS = {torch.float32: 48, torch.bfloat16: 16}
# ... with more torch threads, past this many oneDNN on all of them can be faster (forwards of at
# most this many tokens run on one thread, their BERT layers in one C call: workers/engine.py)
THREADED_ROWS = 12
# ... when its second copy of the weights takes at most this much memory
SMALL_ROWS_MAX_BYTES = 512 << 20


def linear_kernels(device: torch.device, dtype: torch.dtype, kind: str = "auto", num_params: int = 0):
    """For fp32 on one thread of an AVX2 CPU without AVX-512, the C kernel (workers/kernels/cpu_linear.py)
    where it builds; else oneDNN for fp32 and bf16 on CPU when this torch build has it (checked against
    F.linear once per dtype), with the C kernel for inputs of few rows (``SMALL_ROWS``) when the model's
    ``num_params`` linear weights fit ``SMALL_ROWS_MAX_BYTES`` twice; else F.linear. ``kind`` forces
    one: auto | c | onednn | torch."""
    from tokq.workers.kernels import cpu_linear

    if kind == "torch":
        return TorchLinear()
    if kind == "c" or (kind == "auto" and cpu_linear.preferred()):
        reason = cpu_linear.unavailable_reason(device, dtype)
        if reason is None:
            return cpu_linear.CLinear()
        if kind == "c":
            raise ValueError(reason)
    usable = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _onednn_works(dtype)
    if kind == "onednn" and not usable:
        raise ValueError("oneDNN linear needs fp32 or bf16 on CPU and a torch built with mkldnn")
    if not usable:
        return TorchLinear()
    rows = SMALL_ROWS.get(dtype, 0) if kind == "auto" else 0
    if rows and 0 < num_params * dtype.itemsize <= SMALL_ROWS_MAX_BYTES:
        if cpu_linear.small_rows_unavailable_reason(device, dtype) is None:
            return OneDnnLinear(cpu_linear.CLinear(split=False), rows, THREADED_ROWS)
    return OneDnnLinear()


def linear_params(layers) -> int:
    """Linear weights' values in ``layers`` (frozen dataclasses): each 2-d tensor field is one
    (workers/loader.py ``packed``)."""
    return sum(getattr(layer, f.name).numel() for layer in layers for f in dataclasses.fields(layer)
               if isinstance(getattr(layer, f.name), torch.Tensor) and getattr(layer, f.name).dim() == 2)


@functools.cache
def _onednn_works(dtype: torch.dtype = torch.float32) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((7, 24), (16, 24), (16,)))
    try:
        linear = OneDnnLinear()
        out = linear.act(x, linear.pack(w), b, "gelu")
    except RuntimeError:
        return False
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    return bool(torch.allclose(out.float(), F.gelu(F.linear(x, w, b).float()), atol=tol, rtol=tol))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen's RMSNorm: statistics in fp32, the weight applied in the input's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_theta(config: dict) -> float:
    """RoPE base from either config form (transformers 5 ``rope_parameters`` or the older
    top-level ``rope_theta`` + ``rope_scaling``); only the default (unscaled) RoPE is supported."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise UnsupportedModel(f"unsupported RoPE type {kind!r}; supported: default")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


class Rotary:
    """cos/sin tables indexed by position, built once in fp32 (as transformers does) and grown
    when a longer position shows up."""

    def __init__(self, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype,
                 num_positions: int = 512):
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        self.inv_freq = 1.0 / (theta ** exponents)
        self.dtype = dtype
        self._build(num_positions)

    def _build(self, num_positions: int) -> None:
        t = torch.arange(num_positions, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        self.cos = freqs.cos().to(self.dtype)  # [P, D/2]: both halves use the same angles
        self.sin = freqs.sin().to(self.dtype)

    def tables(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D/2]`` for the batch; computed once, used by every layer."""
        if max_position >= self.cos.shape[0]:
            self._build(max(max_position + 1, 2 * self.cos.shape[0]))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``[T, H, D]`` by position: the half-split ("rotate_half") convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
