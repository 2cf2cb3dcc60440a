"""Pieces the model files share: activations, RMSNorm, rotary position embedding."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tokq.model_info import UnsupportedModel

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise UnsupportedModel(f"unsupported hidden_act {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


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
