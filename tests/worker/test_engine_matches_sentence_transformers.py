"""The Engine on the bundled all-MiniLM-L6-v2 against sentence-transformers, plus the batch
edge cases the worker relies on (one sequence, one token, max length, Matryoshka dimensions,
raw vectors) and the errors a wrong model directory gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tokq.batch import PackedBatch
from tokq.model.info import UnsupportedModel
from tokq.workers import attention
from tokq.workers.engine import Engine

TEXTS = [
    "hello world",
    "a",
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "Redis lists keep queue entries in arrival order.",
    "hello world",
    "token budgets decide how many inputs share one forward pass",
    "x",
    "embedding models map text to vectors; similar meanings land close together",
]
LONG_TEXT = " ".join(["tokens and batches and queues"] * 120)  # far past the 256-token limit


@pytest.fixture(scope="module")
def st_model(bundled_model_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(bundled_model_dir), device="cpu")


@pytest.fixture(scope="module")
def engine():
    return Engine.load(device="cpu", dtype="float32")


def _ids(st_model, texts: list[str]) -> list[list[int]]:
    enc = st_model.tokenizer(texts, truncation=True, max_length=st_model.max_seq_length)
    return enc["input_ids"]


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_defaults_are_bundled_model_on_cpu(engine):
    assert engine.info.name == "all-MiniLM-L6-v2"
    assert engine.device == torch.device("cpu") and engine.dtype == torch.float32
    assert engine.attn_backend == attention.choose_backend("auto", engine.device, engine.dtype)
    assert engine.attn_backend in ("cpu_varlen", "sdpa_packed")  # the C kernel where it builds
    from tokq.workers.kernels import cpu_linear

    assert engine.linear_backend == ("c" if cpu_linear.preferred() else "onednn")  # fp32 on this CPU
    assert engine.info.pooling == "mean" and engine.info.max_length == 256


def test_packed_batch_matches_sentence_transformers(engine, st_model):
    texts = TEXTS + [LONG_TEXT]
    ref = st_model.encode(texts, convert_to_numpy=True)
    ids = _ids(st_model, texts)
    assert len(ids[-1]) == engine.info.max_length  # the long text is a max-length sequence
    ours = engine.embed(PackedBatch.pack(ids))
    assert ours.shape == (len(texts), 384) and ours.dtype == np.float32
    assert _cosine(ours, ref).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_embedding_in_batch_equals_alone(engine, st_model):
    ids = _ids(st_model, TEXTS + [LONG_TEXT])
    together = engine.embed(PackedBatch.pack(ids))
    for row, seq in enumerate(ids):
        np.testing.assert_allclose(together[row], engine.embed(PackedBatch.pack([seq]))[0], atol=1e-5)


def test_batch_of_one_and_one_token_sequences(engine, st_model):
    one_word = _ids(st_model, ["x"])[0]
    assert len(one_word) == 3  # [CLS] x [SEP]: one token after specials
    single = engine.embed(PackedBatch.pack([one_word]))
    ref = st_model.encode(["x"], convert_to_numpy=True)
    assert single.shape == (1, 384) and _cosine(single, ref)[0] >= 0.9999
    bare = engine.embed(PackedBatch.pack([[101], one_word, [2003]]))  # literally one token
    assert np.isfinite(bare).all()
    np.testing.assert_allclose(np.linalg.norm(bare, axis=1), 1.0, atol=1e-5)


def test_dimensions_truncate_then_renormalize(engine, st_model):
    ids = _ids(st_model, TEXTS[:4])
    full = engine.embed(PackedBatch.pack(ids))
    dims = [0, 64, 128, 384]
    cut = engine.embed(PackedBatch.pack(ids, dimensions=dims))
    for row, d in enumerate(dims):
        d = d or 384
        assert not cut[row, d:].any()
        expected = full[row, :d] / np.linalg.norm(full[row, :d])
        np.testing.assert_allclose(cut[row, :d], expected, atol=1e-5)


def test_normalize_false_returns_the_raw_pooled_vector(engine, st_model):
    ids = _ids(st_model, TEXTS[:3])
    raw = engine.embed(PackedBatch.pack(ids, normalize=[False, True, False]))
    unit = engine.embed(PackedBatch.pack(ids))
    norms = np.linalg.norm(raw, axis=1)
    assert abs(norms[1] - 1) < 1e-5 and (np.abs(norms[[0, 2]] - 1) > 0.1).all()
    np.testing.assert_allclose(raw / norms[:, None], unit, atol=1e-5)
    # raw and truncated: the first d raw values, not renormalized
    raw_cut = engine.embed(PackedBatch.pack(ids, normalize=False, dimensions=32))
    np.testing.assert_allclose(raw_cut[0, :32], raw[0, :32], atol=1e-5)
    assert not raw_cut[:, 32:].any()


def test_sequence_past_max_length_is_refused(engine):
    with pytest.raises(ValueError, match="max length 256"):
        engine.embed(PackedBatch.pack([np.full(257, 1000)]))


def test_warmup_runs_a_full_budget_batch(engine, monkeypatch):
    batches = []
    embed = engine.embed
    monkeypatch.setattr(engine, "embed", lambda batch: batches.append(batch) or embed(batch))
    before = engine.tokens_computed
    engine.warmup(600)
    assert engine.info.max_length == 256
    # one batch of the whole budget: max-length sequences, then the remainder
    assert [b.seqlens.tolist() for b in batches] == [[256, 256, 88]]
    assert engine.tokens_computed - before == 600


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["T5EncoderModel"],
                                                      "model_type": "t5", "hidden_size": 8}))
    with pytest.raises(UnsupportedModel, match="BertModel.*Qwen3Model|Qwen3Model.*BertModel"):
        Engine.load(tmp_path, device="cpu")


def test_relative_position_bert_is_refused(tmp_path, bundled_model_dir):
    config = json.loads((bundled_model_dir / "config.json").read_text())
    config["position_embedding_type"] = "relative_key"
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(bundled_model_dir / "model.safetensors")
    with pytest.raises(UnsupportedModel, match="supported: absolute"):
        Engine.load(tmp_path, device="cpu")


def test_directory_without_safetensors_says_so(tmp_path, bundled_model_dir):
    (tmp_path / "config.json").write_text((bundled_model_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Engine.load(tmp_path, device="cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_defaults_match_cpu_fp32(engine, st_model):
    gpu = Engine.load()
    assert gpu.device.type == "cuda"
    if torch.cuda.get_device_capability() >= (8, 0):  # native bf16; flash kernels need sm80+
        assert gpu.dtype == torch.bfloat16
        assert gpu.attn_backend in ("flash_attn", "torch_varlen")
    ids = _ids(st_model, TEXTS + [LONG_TEXT])
    gpu.warmup(2048)
    assert _cosine(gpu.embed(PackedBatch.pack(ids)), engine.embed(PackedBatch.pack(ids))).min() > 0.99
