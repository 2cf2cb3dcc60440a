"""Rerankers score exactly as sentence-transformers 6's CrossEncoder scores the same folder: the
task decided as sentence-transformers decides it, pairs tokenized as the model's tokenizer (or chat
template) pairs them, the head, then the activation; raw logits on request. Tiny random-weight
folders built here (tiny_rerankers.py); CrossEncoder(folder).predict is the reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_rerankers import (DOCUMENTS, LONG_DOCUMENT, QUERY, build_bert_cross_encoder,
                            build_qwen3_causal_reranker, build_qwen3_seq_cls,
                            save_with_sentence_transformers)

from tokq.batch import PackedBatch
from tokq.gateway.errors import InvalidArgument
from tokq.gateway.prompt_boundary import shared_prompt_len
from tokq.gateway.tokenize import Tokenizer
from tokq.model.info import ModelInfo, UnsupportedModel
from tokq.workers.engine import Engine

IDENTITY = "torch.nn.modules.linear.Identity"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerankers")
    bert = build_bert_cross_encoder(root / "bert")
    causal = build_qwen3_causal_reranker(root / "causal")
    return {
        "bert": bert,  # no activation in its config: sigmoid (one label)
        "bert_identity": build_bert_cross_encoder(root / "bert_identity", activation=IDENTITY),
        "bert_st": save_with_sentence_transformers(bert, root / "bert_st"),
        "qwen3_causal": causal,
        "qwen3_causal_tied": build_qwen3_causal_reranker(root / "causal_tied", tied=True),
        "qwen3_seq_cls": build_qwen3_seq_cls(root / "seq_cls"),
        "qwen3_plain_causal_lm": causal.parent / "plain",
    }


@pytest.fixture(scope="module")
def cross_encoders(folders):
    from sentence_transformers import CrossEncoder

    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = CrossEncoder(str(folders[kind]), device="cpu")
        return cache[kind]
    return get


RERANKERS = ["bert", "bert_identity", "bert_st", "qwen3_causal", "qwen3_causal_tied", "qwen3_seq_cls"]


def test_task_decided_as_sentence_transformers(folders, bundled_model_dir):
    assert ModelInfo.load(bundled_model_dir).task == "embed"
    bert = ModelInfo.load(folders["bert"])
    assert (bert.task, bert.family, bert.pooling, bert.normalize) == ("rerank", "bert", "cls", False)
    assert (bert.scoring.head, bert.scoring.activation, bert.scoring.pair_format) == ("classifier", "sigmoid", "text")
    assert ModelInfo.load(folders["bert_identity"]).scoring.activation == "identity"
    st = ModelInfo.load(folders["bert_st"])  # modules.json, model_type CrossEncoder, activation_fn saved
    assert (st.task, st.scoring.head, st.scoring.activation) == ("rerank", "classifier", "sigmoid")
    causal = ModelInfo.load(folders["qwen3_causal"])
    yes_no = json.loads((folders["qwen3_causal"] / "1_LogitScore" / "config.json").read_text())
    assert (causal.task, causal.family, causal.pooling) == ("rerank", "qwen3", "last")
    assert (causal.scoring.head, causal.scoring.true_token_id, causal.scoring.false_token_id) == (
        "lm_rows", yes_no["true_token_id"], yes_no["false_token_id"])
    assert (causal.scoring.pair_format, causal.scoring.message_format) == ("chat", "flat")
    seq_cls = ModelInfo.load(folders["qwen3_seq_cls"])
    assert (seq_cls.task, seq_cls.scoring.head, seq_cls.scoring.pair_format) == ("rerank", "score", "chat")
    # a plain causal LM folder is an embedding model (last-token pooling), as before
    assert ModelInfo.load(folders["qwen3_plain_causal_lm"]).task == "embed"


def test_folders_that_cannot_rerank_say_why(folders, tmp_path):
    two = build_bert_cross_encoder(tmp_path / "two_labels", num_labels=2)
    with pytest.raises(UnsupportedModel, match="2 labels"):
        ModelInfo.load(two)
    st = save_with_sentence_transformers(folders["bert"], tmp_path / "sparse")
    cfg = json.loads((st / "config_sentence_transformers.json").read_text())
    (st / "config_sentence_transformers.json").write_text(json.dumps({**cfg, "model_type": "SparseEncoder"}))
    with pytest.raises(UnsupportedModel, match="model_type 'SparseEncoder'"):
        ModelInfo.load(st)
    # the same folder as a SentenceTransformer embeds (sentence-transformers pools the base model)
    (st / "config_sentence_transformers.json").write_text(json.dumps({**cfg, "model_type": "SentenceTransformer"}))
    (st / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "",
                                                  "type": "sentence_transformers.models.Transformer"}]))
    assert ModelInfo.load(st).task == "embed"
    odd = build_bert_cross_encoder(tmp_path / "odd_activation",
                                   activation="torch.nn.modules.activation.Softplus")
    with pytest.raises(UnsupportedModel, match="activation_fn"):
        ModelInfo.load(odd)


@pytest.mark.parametrize("saved, config, want", [
    ("torch.nn.modules.linear.Identity", None, "identity"),
    ("torch.nn.modules.activation.Tanh", IDENTITY, "tanh"),  # the saved folder's own wins
    ("my_package.Scaled", None, "sigmoid"),  # not under torch.: CrossEncoder does not trust it
    (None, IDENTITY, "identity"),
])
def test_activation_as_cross_encoder_picks_it(folders, tmp_path, saved, config, want):
    st = save_with_sentence_transformers(folders["bert"], tmp_path / "st")
    st_cfg = json.loads((st / "config_sentence_transformers.json").read_text())
    (st / "config_sentence_transformers.json").write_text(json.dumps({**st_cfg, "activation_fn": saved}))
    cfg = json.loads((st / "config.json").read_text())
    cfg.pop("sentence_transformers", None)
    if config:
        cfg["sentence_transformers"] = {"activation_fn": config}
    (st / "config.json").write_text(json.dumps(cfg))
    assert ModelInfo.load(st).scoring.activation == want
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(st), device="cpu")
    assert type(ce.activation_fn).__name__.lower() == want


def _pairs(tokenizer: Tokenizer, documents, truncate=True):
    return tokenizer.encode_pairs_sync(QUERY, documents, truncate=truncate)


@pytest.mark.parametrize("kind", RERANKERS)
def test_pair_ids_are_cross_encoders(kind, folders, cross_encoders):
    info = ModelInfo.load(folders[kind])
    tok = Tokenizer(info)
    try:
        docs = DOCUMENTS + [LONG_DOCUMENT]
        pairs = _pairs(tok, docs)
        ce = cross_encoders(kind)
        for i, doc in enumerate(docs):
            features = ce.preprocess([(QUERY, doc)])
            want = features["input_ids"][0][features["attention_mask"][0].bool()].tolist()
            assert pairs.ids[i] == want, (kind, i)
            types = features.get("token_type_ids")
            segment = types[0].tolist().index(1) if types is not None and 1 in types[0].tolist() else 0
            assert pairs.segment_starts[i] == segment
        assert len(pairs.ids[-1]) == info.max_length  # the long one was cut, as CrossEncoder cuts it
        if info.scoring.pair_format == "chat":  # the text before the document, the same for all
            # ("<Document>: " ends in a space that merges into the document's first word)
            shared = [shared_prompt_len(seq, pairs.prefix_ids) for seq in pairs.ids]
            assert min(shared) >= len(pairs.prefix_ids) - 1 > 40
            assert pairs.segment_starts == [0] * len(docs)
        else:
            assert pairs.prefix_ids is None and min(pairs.segment_starts) > 0
        with pytest.raises(InvalidArgument, match=f"document {len(docs) - 1} with the query is") as err:
            _pairs(tok, docs, truncate=False)
        assert err.value.param == "documents"
    finally:
        tok.close()


@pytest.mark.parametrize("kind", RERANKERS)
def test_scores_match_cross_encoder_predict(kind, folders, cross_encoders):
    info = ModelInfo.load(folders[kind])
    tok = Tokenizer(info)
    try:
        docs = DOCUMENTS + [LONG_DOCUMENT]
        pairs = _pairs(tok, docs)
    finally:
        tok.close()
    engine = Engine.load(folders[kind], device="cpu", dtype="float32")
    raw = engine.embed(PackedBatch.pack(pairs.ids, segment_starts=pairs.segment_starts))
    assert raw.shape == (len(docs), 1) and raw.dtype == np.float32
    ce = cross_encoders(kind)
    want_raw = ce.predict([(QUERY, d) for d in docs], activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(raw[:, 0], want_raw, atol=2e-4, rtol=1e-4)
    want = ce.predict([(QUERY, d) for d in docs])
    np.testing.assert_allclose(info.scoring.activate(raw[:, 0]), want, atol=2e-5, rtol=1e-4)
    assert np.ptp(want_raw) > 0.05  # the documents score apart: a wrong segment or row would show
    if info.scoring.head == "lm_rows":  # only the true and false rows of the LM head
        assert tuple(engine.head.weight.shape) == (2, info.hidden_size)


def test_segment_ids_follow_sequences_sorted_by_length(folders):
    """Backends that sort sequences by length (sdpa_packed) get each token's own segment."""
    info = ModelInfo.load(folders["bert"])
    tok = Tokenizer(info)
    try:
        pairs = _pairs(tok, DOCUMENTS + [LONG_DOCUMENT])
    finally:
        tok.close()
    batch = PackedBatch.pack(pairs.ids, segment_starts=pairs.segment_starts)
    assert (np.diff(batch.seqlens) < 0).any()  # not in length order
    scores = {backend: Engine.load(folders["bert"], device="cpu", dtype="float32",
                                   attn_backend=backend).embed(batch)
              for backend in ("sdpa_packed", "sdpa_loop")}
    np.testing.assert_allclose(scores["sdpa_packed"], scores["sdpa_loop"], atol=1e-5)


def test_packed_batch_segments():
    batch = PackedBatch.pack([[1, 2, 3, 4], [5, 6], [7, 8, 9]], segment_starts=[2, 0, 1])
    assert batch.token_type_ids.tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert PackedBatch.pack([[1, 2]]).token_type_ids is None
    with pytest.raises(ValueError, match="second segment"):
        PackedBatch.pack([[1, 2]], segment_starts=2)


def test_activation_without_overflow():
    from tokq.model.info import Scoring

    raw = np.array([-200.0, -3.0, 0.0, 2.5, 200.0], dtype=np.float32)
    sig = Scoring(head="classifier", activation="sigmoid").activate(raw)
    np.testing.assert_allclose(sig, torch.sigmoid(torch.from_numpy(raw)).numpy(), atol=1e-7)
    assert sig.dtype == np.float32 and np.isfinite(sig).all()
    np.testing.assert_array_equal(Scoring(head="classifier", activation="identity").activate(raw), raw)


def test_entry_body_carries_the_segment_start():
    from tokq.queue.wire import decode_body, encode_body

    ids = np.arange(100, 130)
    body = decode_body(encode_body(ids, normalize=False, dimensions=1, prompt_len=4, segment_start=9))
    assert (body.token_ids.tolist(), body.dimensions, body.prompt_len, body.segment_start) == (
        ids.tolist(), 1, 4, 9)
    assert decode_body(encode_body(ids)).segment_start == 0
    assert len(encode_body(ids, segment_start=9)) == len(encode_body(ids)) + 2
    with pytest.raises(ValueError, match="segment_start"):
        encode_body(ids, segment_start=30)
    forged = bytearray(encode_body(ids, segment_start=9))
    forged[4:6] = (200).to_bytes(2, "little")  # past the ids: refused, not guessed
    with pytest.raises(ValueError, match="segment start 200"):
        decode_body(bytes(forged))
