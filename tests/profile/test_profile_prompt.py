"""`tokq profile` on a model with a default prompt measures the budget as the queue counts it:
every query behind the prompt, the prompt computed once and cached, batch sizes in the tokens
after it; FLOPs leave out what a cached prompt saves."""

from __future__ import annotations

import numpy as np
import pytest
from prompted_model import INSTRUCT, build_prompted_qwen3

from tokq.batch import PackedBatch
from tokq.model.flops import forward_flops
from tokq.profiling import workload
from tokq.profiling.profile.sweep import SweepConfig
from tokq.profiling.profile.batches import BatchMaker, shared_prompt_ids, token_ids_for
from tokq.profiling.profile.run import run_profile
from tokq.workers.engine import Engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_default_prompt")
    build_prompted_qwen3(path, default_prompt_name="query")
    return Engine.load(path, device="cpu", dtype="float32")


def test_batches_put_every_query_behind_the_prompt_and_count_the_rest(engine):
    from transformers import AutoTokenizer

    token_ids = token_ids_for(engine.info, seed=0)
    prompt = shared_prompt_ids(engine, token_ids)
    tok = AutoTokenizer.from_pretrained(str(engine.info.path))
    assert prompt.tolist() == tok(INSTRUCT, add_special_tokens=False)["input_ids"]
    make = BatchMaker(workload.generate(300), token_ids, engine.info.max_length, prompt_ids=prompt,
                      lead=len(token_ids.prefix))
    for total in (64, 181, 1000):
        batch = make(total)
        assert batch.num_queued_tokens == total
        assert (batch.prompt_lens == prompt.size).all()
        for start in batch.cu_seqlens[:-1]:
            assert batch.input_ids[start:start + prompt.size].tolist() == prompt.tolist()
    # what the prefix path computes is what the queue counted: the prompt is already cached
    engine.embed(batch)
    before = engine.tokens_computed
    engine.embed(batch)
    assert engine.tokens_computed - before == batch.num_queued_tokens


def test_profile_reports_the_prompt_and_sizes_in_queued_tokens(engine):
    config = SweepConfig(min_tokens=64, max_tokens=128, points_per_doubling=1, warmup_runs=1,
                         min_repeats=1, max_repeats=1, target_s_per_point=0.0)
    report = run_profile(engine, workload.generate(200), config)
    assert report["prompt"]["name"] == "query" and report["prompt"]["tokens"] > 5
    assert [p["num_tokens"] for p in report["points"]] == [64, 128]
    assert "default prompt 'query'" in report["summary"]


def test_batch_flops_leave_out_a_cached_prompt(engine):
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 300, 20)
    queries = [rng.integers(1, 300, n) for n in (3, 10, 40)]
    full = PackedBatch.pack([np.concatenate([prompt, q]) for q in queries])
    shared = PackedBatch.pack([np.concatenate([prompt, q]) for q in queries], prompt_lens=20)
    model = engine.model
    cross = 4 * len(model.layers) * model.q_dim * sum(20 * len(q) for q in queries)
    assert engine.batch_flops(shared) == forward_flops(engine.info.config, [len(q) for q in queries]) + cross
    assert engine.batch_flops(shared) < engine.batch_flops(full)
