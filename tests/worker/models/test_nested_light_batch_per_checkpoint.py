"""A light batch nested at any checkpoint of a heavy forward (workers/preempt.py) leaves both
batches' vectors as if each ran alone: tiny random BERT, Qwen2 and Qwen3 models, the light
batch offered at each of the forward's checkpoints in turn (after qkv, attention, out-proj, MLP
up and MLP down of every layer), and for the decoders also through the shared-prompt path
(workers/prompt_attention.py), with the light batch behind the same new prompt."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tiny_models import VOCAB, build

from tokq.batch import PackedBatch
from tokq.workers import preempt
from tokq.workers.engine import Engine
from tokq.workers.preempt import Preemption
from tokq.workers.prompt_cache import PromptCache

STEPS_PER_LAYER = 5  # qkv, attention, out-proj, MLP up, MLP down


@pytest.fixture(scope="module", params=["bert", "qwen2_causal_lm", "qwen3_model"])
def engine(request, tmp_path_factory) -> Engine:
    path = tmp_path_factory.mktemp(request.param)
    build(request.param, path)
    return Engine.load(path, device="cpu", dtype="float32")


def _sequences(prompted: bool) -> tuple[list, list, int]:
    """(heavy sequences, light sequences, prompt length: 0 for none)."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, VOCAB, 12) if prompted else np.zeros(0, dtype=np.int64)
    heavy = [np.concatenate([prompt, rng.integers(1, VOCAB, n)]) for n in (40, 7, 30, 1, 19)]
    light = [np.concatenate([prompt, rng.integers(1, VOCAB, 3)])]
    return heavy, light, len(prompt)


def _checkpoints(engine: Engine, batch: PackedBatch, monkeypatch, at: int | None = None,
                 light: PackedBatch | None = None) -> tuple[int, np.ndarray, np.ndarray | None]:
    """Run ``batch`` as a heavy forward; ``light`` offered just before checkpoint ``at``
    (1-based) and run there. Returns (checkpoints the forward called, heavy vectors, light
    vectors)."""
    loop = asyncio.new_event_loop()
    slot = Preemption(engine.embed)
    calls, offered = 0, []

    def counting() -> None:
        nonlocal calls
        calls += 1
        if calls == at:
            offered.append(slot.offer(light, loop))
            assert offered[0] is not None  # armed: the heavy forward runs
        slot.checkpoint()
        if calls == at:
            assert slot.waiting is None  # run at this checkpoint, not after the forward

    monkeypatch.setattr(preempt, "current_checkpoint", lambda: counting)
    try:
        heavy = slot.heavy(lambda: engine.embed(batch))
        nested = loop.run_until_complete(asyncio.wait_for(offered[0], 10)) if offered else None
    finally:
        monkeypatch.undo()
        loop.close()
    return calls, heavy, nested


@pytest.mark.parametrize("prompted", [False, True], ids=["plain", "shared_prompt"])
def test_a_light_batch_nested_at_any_checkpoint_leaves_both_as_if_run_alone(engine, prompted, monkeypatch):
    if prompted and engine.prompt_cache is None:
        pytest.skip("encoders never take the shared-prompt path")
    heavy_seqs, light_seqs, prompt_len = _sequences(prompted)
    heavy_batch = PackedBatch.pack(heavy_seqs, prompt_lens=prompt_len)
    light_batch = PackedBatch.pack(light_seqs, prompt_lens=prompt_len)
    num_layers = len(engine.model.layers)
    calls, _, _ = _checkpoints(engine, heavy_batch, monkeypatch)
    assert calls == STEPS_PER_LAYER * num_layers  # a checkpoint after every step of every layer
    alone_heavy = engine.embed(PackedBatch.pack(heavy_seqs))  # each alone, the full forward
    alone_light = engine.embed(PackedBatch.pack(light_seqs))
    for at in range(1, calls + 1):
        if engine.prompt_cache is not None:  # the prompt new to both batches each time
            engine.prompt_cache = PromptCache(engine.prompt_cache.max_bytes, engine.prompt_cache.fingerprint)
        _, heavy, light = _checkpoints(engine, heavy_batch, monkeypatch, at=at, light=light_batch)
        np.testing.assert_allclose(heavy, alone_heavy, atol=2e-5, err_msg=f"heavy, light nested at {at}")
        np.testing.assert_allclose(light, alone_light, atol=2e-5, err_msg=f"light, nested at {at}")
    if prompted:
        assert len(engine.prompt_cache) == 1  # both stored the one prompt; the cache holds it once
