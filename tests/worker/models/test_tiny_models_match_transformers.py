"""Tiny random-weight BERT, Qwen2 and Qwen3 checkpoints (built from transformers configs, saved
to disk, one of each family also sharded or behind a head-class prefix): every pooled vector of
the packed runtime matches transformers' padded forward at the last real token / mean / CLS."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokq.batch import PackedBatch
from tokq.workers import attention
from tiny_models import CASES, SEQ_LENS, VOCAB, build
from tokq.workers.engine import Engine


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    base, pooling = build(request.param, path)
    if "sharded" in request.param:
        assert (path / "model.safetensors.index.json").is_file()
    engine = Engine.load(path, device="cpu", dtype="float32")
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
    backends = [b for b in attention.BACKENDS  # those that run here; sdpa_loop last
                if attention.unavailable_reason(b, engine.device, engine.dtype) is None]
    for backend in backends:
        other = Engine(engine.info, engine.model, engine.device, engine.dtype, backend)
        outputs[backend] = other.embed(PackedBatch.pack(seqs))
    for backend in backends[:-1]:
        np.testing.assert_allclose(outputs[backend], outputs["sdpa_loop"], atol=1e-5)


def test_torch_linear_kernels_give_the_same_embeddings(tiny):
    engine, _, _ = tiny
    plain = Engine.load(engine.info.path, device="cpu", dtype="float32", linear="torch")
    assert plain.linear_backend == "torch"
    batch = PackedBatch.pack(_sequences(seed=7))
    np.testing.assert_allclose(plain.embed(batch), engine.embed(batch), atol=1e-5)


def test_bf16_pooled_embeddings_match_transformers_fp32(tiny):
    """bf16 runs attention through the matmul path (workers/matmul_attention.py): packed rows
    of 32 and 64 slots here, causal for the Qwen models; its vectors keep fp32's meaning."""
    engine, base, pooling = tiny
    bf16 = Engine.load(engine.info.path, device="cpu", dtype="bfloat16")
    seqs = _sequences(seed=11)
    ours = bf16.embed(PackedBatch.pack(seqs, normalize=False))
    ref = _reference(base, seqs, pooling, left_pad=False)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.999, cos
