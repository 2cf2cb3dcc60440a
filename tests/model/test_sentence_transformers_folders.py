"""sentence-transformers model folders as ModelInfo.load reads them: what tokq serves matches
sentence-transformers' vectors, and what it cannot compute is refused in one line at load."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from prompted_model import TEXTS as QWEN_TEXTS
from prompted_model import build_prompted_qwen3
from tokq.batch import PackedBatch
from tokq.gateway.tokenize import Tokenizer
from tokq.model.info import ModelInfo, UnsupportedModel
from tokq.workers.engine import Engine

TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
MIXED_CASE = ["Hello World", "The Quick Brown FOX jumps over the Lazy Dog", "iPhone vs. ANDROID",
              "Zoë's CAFÉ in München"]  # the last one not ASCII: the tokenizer's own path
# Well past 256 and 512 tokens: truncation at the model's length decides the vector.
LONG = "Tokens, batches and queues: a Redis-backed embedding service for sentences. " * 60


def _copy_model(src, dst, skip=()):
    """``src`` copied to ``dst`` minus ``skip``; weights linked, not copied."""
    dst.mkdir()
    for item in src.iterdir():
        if item.name in skip or item.name == "README.md":
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name)
        elif item.suffix == ".safetensors":
            (dst / item.name).symlink_to(item.resolve())
        else:
            shutil.copy(item, dst / item.name)
    return dst


def _edit_json(path, **changes):
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


def _tokq_vectors(path, texts, prompt_name=None):
    engine = Engine.load(path, device="cpu", dtype="float32")
    tok = Tokenizer(engine.info, threads=1)
    try:
        ids = tok.encode_sync(texts, prompt=engine.info.prompt(prompt_name), truncate=True)
    finally:
        tok.close()
    return engine.embed(PackedBatch.pack(ids, normalize=engine.info.normalize))


def _assert_matches_st(path, texts, prompt_name=None):
    ours = _tokq_vectors(path, texts, prompt_name)
    theirs = SentenceTransformer(str(path), device="cpu").encode(texts, prompt_name=prompt_name)
    cos = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(theirs, axis=1), rtol=1e-3)


@pytest.fixture(scope="module")
def st6_saved(bundled_model_dir, tmp_path_factory):
    """The bundled MiniLM as sentence-transformers 6 saves it: pooling_mode "mean", and the
    max length (256) in tokenizer_config.json, not sentence_bert_config.json."""
    path = tmp_path_factory.mktemp("st6") / "minilm"
    SentenceTransformer(str(bundled_model_dir), device="cpu").save(str(path))
    return path


def test_a_model_saved_by_sentence_transformers_6_loads_and_matches_it(st6_saved):
    pooling_cfg = json.loads((st6_saved / "1_Pooling" / "config.json").read_text())
    assert pooling_cfg.get("pooling_mode") == "mean"  # the format this test is about
    assert "max_seq_length" not in json.loads((st6_saved / "sentence_bert_config.json").read_text())
    info = ModelInfo.load(st6_saved)
    assert (info.pooling, info.normalize, info.max_length) == ("mean", True, 256)
    _assert_matches_st(st6_saved, MIXED_CASE + [LONG])


def test_without_max_seq_length_the_tokenizer_model_max_length_applies(bundled_model_dir, tmp_path):
    path = _copy_model(bundled_model_dir, tmp_path / "m", skip={"sentence_bert_config.json"})
    _edit_json(path / "tokenizer_config.json", model_max_length=100)
    assert ModelInfo.load(path).max_length == 100
    _assert_matches_st(path, [LONG, "short"])
    # none in tokenizer_config.json either: max_position_embeddings (512), as sentence-transformers
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    del tok_cfg["model_max_length"]
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    assert ModelInfo.load(path).max_length == 512
    # larger than the model reads: capped at max_position_embeddings
    _edit_json(path / "tokenizer_config.json", model_max_length=10**30)
    assert ModelInfo.load(path).max_length == 512


@pytest.mark.parametrize("mode, pooling", [
    ("cls", "cls"), ("mean", "mean"), ("lasttoken", "last"), (["mean"], "mean")])
def test_pooling_mode_names_map_to_tokq_poolings(bundled_model_dir, tmp_path, mode, pooling):
    path = _copy_model(bundled_model_dir, tmp_path / "m")
    pooling_cfg = {"embedding_dimension": 384, "pooling_mode": mode}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_cfg))
    assert ModelInfo.load(path).pooling == pooling


@pytest.mark.parametrize("config, message", [
    ({"pooling_mode": "max"}, "unsupported pooling 'max'"),
    ({"pooling_mode": "weightedmean"}, "unsupported pooling 'weightedmean'"),
    ({"pooling_mode": "mean_sqrt_len_tokens"}, "unsupported pooling 'mean_sqrt_len_tokens'"),
    ({"pooling_mode": ["cls", "mean"]}, "one mode only"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "one mode only"),
    ({"pooling_mode_max_tokens": True}, "unsupported pooling 'max'"),
])
def test_poolings_tokq_does_not_compute_are_refused_in_one_line(bundled_model_dir, tmp_path, config,
                                                                 message):
    path = _copy_model(bundled_model_dir, tmp_path / "m")
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 384, **config}))
    with pytest.raises(UnsupportedModel, match=message) as err:
        ModelInfo.load(path)
    assert "\n" not in str(err.value)


def test_a_dense_module_is_refused_naming_it(bundled_model_dir, tmp_path):
    path = _copy_model(bundled_model_dir, tmp_path / "m")
    modules = json.loads((path / "modules.json").read_text())
    dense = {"idx": 2, "name": "2", "path": "2_Dense",
             "type": "sentence_transformers.models.Dense"}
    (path / "modules.json").write_text(json.dumps(modules[:2] + [dense] + modules[2:]))
    with pytest.raises(UnsupportedModel, match=r"module 'sentence_transformers\.models\.Dense'"):
        ModelInfo.load(path)


def test_a_pooling_config_with_no_mode_on_is_mean_as_in_sentence_transformers(bundled_model_dir, tmp_path):
    path = _copy_model(bundled_model_dir, tmp_path / "m")
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 384, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False}))
    assert ModelInfo.load(path).pooling == "mean"
    _assert_matches_st(path, ["hello world", "a second text"])


def test_a_missing_pooling_config_is_named(bundled_model_dir, tmp_path):
    path = _copy_model(bundled_model_dir, tmp_path / "m")
    (path / "1_Pooling" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"1_Pooling/config\.json is missing"):
        ModelInfo.load(path)


def test_a_model_without_tokenizer_files_is_refused_by_the_gateway(bundled_model_dir, tmp_path):
    path = _copy_model(bundled_model_dir, tmp_path / "m", skip=set(TOKENIZER))
    info = ModelInfo.load(path)  # a worker runs it from token ids alone
    with pytest.raises(FileNotFoundError, match="no tokenizer files") as err:
        info.require_tokenizer()
    assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        Tokenizer(info, threads=1)
    assert ModelInfo.load(bundled_model_dir).require_tokenizer().path == bundled_model_dir
    # tokq gateway says so in one line before it starts anything (no Redis at that URL is asked)
    run = subprocess.run([sys.executable, "-m", "tokq.cli", "gateway", "--model", str(path), "--port", "0",
                          "--http-port", "0", "--redis-url", "redis://127.0.0.1:1/0"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "no tokenizer files" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_default_prompt_name_not_among_the_prompts_is_refused(bundled_model_dir, tmp_path):
    path = _copy_model(bundled_model_dir, tmp_path / "m")
    _edit_json(path / "config_sentence_transformers.json", prompts={"query": "q: "},
               default_prompt_name="search")
    with pytest.raises(UnsupportedModel, match="default_prompt_name 'search'.*query"):
        ModelInfo.load(path)
    _edit_json(path / "config_sentence_transformers.json", default_prompt_name="query")
    assert ModelInfo.load(path).prompt(None) == "q: "


def test_include_prompt_false_is_refused_where_it_changes_the_vector(bundled_model_dir, tmp_path):
    path = _copy_model(bundled_model_dir, tmp_path / "m")
    _edit_json(path / "1_Pooling" / "config.json", include_prompt=False)
    ModelInfo.load(path)  # no prompt: nothing to leave out
    _edit_json(path / "config_sentence_transformers.json", prompts={"query": "query: ", "document": ""})
    refused = r"include_prompt=false with mean pooling and prompts \(query\)"
    with pytest.raises(UnsupportedModel, match=refused):
        ModelInfo.load(path)


def test_include_prompt_false_with_last_token_pooling_matches_sentence_transformers(tmp_path):
    """The last token is the text's own whether or not the prompt is pooled: served as is."""
    build_prompted_qwen3(tmp_path)
    _edit_json(tmp_path / "tokenizer_config.json", pad_token="<|endoftext|>")  # sentence-transformers pads
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"embedding_dimension": 64, "pooling_mode": "lasttoken", "include_prompt": False}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    assert ModelInfo.load(tmp_path).pooling == "last"
    _assert_matches_st(tmp_path, QWEN_TEXTS, prompt_name="query")


@pytest.fixture(scope="module")
def cased_do_lower_case(bundled_model_dir, tmp_path_factory):
    """MiniLM with its tokenizer made cased, and do_lower_case=true in sentence_bert_config.json:
    sentence-transformers lowercases the text in front of the tokenizer."""
    path = _copy_model(bundled_model_dir, tmp_path_factory.mktemp("lower") / "m")
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["normalizer"]["lowercase"] = False
    (path / "tokenizer.json").write_text(json.dumps(spec))
    _edit_json(path / "tokenizer_config.json", do_lower_case=False)
    _edit_json(path / "sentence_bert_config.json", do_lower_case=True)
    return path


def test_do_lower_case_lowercases_as_sentence_transformers_does(cased_do_lower_case):
    st = SentenceTransformer(str(cased_do_lower_case), device="cpu")
    expected = [list(ids[mask.bool()]) for ids, mask in
                zip(*(lambda f: (f["input_ids"], f["attention_mask"]))(st.tokenize(MIXED_CASE)))]
    tok = Tokenizer(ModelInfo.load(cased_do_lower_case), threads=1)
    try:
        assert tok.encode_sync(MIXED_CASE) == expected
        assert asyncio.run(tok.encode(MIXED_CASE[:3])) == expected[:3]  # on the loop, ASCII path
        assert tok._ascii.encode(MIXED_CASE[0]) == expected[0]
    finally:
        tok.close()
    _assert_matches_st(cased_do_lower_case, MIXED_CASE)


@pytest.mark.slow
def test_vectors_are_unit_length_by_default_also_for_a_model_without_normalize(bundled_model_dir, tmp_path):
    """README: unit length unless a call sends normalize=false, as TEI and OpenAI, whatever the
    model's modules; normalize=false gives the model's own (sentence-transformers') vectors."""
    from service_stack import ServiceStack

    from tokq import Client

    path = _copy_model(bundled_model_dir, tmp_path / "no-normalize")
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps([m for m in modules if not m["type"].endswith("Normalize")]))
    texts = ["red running shoes", "a second, longer text about queues and batches"]
    raw = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True)
    assert np.all(np.abs(np.linalg.norm(raw, axis=1) - 1) > 0.1)  # the model itself does not normalize
    stack = ServiceStack(model=str(path))
    try:
        stack.start_gateway()
        stack.start_worker("w1")
        stack.wait_ready()
        with Client(stack.target) as client:
            default = client.embed(texts, timeout=60)
            unnormalized = client.embed(texts, normalize=False, timeout=60)
    finally:
        stack.close()
    assert np.allclose(np.linalg.norm(default, axis=1), 1, atol=1e-4)
    assert np.allclose(unnormalized, raw, atol=1e-3 * np.abs(raw).max())
