"""Requests tokenized in the pools by the Python WordPiece (gateway/ascii_text.py) get exactly the
ids, the truncation and the refusals of the Rust tokenizer's path (Tokenizer._encode_general)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokq.gateway.errors import InvalidArgument
from tokq.gateway.tokenize import Tokenizer
from tokq.model.info import ModelInfo

WORDS = st.sampled_from(["the", "router", "Password", "unaffable", "x" * 120, "42", "don't", "e-mail",
                         "naïve", "[SEP]", "\t", "\x00", "?!", "tokenization", "zzyzx", "a.b/c"])
TEXT = st.lists(WORDS, min_size=1, max_size=700).map(" ".join)


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(ModelInfo.load(), threads=1)
    yield tok
    tok.close()


def _outcome(fn):
    try:
        return fn()
    except InvalidArgument as exc:
        return str(exc)


@settings(deadline=None, max_examples=150)
@given(texts=st.lists(TEXT, min_size=1, max_size=3), truncate=st.booleans(),
       prompt=st.sampled_from(["", "query: "]), as_bytes=st.booleans())
def test_the_pool_path_gives_the_rust_path_s_ids_and_refusals(tokenizer, texts, truncate, prompt, as_bytes):
    raw = [t.encode() for t in texts] if as_bytes else texts
    assert (_outcome(lambda: tokenizer.encode_sync(raw, prompt=prompt, truncate=truncate))
            == _outcome(lambda: tokenizer._encode_general(raw, prompt, truncate)))


def test_long_ascii_queries_are_cut_by_the_word_piece_path(tokenizer, monkeypatch):
    text = "how do I reset the password of my home router " * 60  # ~2,800 characters, 600 tokens
    expected = tokenizer._encode_general([text], "", True)
    monkeypatch.setattr(tokenizer, "_encode_general", None)  # the Rust path is not taken
    assert tokenizer.encode_sync([text], truncate=True) == expected
    assert len(expected[0]) == tokenizer.info.max_length
