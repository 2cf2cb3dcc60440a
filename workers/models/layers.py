"""Pieces the model files share: linear layers, activations, RMSNorm, rotary position embedding."""

from __future__ import annotations

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
    once at load (``pack``) into oneDNN's blocked layout, which it otherwise redoes every call."""

    name = "onednn"

    def __init__(self):
        self._op = torch.ops.mkldnn._linear_pointwise

    def pack(self, weight):
        return torch.ops.mkldnn._reorder_linear_weight(weight)

    def __call__(self, x, weight, bias=None):
        return self._op(x, weight, bias, "none", [], "")

    def act(self, x, weight, bias, act_name: str):
        attr, algorithm = _ONEDNN_ACTIVATIONS[act_name]
        return self._op(x, weight, bias, attr, [], algorithm)

    def add(self, x, weight, bias, residual):
        return self._op.binary(x, residual, weight, bias, "add")


def linear_kernels(device: torch.device, dtype: torch.dtype, kind: str = "auto"):
    """For fp32 on one thread of an AVX2 CPU without AVX-512, the C kernel (workers/kernels/cpu_linear.py)
    where it builds; else oneDNN for fp32 and bf16 on CPU when this torch build has it (checked against
    F.linear once per dtype); else F.linear. ``kind`` forces one: auto | c | onednn | torch."""
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
    return OneDnnLinear() if usable else TorchLinear()


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
