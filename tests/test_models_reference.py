"""Tiny random-weight BERT, Qwen2 and Qwen3 checkpoints (built from transformers configs, saved
to disk, one of each family also sharded or behind a head-class prefix): every pooled vector of
the packed runtime matches transformers' padded forward at the last real token / mean / CLS."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from tokq.batch import PackedBatch
from tokq.workers.engine import Engine

VOCAB = 211
MAX_POSITIONS = 64
# lengths in no particular order, with repeats, a 1-token and a max-length sequence
SEQ_LENS = [17, 1, 5, 64, 5, 2, 33, 17, 9, 17, 3]


def _randomize(model: torch.nn.Module) -> None:
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


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    model_cls, make_config, save_kwargs, pooling = CASES[request.param]
    torch.manual_seed(0)
    config = make_config()
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    _randomize(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, **save_kwargs)
    if "sharded" in request.param:
        assert (path / "model.safetensors.index.json").is_file()
    if pooling == "cls":
        _write_cls_pooling(path)
    base = getattr(model, "bert", None) or getattr(model, "model", None) or model
    engine = Engine.load(path, device="cpu")
    assert engine.info.pooling == pooling
    return engine, base, pooling


def _sequences(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=n) for n in SEQ_LENS]


def _reference(base: torch.nn.Module, seqs: list[np.ndarray], pooling: str, left_pad: bool) -> np.ndarray:
    """transformers on a padded batch with an attention mask, pooled over real tokens only."""
    max_len = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), max_len, dtype=torch.long)
    mask = torch.zeros(len(seqs), max_len, dtype=torch.long)
    for row, seq in enumerate(seqs):
        cols = slice(max_len - len(seq), max_len) if left_pad else slice(0, len(seq))
        ids[row, cols] = torch.from_numpy(seq)
        mask[row, cols] = 1
    # real tokens at positions 0..len-1 whichever side the padding is on
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden = base(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    if pooling == "mean":
        return ((hidden * mask.unsqueeze(2)).sum(1) / mask.sum(1, keepdim=True)).numpy()
    if pooling == "cls":
        first = max_len - mask.sum(1) if left_pad else torch.zeros(len(seqs), dtype=torch.long)
        return hidden[torch.arange(len(seqs)), first].numpy()
    last = torch.full((len(seqs),), max_len - 1) if left_pad else mask.sum(1) - 1
    return hidden[torch.arange(len(seqs)), last].numpy()


@pytest.mark.parametrize("left_pad", [False, True], ids=["right_padded_ref", "left_padded_ref"])
def test_pooled_embeddings_match_transformers(tiny, left_pad):
    engine, base, pooling = tiny
    seqs = _sequences()
    ours = engine.embed(PackedBatch.pack(seqs, normalize=False))
    ref = _reference(base, seqs, pooling, left_pad)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    assert np.abs(ref).max() > 0.1  # the comparison is not between near-zero vectors


def test_embedding_in_batch_equals_alone(tiny):
    engine, _, _ = tiny
    seqs = _sequences(seed=3)
    together = engine.embed(PackedBatch.pack(seqs))
    for row, seq in enumerate(seqs):
        alone = engine.embed(PackedBatch.pack([seq]))
        np.testing.assert_allclose(together[row], alone[0], atol=1e-5)


def test_every_cpu_backend_gives_the_same_embeddings(tiny):
    engine, _, _ = tiny
    seqs = _sequences(seed=5)
    outputs = {}
    for backend in ("sdpa_packed", "sdpa_grouped", "sdpa_loop"):
        other = Engine(engine.info, engine.model, engine.device, engine.dtype, backend)
        outputs[backend] = other.embed(PackedBatch.pack(seqs))
    for backend in ("sdpa_packed", "sdpa_grouped"):
        np.testing.assert_allclose(outputs[backend], outputs["sdpa_loop"], atol=1e-5)


def test_torch_linear_kernels_give_the_same_embeddings(tiny):
    engine, _, _ = tiny
    plain = Engine.load(engine.info.path, device="cpu", linear="torch")
    assert plain.linear_backend == "torch"
    batch = PackedBatch.pack(_sequences(seed=7))
    np.testing.assert_allclose(plain.embed(batch), engine.embed(batch), atol=1e-5)
