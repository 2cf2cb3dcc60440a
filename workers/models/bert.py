"""BERT-family encoders (all-MiniLM, bge, e5, gte): absolute positions, token type 0,
post-LayerNorm layers, bidirectional attention, over the flat ``[T, hidden]`` packed batch.

Query, key and value are fused into one ``[3*hidden, hidden]`` matmul; the position and
token-type-0 tables are summed once at load, so embedding is two lookups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokq.model.info import UnsupportedModel
from tokq.workers.attention import AttendFn, cpu_varlen_attend, cpu_varlen_cu
from tokq.workers.kernels import cpu_layers
from tokq.workers.kernels.cpu_norm import CNorms, norm_kernels
from tokq.workers.layout import Layout
from tokq.workers.loader import moved, packed, take
from tokq.workers.models.layers import SMALL_ROWS, activation, linear_kernels, linear_params
from tokq.workers.preempt import no_checkpoint


@dataclass(frozen=True)
class BertLayer:
    qkv_weight: torch.Tensor  # [3*hidden, hidden]
    qkv_bias: torch.Tensor
    out_weight: torch.Tensor
    out_bias: torch.Tensor
    attn_norm_weight: torch.Tensor
    attn_norm_bias: torch.Tensor
    up_weight: torch.Tensor  # [intermediate, hidden]
    up_bias: torch.Tensor
    down_weight: torch.Tensor
    down_bias: torch.Tensor
    mlp_norm_weight: torch.Tensor
    mlp_norm_bias: torch.Tensor

    @classmethod
    def from_weights(cls, w: dict[str, torch.Tensor], prefix: str) -> BertLayer:
        def t(name: str) -> torch.Tensor:
            return take(w, prefix + name)

        qkv = ("attention.self.query", "attention.self.key", "attention.self.value")
        return cls(
            qkv_weight=torch.cat([t(f"{p}.weight") for p in qkv]),
            qkv_bias=torch.cat([t(f"{p}.bias") for p in qkv]),
            out_weight=t("attention.output.dense.weight"),
            out_bias=t("attention.output.dense.bias"),
            attn_norm_weight=t("attention.output.LayerNorm.weight"),
            attn_norm_bias=t("attention.output.LayerNorm.bias"),
            up_weight=t("intermediate.dense.weight"),
            up_bias=t("intermediate.dense.bias"),
            down_weight=t("output.dense.weight"),
            down_bias=t("output.dense.bias"),
            mlp_norm_weight=t("output.LayerNorm.weight"),
            mlp_norm_bias=t("output.LayerNorm.bias"),
        )


class Bert:
    ANCHOR = "embeddings.word_embeddings.weight"  # locates the base model inside a checkpoint
    causal = False

    def __init__(self, config: dict, weights: dict[str, torch.Tensor], linear_kind: str = "auto",
                 device: torch.device = torch.device("cpu")):
        """``weights`` on the host; fused and summed tables are built there, then moved."""
        kind = config.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise UnsupportedModel(f"unsupported BERT position_embedding_type {kind!r}; supported: absolute")
        self.hidden_size = int(config["hidden_size"])
        self.num_heads = int(config["num_attention_heads"])
        self.head_dim = self.hidden_size // self.num_heads
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.act_name = config.get("hidden_act", "gelu")
        activation(self.act_name)  # refuse an unknown activation at load
        self.word_embeddings = take(weights, "embeddings.word_embeddings.weight").to(device)
        token_types = take(weights, "embeddings.token_type_embeddings.weight")
        self.position_embeddings = (take(weights, "embeddings.position_embeddings.weight")
                                    + token_types[0]).to(device)
        # What each other segment adds over segment 0 (a cross-encoder's pairs): row 0 is zeros
        self.token_type_offsets = (token_types - token_types[0]).to(device)
        self.embed_norm_weight = take(weights, "embeddings.LayerNorm.weight").to(device)
        self.embed_norm_bias = take(weights, "embeddings.LayerNorm.bias").to(device)
        self.layers = [moved(BertLayer.from_weights(weights, f"encoder.layer.{i}."), device)
                       for i in range(int(config["num_hidden_layers"]))]
        self.linear = linear_kernels(self.word_embeddings.device, self.word_embeddings.dtype, linear_kind,
                                     num_params=linear_params(self.layers))
        self.norm = norm_kernels(self.word_embeddings.device, self.word_embeddings.dtype)
        self.layers = [packed(layer, self.linear.pack) for layer in self.layers]
        # Batches of at most fused_rows tokens on one thread run every layer in one C call
        # (workers/kernels/cpu_layers.py): the linears' C kernel, its attention and LayerNorm
        self.fused_rows, self._fused = 0, None
        dtype = self.word_embeddings.dtype
        rows = SMALL_ROWS.get(dtype, 0) if self.linear.name == "c" else getattr(self.linear, "small_rows", 0)
        if (rows and self.act_name == "gelu" and isinstance(self.norm, CNorms)
                and cpu_layers.unavailable_reason(device, dtype) is None):
            self._fused = cpu_layers.BertLayers(self.layers, self.linear.c_weight, self.num_heads, self.eps)
            self.fused_rows = rows

    @property
    def num_linear_params(self) -> int:
        return sum(layer.qkv_weight.numel() + layer.out_weight.numel() + layer.up_weight.numel()
                   + layer.down_weight.numel() for layer in self.layers)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    def forward(self, layout: Layout, attend: AttendFn,
                checkpoint: Callable[[], None] = no_checkpoint,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden state ``[T, hidden]`` of the packed batch; ``token_types``: int64 ``[T]``
        segment ids in layout order (None: all 0). ``checkpoint`` runs after each step of a layer,
        where light work may run nested (workers/preempt.py)."""
        x = F.embedding(layout.input_ids, self.word_embeddings)
        x += F.embedding(layout.positions, self.position_embeddings)
        if token_types is not None:
            x += F.embedding(token_types, self.token_type_offsets)
        x = self.norm(x, self.embed_norm_weight, self.embed_norm_bias, self.eps)
        num_tokens = x.shape[0]
        scale = self.head_dim ** -0.5
        if (num_tokens <= self.fused_rows and checkpoint is no_checkpoint and attend is cpu_varlen_attend
                and torch.get_num_threads() == 1):
            return self._fused(x, cpu_varlen_cu(layout), scale)
        linear = self.linear
        for layer in self.layers:
            qkv = linear(x, layer.qkv_weight, layer.qkv_bias).view(num_tokens, 3, self.num_heads,
                                                                   self.head_dim)
            checkpoint()
            attn = attend(qkv[:, 0], qkv[:, 1], qkv[:, 2], layout, False, scale)
            checkpoint()
            x = self.norm.linear_add_norm(linear, attn.reshape(num_tokens, self.hidden_size),
                                          layer.out_weight, layer.out_bias, x,
                                          layer.attn_norm_weight, layer.attn_norm_bias, self.eps)
            checkpoint()
            h = linear.act(x, layer.up_weight, layer.up_bias, self.act_name)
            checkpoint()
            x = self.norm.linear_add_norm(linear, h, layer.down_weight, layer.down_bias, x,
                                          layer.mlp_norm_weight, layer.mlp_norm_bias, self.eps)
            checkpoint()
        return x
