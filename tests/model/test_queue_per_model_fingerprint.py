"""Queue identity includes a fingerprint of the model's files: two models served under one name
never share a queue, and token ids outside the vocabulary never reach a model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import redis
import torch
from safetensors.torch import load_file, save_file

from tokq.redis.connection import connect
from tokq.queue.wire import decode_result, encode_body
from tokq.model.fingerprint import model_fingerprint
from tokq.gateway.errors import InvalidArgument
from tokq.gateway.validate import check_token_ids
from tokq.queue.keys import QueueKeys
from tokq.model.info import ModelInfo, first_out_of_vocab
from tokq.queue.shard import Queue


def copy_model(src, dst, perturb: bool = False):
    """A copy of the model directory; ``perturb`` changes one weight (a 'fine-tune')."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors", "README.md"))
    if perturb:
        weights = load_file(str(src / "model.safetensors"))
        name = next(n for n in weights if n.endswith("word_embeddings.weight"))
        weights[name] = weights[name].clone()
        weights[name][100] += 0.01
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    else:
        shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def two_models(bundled_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    a = copy_model(bundled_model_dir, root / "a" / "minilm")
    b = copy_model(bundled_model_dir, root / "b" / "minilm", perturb=True)
    return a, b


def test_same_folder_name_different_weights_gets_different_queues(two_models, bundled_model_dir):
    a, b = (ModelInfo.load(p) for p in two_models)
    assert a.name == b.name == "minilm"
    assert a.queue_name != b.queue_name and a.queue_name.startswith("minilm@")
    # the same files elsewhere: the same queue (a gateway and its workers agree)
    assert a.fingerprint == ModelInfo.load(bundled_model_dir).fingerprint


def test_tokenizer_or_config_changes_the_fingerprint(bundled_model_dir, tmp_path):
    model = copy_model(bundled_model_dir, tmp_path / "m")
    before = model_fingerprint(model)
    cfg = model / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace('"do_lower_case": true', '"do_lower_case": false'))
    assert model_fingerprint(model) != before
    pooling = model / "1_Pooling" / "config.json"
    pooling.write_text(pooling.read_text().replace("true", "false", 1))
    assert len({before, model_fingerprint(model)}) == 2


def test_weights_rewritten_in_place_are_rehashed_despite_the_cache(bundled_model_dir, tmp_path):
    model = copy_model(bundled_model_dir, tmp_path / "m")
    weights = model / "model.safetensors"
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before  # cached
    st = weights.stat()
    with open(weights, "r+b") as f:  # same size, one byte changed, mtime put back
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_fingerprint(model) != before


def test_token_ids_are_checked_against_the_vocabulary():
    info = ModelInfo.load()
    assert first_out_of_vocab([101, 2023, 102], info.vocab_size) is None
    assert first_out_of_vocab([101, info.vocab_size, 102], info.vocab_size) == info.vocab_size
    assert first_out_of_vocab([-1], info.vocab_size) == -1
    assert first_out_of_vocab([True], info.vocab_size) is True
    # Past int64, numpy holds them as floats (or objects): named as sent, not wrapped or rounded.
    assert first_out_of_vocab([2**63, -1], info.vocab_size) == 2**63
    assert first_out_of_vocab([5, 2**64 + 1], info.vocab_size) == 2**64 + 1
    with pytest.raises(InvalidArgument, match="input 1 has token id 30522 outside all-MiniLM-L6-v2's "
                                              r"vocabulary \(0..30521\)"):
        check_token_ids([[101, 102], [101, 30522, 102]], info)


@pytest.mark.slow
async def test_a_worker_claims_only_its_models_queue_and_refuses_ids_past_its_vocab(two_models, redis_url):
    a, b = (ModelInfo.load(p) for p in two_models)
    client = connect(redis_url)
    try:
        queue_a, queue_b = Queue(client, a.queue_name), Queue(client, b.queue_name)
        good, bad = [101, 7592, 102], [101, a.vocab_size + 5, 102]
        await queue_a.enqueue("ra", [(3, encode_body(good)), (3, encode_body(bad)), (3, encode_body(good))],
                              timeout_ms=120_000, notice_channel="c")
        await queue_b.enqueue("rb", [(3, encode_body(good))], timeout_ms=120_000, notice_channel="c")
        run = subprocess.run([sys.executable, "-m", "tokq.cli", "worker", "--model", str(two_models[0]),
                              "--burst", "--device", "cpu", "--threads", "1"],
                             env={**os.environ, "TOKQ_REDIS_URL": redis_url}, capture_output=True,
                             text=True, timeout=240)
        assert run.returncode == 0, run.stderr[-3000:]
        results = {i: decode_result(raw) for i, raw in (await queue_a.collect("ra")).items()}
        assert results[0].ok and results[2].ok and results[0].vector.shape == (384,)
        assert (results[1].ok, results[1].code) == (False, "INVALID_ARGUMENT")
        assert f"token id {a.vocab_size + 5}" in results[1].message
        # model b's entry is still queued, unclaimed
        assert (await queue_b.stats()).queued_entries == 1
        assert redis.Redis.from_url(redis_url).llen(QueueKeys(b.queue_name).pending) == 1
    finally:
        await client.aclose()
