"""How much a forward pass computes, and how much the device could: the one FLOP formula (the
worker's MFU metric, `tokq profile`'s GFLOP/s and the runtime benchmark all count with it) and
the table of device peaks. Needs neither torch (except to name a CUDA device) nor Prometheus.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import numpy as np


def linear_flops_per_token(config: Mapping) -> int:
    """Matmul FLOPs (2 per multiply-add) of one token through every layer's linear layers: the
    Q, K, V, O projections and the MLP (gated, three matrices, for Qwen; two for BERT)."""
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    head_dim = _head_dim(config)
    ffn = int(config["intermediate_size"])
    gated = config.get("model_type") in ("qwen2", "qwen3", "llama", "mistral")
    proj = hidden * head_dim * (2 * num_heads + 2 * num_kv_heads)
    mlp = hidden * ffn * (3 if gated else 2)
    return int(config["num_hidden_layers"]) * 2 * (proj + mlp)


def forward_flops(config: Mapping, seqlens: Iterable[int], prompt_lens: Iterable[int] | None = None) -> int:
    """Matmul FLOPs of one unpadded forward pass over these sequences, causal attention counted on
    the full square as torch's FlopCounterMode does. ``prompt_lens``: shared-prompt tokens per
    sequence, attended to but not computed (docs/internals.md)."""
    lens = np.asarray(list(seqlens), dtype=np.int64)
    computed = lens - (np.asarray(list(prompt_lens), dtype=np.int64) if prompt_lens is not None else 0)
    per_key = 4 * int(config["num_attention_heads"]) * _head_dim(config)
    attention = int(config["num_hidden_layers"]) * per_key * int((computed * lens).sum())
    return linear_flops_per_token(config) * int(computed.sum()) + attention


def _head_dim(config: Mapping) -> int:
    return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))


# Dense bf16/fp16 tensor-core peaks from the vendors' datasheets, FLOP/s, matched against
# torch.cuda.get_device_name(): the first matching key wins, so specific names come first.
DEVICE_PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10", 125e12),
)


def device_peak_flops(device="cpu", *, env: Mapping[str, str] | None = None) -> float | None:
    """Peak FLOP/s for MFU of ``device`` (a torch device, or a GPU's name as CUDA gives it):
    TOKQ_DEVICE_PEAK_FLOPS when set (any device), else the table
    entry for a known GPU, else None (unknown: a CPU, or a GPU not in the table)."""
    env = os.environ if env is None else env
    if env.get("TOKQ_DEVICE_PEAK_FLOPS"):
        return float(env["TOKQ_DEVICE_PEAK_FLOPS"])
    name = str(device)
    if name.startswith("cuda"):
        import torch  # only a CUDA device has a name worth asking for

        name = torch.cuda.get_device_name(torch.device(name))
    return peak_flops_for_name(name)


def peak_flops_for_name(device_name: str) -> float | None:
    for key, peak in DEVICE_PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None
