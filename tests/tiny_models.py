"""Tiny random-weight BERT, Qwen2 and Qwen3 checkpoints built from transformers configs and
saved to disk (no tests here): shared by the model, contract and dtype tests."""

from __future__ import annotations

import json

import torch
import transformers

VOCAB = 211
MAX_POSITIONS = 64
# lengths in no particular order, with repeats, a 1-token and a max-length sequence
SEQ_LENS = [17, 1, 5, 64, 5, 2, 33, 17, 9, 17, 3]


def randomize(model: torch.nn.Module) -> None:
    """Weights far from transformers' init (std 0.02, unit norms) so attention is sharp and
    every norm weight and bias matters."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm = "norm" in name.lower() and name.endswith("weight")
            param.copy_(1 + 0.2 * noise if is_norm else 0.15 * noise)


def _bert_config(**extra) -> transformers.BertConfig:
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=96,
                                   max_position_embeddings=MAX_POSITIONS, **extra)


def _qwen_config(family: str) -> transformers.PretrainedConfig:
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, max_position_embeddings=MAX_POSITIONS)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.Qwen3Config(head_dim=24, **common)  # head_dim != hidden/heads, as Qwen3 allows


def _write_cls_pooling(path) -> None:
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))


# name -> (model class, config factory, save kwargs, pooling)
CASES = {
    "bert": (transformers.BertModel, _bert_config, {}, "mean"),
    "bert_mlm_prefixed_sharded": (transformers.BertForMaskedLM, _bert_config, {"max_shard_size": "30KB"}, "mean"),
    "bert_cls_gelu_tanh": (transformers.BertModel, lambda: _bert_config(hidden_act="gelu_new"), {}, "cls"),
    "qwen2_causal_lm": (transformers.Qwen2ForCausalLM, lambda: _qwen_config("qwen2"), {}, "last"),
    "qwen3_model": (transformers.Qwen3Model, lambda: _qwen_config("qwen3"), {}, "last"),
    "qwen3_causal_lm_sharded": (transformers.Qwen3ForCausalLM, lambda: _qwen_config("qwen3"),
                                {"max_shard_size": "40KB"}, "last"),
}



def build(name: str, path) -> tuple[torch.nn.Module, str]:
    """Save case ``name`` to ``path``; returns (its transformers base model, pooling)."""
    model_cls, make_config, save_kwargs, pooling = CASES[name]
    torch.manual_seed(0)
    config = make_config()
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    randomize(model)
    model.save_pretrained(path, **save_kwargs)
    if pooling == "cls":
        _write_cls_pooling(path)
    base = getattr(model, "bert", None) or getattr(model, "model", None) or model
    return base, pooling
