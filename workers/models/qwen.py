"""Qwen2 and Qwen3 decoders (e.g. Qwen3-Embedding): RMSNorm pre-norm layers, RoPE,
grouped-query causal attention, SwiGLU MLP; Qwen3 adds RMSNorm on each head of q and k.

q/k/v are one fused matmul and gate/up another; the RoPE cos/sin rows of the batch are
gathered once and shared by every layer. The LM head is never loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokq.model.info import UnsupportedModel
from tokq.workers.attention import AttendFn
from tokq.workers.layout import Layout
from tokq.workers.loader import moved, packed, take
from tokq.workers.models.layers import (Rotary, activation, apply_rope, linear_kernels, linear_params,
                                        rms_norm, rope_theta)
from tokq.workers.preempt import no_checkpoint


@dataclass(frozen=True)
class QwenLayer:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor  # [(Hq + 2*Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None  # Qwen2 has q/k/v biases, Qwen3 none
    q_norm: torch.Tensor | None  # Qwen3 only, [D]
    k_norm: torch.Tensor | None
    out_weight: torch.Tensor
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor  # [2*intermediate, hidden]
    down_weight: torch.Tensor

    @classmethod
    def from_weights(cls, w: dict[str, torch.Tensor], prefix: str, qk_norm: bool) -> QwenLayer:
        def t(name: str) -> torch.Tensor:
            return take(w, prefix + name)

        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        has_bias = f"{prefix}self_attn.q_proj.bias" in w
        return cls(
            input_norm=t("input_layernorm.weight"),
            qkv_weight=torch.cat([t(f"{p}.weight") for p in qkv]),
            qkv_bias=torch.cat([t(f"{p}.bias") for p in qkv]) if has_bias else None,
            q_norm=t("self_attn.q_norm.weight") if qk_norm else None,
            k_norm=t("self_attn.k_norm.weight") if qk_norm else None,
            out_weight=t("self_attn.o_proj.weight"),
            post_norm=t("post_attention_layernorm.weight"),
            gate_up_weight=torch.cat([t("mlp.gate_proj.weight"), t("mlp.up_proj.weight")]),
            down_weight=t("mlp.down_proj.weight"),
        )


class Qwen:
    ANCHOR = "embed_tokens.weight"
    causal = True

    def __init__(self, config: dict, weights: dict[str, torch.Tensor], family: str, max_length: int,
                 linear_kind: str = "auto", device: torch.device = torch.device("cpu")):
        """``weights`` on the host; fused projections are built there, then moved."""
        if config.get("use_sliding_window"):
            raise UnsupportedModel("sliding-window attention (use_sliding_window=true) is not supported")
        self.hidden_size = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(config.get("head_dim") or self.hidden_size // self.num_heads)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.act = activation(config.get("hidden_act", "silu"))
        self.embed_tokens = take(weights, "embed_tokens.weight").to(device)
        self.final_norm = take(weights, "norm.weight").to(device)
        self.layers = [moved(QwenLayer.from_weights(weights, f"layers.{i}.", qk_norm=family == "qwen3"),
                             device) for i in range(int(config["num_hidden_layers"]))]
        self.linear = linear_kernels(self.embed_tokens.device, self.embed_tokens.dtype, linear_kind,
                                     num_params=linear_params(self.layers))
        self.layers = [packed(layer, self.linear.pack) for layer in self.layers]
        self.rotary = Rotary(self.head_dim, rope_theta(config), self.embed_tokens.device,
                             self.embed_tokens.dtype, num_positions=max_length)

    @property
    def num_linear_params(self) -> int:
        return sum(layer.qkv_weight.numel() + layer.out_weight.numel() + layer.gate_up_weight.numel()
                   + layer.down_weight.numel() for layer in self.layers)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    def forward(self, layout: Layout, attend: AttendFn | None, prefix=None,
                checkpoint: Callable[[], None] = no_checkpoint) -> torch.Tensor:
        """Last hidden state ``[T, hidden]`` (after the final norm) of the packed batch. ``prefix``
        (a PrefixPass): the batch holds only the tokens after shared prompts, at their true positions,
        and attends through it. ``checkpoint`` runs after each step of a layer (workers/preempt.py)."""
        num_tokens = layout.input_ids.shape[0]
        q_size, kv_size = self.q_dim, self.num_kv_heads * self.head_dim
        cos, sin = self.rotary.tables(layout.positions, layout.max_seqlen - 1)
        scale = self.head_dim ** -0.5
        linear = self.linear
        x = F.embedding(layout.input_ids, self.embed_tokens)
        for index, layer in enumerate(self.layers):
            qkv = linear(rms_norm(x, layer.input_norm, self.eps), layer.qkv_weight, layer.qkv_bias)
            q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
            if layer.q_norm is not None:
                q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            checkpoint()
            if prefix is None:
                attn = attend(q, k, v, layout, True, scale)
            else:
                attn = prefix.attend(index, q, k, v, scale)
            checkpoint()
            x = linear.add(attn.reshape(num_tokens, q_size), layer.out_weight, None, x)
            checkpoint()
            gate, up = linear(rms_norm(x, layer.post_norm, self.eps), layer.gate_up_weight).chunk(2, -1)
            checkpoint()
            x = linear.add(self.act(gate) * up, layer.down_weight, None, x)
            checkpoint()
        return rms_norm(x, self.final_norm, self.eps)
