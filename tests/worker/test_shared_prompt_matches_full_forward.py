"""A shared prompt computed once (workers/prompt_attention.py) gives the full forward's
embeddings: tiny random Qwen2 and Qwen3 models and a Qwen3-0.6B-shaped one (its widths, heads
and head_dim; 2 layers instead of 28 to stay affordable on CPU), mixed prompts in one batch, a
query with no prompt, cache hits across batches, and a cache that stays within its bound."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
import transformers
from tiny_models import randomize

from tokq.batch import PackedBatch
from tokq.workers.engine import Engine
from tokq.workers.prompt_cache import PromptCache

VOCAB = 211


CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, intermediate_size=96, max_position_embeddings=128),
    # Qwen3-Embedding-0.6B's shapes (hidden 1024, 16 q / 8 kv heads of 128, MLP 3072, RoPE base
    # 1e6), 2 of its 28 layers and a small vocabulary
    "qwen3_0.6b_shaped": lambda: transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072, rope_theta=1_000_000.0,
        max_position_embeddings=256),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engine(request, tmp_path_factory) -> Engine:
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    model = (transformers.Qwen2Model if request.param == "qwen2" else transformers.Qwen3Model)(config)
    if request.param != "qwen3_0.6b_shaped":  # large random weights blow up at 1024 wide
        randomize(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return Engine.load(path, device="cpu", dtype="float32")


def _ids(rng, n: int) -> np.ndarray:
    return rng.integers(1, VOCAB, size=n)


def _workload(seed: int = 0):
    """(full sequences, prefix lengths): two instructions of 20 and 7 tokens, one that shares
    the first 10 tokens of the long one, queries of 1..40 tokens, and queries with no prompt."""
    rng = np.random.default_rng(seed)
    long_prompt, short_prompt = _ids(rng, 20), _ids(rng, 7)
    prompts = [long_prompt, short_prompt, long_prompt[:10], None]
    seqs, prompt_lens = [], []
    for i, q_len in enumerate([10, 1, 3, 10, 40, 17, 2, 10, 5, 33, 10, 1, 8]):
        prompt = prompts[i % len(prompts)]
        query = _ids(rng, q_len)
        seqs.append(query if prompt is None else np.concatenate([prompt, query]))
        prompt_lens.append(0 if prompt is None else len(prompt))
    return seqs, prompt_lens


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_prefix_path_matches_the_full_forward(engine):
    seqs, prompt_lens = _workload()
    engine.prompt_cache = PromptCache(64 << 20, "test")
    full = engine.embed(PackedBatch.pack(seqs, normalize=False))
    before = engine.tokens_computed
    shared = engine.embed(PackedBatch.pack(seqs, normalize=False, prompt_lens=prompt_lens))
    assert np.abs(full).max() > 0.1
    assert _cos(shared, full).min() >= 0.9999
    np.testing.assert_allclose(shared, full, atol=2e-4, rtol=2e-4)
    # each of the three prompts computed once, every query's own tokens once
    query_tokens = sum(len(s) - p for s, p in zip(seqs, prompt_lens))
    assert engine.tokens_computed - before == query_tokens + 20 + 7 + 10
    assert len(engine.prompt_cache) == 3


def test_cache_hits_across_batches_give_the_same_vectors(engine):
    seqs, prompt_lens = _workload(seed=1)
    engine.prompt_cache = PromptCache(64 << 20, "test")
    first = engine.embed(PackedBatch.pack(seqs, prompt_lens=prompt_lens))
    hits = engine.prompt_cache.hits
    before = engine.tokens_computed
    # the same prompts again, reordered: every prefix comes from the cache
    order = np.random.default_rng(2).permutation(len(seqs))
    again = engine.embed(PackedBatch.pack([seqs[i] for i in order],
                                          prompt_lens=[prompt_lens[i] for i in order]))
    assert engine.prompt_cache.hits - hits == 3
    assert engine.tokens_computed - before == sum(len(s) - p for s, p in zip(seqs, prompt_lens))
    np.testing.assert_allclose(again, first[order], atol=1e-5)
    full = engine.embed(PackedBatch.pack(seqs))
    assert _cos(first, full).min() >= 0.9999


def test_batch_of_only_cached_prompts_and_single_token_queries(engine):
    rng = np.random.default_rng(4)
    prompt = _ids(rng, 20)
    engine.prompt_cache = PromptCache(64 << 20, "test")
    seqs = [np.concatenate([prompt, _ids(rng, 1)]) for _ in range(3)]
    engine.embed(PackedBatch.pack(seqs[:1], prompt_lens=20))  # fills the cache
    shared = engine.embed(PackedBatch.pack(seqs, prompt_lens=20))
    assert _cos(shared, engine.embed(PackedBatch.pack(seqs))).min() >= 0.9999


def test_cache_stays_within_its_bound(engine):
    rng = np.random.default_rng(5)
    layer_bytes = 2 * engine.model.num_kv_heads * engine.model.head_dim * 4  # fp32 K and V
    per_token = len(engine.model.layers) * layer_bytes
    bound = 50 * per_token  # room for two 20-token prompts, not three
    engine.prompt_cache = PromptCache(bound, "test")
    prompts = [_ids(rng, 20) for _ in range(4)]
    for prompt in prompts:
        seqs = [np.concatenate([prompt, _ids(rng, 5)]) for _ in range(2)]
        shared = engine.embed(PackedBatch.pack(seqs, prompt_lens=20))
        assert engine.prompt_cache.num_bytes <= bound
        assert _cos(shared, engine.embed(PackedBatch.pack(seqs))).min() >= 0.9999
    assert len(engine.prompt_cache) == 2
    # the least recently used left first: the last two prompts remain
    assert engine.prompt_cache.key(prompts[3]) in engine.prompt_cache
    assert engine.prompt_cache.key(prompts[2]) in engine.prompt_cache
    assert engine.prompt_cache.key(prompts[0]) not in engine.prompt_cache


def test_lru_cache_evicts_least_recently_used_and_refuses_oversized_entries():
    cache = PromptCache(3 * 64, "m")  # three 16-float (64-byte) entries
    keys = [cache.key(np.array([i])) for i in range(4)]
    for key in keys[:3]:
        cache.put(key, torch.zeros(16))
    assert cache.get(keys[0]) is not None  # 0 is now the most recently used
    cache.put(keys[3], torch.zeros(16))
    assert keys[1] not in cache and all(k in cache for k in (keys[0], keys[2], keys[3]))
    cache.put(cache.key(np.array([9])), torch.zeros(100))  # larger than the bound: not kept
    assert len(cache) == 3 and cache.num_bytes == 3 * 64
    assert cache.key(np.array([1])) != PromptCache(64, "other").key(np.array([1]))


def _reference_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """flash-attn's documented semantics in float64: sequence i's queries over its keys, GQA by
    head groups, the causal mask aligned to the bottom-right corner when k is longer than q."""
    assert q.shape[0] == int(cu_q[-1]) and k.shape[0] == int(cu_k[-1]) and causal
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i]:cu_q[i + 1]].double().transpose(0, 1)
        ks, vs = (x[cu_k[i]:cu_k[i + 1]].double().repeat_interleave(group, 1).transpose(0, 1)
                  for x in (k, v))
        nq, nk = qs.shape[1], ks.shape[1]
        assert nq <= max_q and nk <= max_k
        scores = qs @ ks.transpose(1, 2) * softmax_scale
        mask = torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq + 1)
        out[cu_q[i]:cu_q[i + 1]] = (scores.masked_fill(mask, float("-inf")).softmax(-1) @ vs
                                    ).transpose(0, 1).to(q.dtype)
    return out


def test_flash_attn_call_contract(engine, monkeypatch):
    """The CUDA path's one flash_attn_varlen_func call per layer (keys packed [prefix ; own],
    cu_seqlens_k != cu_seqlens_q), run on CPU against flash-attn's documented semantics."""
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = _reference_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    flash = Engine(engine.info, engine.model, engine.device, engine.dtype, "sdpa_packed")
    flash.attn_backend = "flash_attn"  # the prefix path's choice; the full path stays on sdpa
    flash.prompt_cache = PromptCache(64 << 20, "test")
    seqs, prompt_lens = _workload(seed=6)
    full = engine.embed(PackedBatch.pack(seqs))
    for _ in range(2):  # computed in the batch, then from the cache
        shared = flash.embed(PackedBatch.pack(seqs, prompt_lens=prompt_lens))
        assert _cos(shared, full).min() >= 0.9999


def test_encoders_never_take_the_prefix_path(bundled_model_dir):
    bert = Engine.load(bundled_model_dir, device="cpu", dtype="float32")
    assert bert.prompt_cache is None  # bidirectional: a prompt token sees the query after it
    seqs = [np.array([101, 7592, 2088, 102]), np.array([101, 7592, 102])]
    np.testing.assert_allclose(bert.embed(PackedBatch.pack(seqs, prompt_lens=2)),
                               bert.embed(PackedBatch.pack(seqs)), atol=1e-6)


def test_prefix_must_leave_a_token():
    with pytest.raises(ValueError, match="at least one token"):
        PackedBatch.pack([[1, 2, 3]], prompt_lens=3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "sdpa_packed"])
def test_cuda_prefix_path_matches_the_full_forward_in_bf16(engine, backend):
    """On the GPU: flash-attn's real varlen call with cu_seqlens_k (bottom-right causal), and the
    masked-SDPA path the other backends take; bf16, so a looser bound than fp32's."""
    from tokq.workers import attention

    reason = attention.unavailable_reason(backend, torch.device("cuda"), torch.bfloat16)
    if reason:
        pytest.skip(reason)
    gpu = Engine.load(engine.info.path, device="cuda", dtype="bfloat16", attn_backend=backend)
    seqs, prompt_lens = _workload(seed=8)
    full = engine.embed(PackedBatch.pack(seqs))  # fp32 CPU reference
    for _ in range(2):  # computed in the batch, then from the cache
        shared = gpu.embed(PackedBatch.pack(seqs, prompt_lens=prompt_lens))
        assert _cos(shared, full).min() >= 0.99


def test_cache_size_is_a_worker_setting(engine):
    from click.testing import CliRunner

    from tokq import config as cfg
    from tokq.workers.cli import worker_command

    assert cfg.load(cfg.WorkerConfig, env={"TOKQ_PROMPT_CACHE_MB": "8"}).prompt_cache_mb == 8
    assert cfg.load(cfg.WorkerConfig, env={}).prompt_cache_mb == 256
    assert "--prompt-cache-mb" in CliRunner().invoke(worker_command, ["--help"]).output
    small = Engine(engine.info, engine.model, engine.device, engine.dtype, engine.attn_backend,
                   prompt_cache_bytes=8 << 20)
    assert small.prompt_cache.max_bytes == 8 << 20
