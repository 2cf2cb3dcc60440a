"""ASCII text tokenized without the normalizer (gateway/ascii_text.py) gets exactly the ids the
tokenizer's own path gives, for every normalizer it claims to know, and the gateway's small-request
path (Tokenizer.encode on the loop) equals the general one."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import normalizers

from tokq.gateway.ascii_text import AsciiPath, ascii_normalizer
from tokq.gateway.tokenize import Tokenizer
from tokq.model.info import ModelInfo

# ASCII of every kind (controls, tabs, brackets of "[SEP]", "<|endoftext|>"), a few other letters.
TEXT = st.text(alphabet=st.one_of(st.characters(max_codepoint=127), st.sampled_from("éÉßı東🙂\u0301")),
               max_size=80)
PIECES = st.lists(st.sampled_from(["[SEP]", "[sep]", "[CLS]", "<|endoftext|>", "Hello", "WORLD", "café",
                                   "\t", "\n", "\x00", "\x0b", " ", "?!", "don't", "x" * 30]), max_size=12)


@pytest.fixture(scope="module")
def backend(bundled_model_dir):
    from transformers import AutoTokenizer

    b = copy.deepcopy(AutoTokenizer.from_pretrained(str(bundled_model_dir)).backend_tokenizer)
    b.no_truncation()
    b.no_padding()
    return b


@pytest.fixture(scope="module")
def paths(backend):
    """name -> (tokenizer with that normalizer, its AsciiPath), built once."""
    out = {}
    for name, normalizer in VARIANTS.items():
        variant = backend if normalizer is None else _with(backend, None if normalizer == "none" else normalizer)
        out[name] = (variant, AsciiPath(variant))
    return out


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(ModelInfo.load(), threads=1)
    yield tok
    tok.close()


def _with(backend, normalizer):
    variant = copy.deepcopy(backend)
    variant.normalizer = normalizer
    return variant


# Normalizers the module knows (it must give their ids) and one it does not (it must step aside).
VARIANTS = {
    "bert (MiniLM's)": None,
    "bert, cased": normalizers.BertNormalizer(lowercase=False),
    "bert, no clean-up": normalizers.BertNormalizer(clean_text=False),
    "nfd + lowercase + strip accents": normalizers.Sequence(
        [normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()]),
    "nfc (Qwen's)": normalizers.NFC(),
    "nfkc": normalizers.NFKC(),
    "lowercase": normalizers.Lowercase(),
    "none": "none",
}


@pytest.mark.parametrize("name", VARIANTS)
@settings(deadline=None, max_examples=150)
@given(text=TEXT, pieces=PIECES)
def test_ascii_text_gets_the_ids_of_the_tokenizer_s_own_path(paths, name, text, pieces):
    variant, path = paths[name]
    for t in (text, " ".join(pieces), text + "".join(pieces)):
        ids = path.encode(t)
        assert ids is None or ids == variant.encode(t).ids, (name, t)


@pytest.mark.parametrize("name", VARIANTS)
def test_plain_queries_do_take_the_ascii_path(paths, name):
    variant, path = paths[name]
    for text in ("How do I reset my Router's password?", "tabs\tand\nlines\r", "x" * 300, "a-b_c.d/e:f"):
        assert path.encode(text) == variant.encode(text).ids


def test_what_the_tokenizer_matches_before_normalizing_keeps_its_own_path(backend):
    # "[SEP]" is an added token matched in the raw text: lowercased first, it would be lost.
    path = AsciiPath(backend)
    for text in ("[SEP] hello", "a [sep]", "x\x00y", "caf\u00e9", "\x7f"):
        assert path.encode(text) is None, text


def test_added_tokens_matched_in_their_normalized_form_keep_their_own_path(backend):
    # normalized=True tokens are matched, in the normalized text, in their normalized form,
    # whose first character may differ from their own ("\uff41" is "a" under NFKC) or come
    # from a character the text holds in another form (BERT's clean-up makes a tab a space).
    from tokenizers import AddedToken

    cases = [(normalizers.NFKC(), "\uff41bcxyz", ["x abcxyz y", "ABCXYZ"]),
             (None, "\tzebra", ["a zebra", "a\tzebra", "zebra"])]
    for normalizer, content, texts in cases:
        variant = copy.deepcopy(backend)
        if normalizer is not None:
            variant.normalizer = normalizer
        variant.add_tokens([AddedToken(content, normalized=True)])
        path = AsciiPath(variant)
        for text in texts:
            ids = path.encode(text)
            assert ids is None or ids == variant.encode(text).ids, (content, text)
        assert variant.token_to_id(content) in variant.encode(texts[0]).ids  # the case is real


def test_normalizers_it_does_not_know_keep_their_own_path(backend):
    assert ascii_normalizer({"type": "Replace", "pattern": {"String": "a"}, "content": "b"}) is None
    assert ascii_normalizer({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Precompiled"}]}) is None
    replaced = _with(backend, normalizers.Replace("a", "b"))
    assert AsciiPath(replaced).encode("banana") is None
    assert ascii_normalizer({"type": "BertNormalizer", "clean_text": True, "lowercase": True})("A\tB") == "a b"


@settings(deadline=None, max_examples=200)
@given(texts=st.lists(TEXT.filter(bool), min_size=1, max_size=3), prompt=st.sampled_from(["", "query: "]),
       truncate=st.booleans())
def test_the_small_request_path_gives_the_general_path_s_ids(tokenizer, texts, prompt, truncate):
    raw = [t.encode("utf-8", "surrogatepass") for t in texts]
    small = tokenizer._encode_small(raw, prompt)
    if small is not None:
        assert small == tokenizer.encode_sync(raw, prompt=prompt, truncate=truncate)


def test_the_small_request_path_leaves_long_and_bad_inputs_to_the_general_path(tokenizer):
    assert tokenizer._encode_small([b"hello", b"!" * 255], "") is None  # 257 tokens: cut or refused there
    assert tokenizer._encode_small([b"ok", b"\xff"], "") is None  # not UTF-8: named there
    assert tokenizer._encode_small([b"hello world"], "") == [[101, 7592, 2088, 102]]


# -- BERT-style tokenizers, done whole in Python (WordPiece) ------------------------------------

def _word_piece_tokenizer(post_processor="template", max_chars=8, pre_tokenizer=None):
    """A small WordPiece vocabulary where words split into several pieces, some not at all."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(
        ["[UNK]", "[CLS]", "[SEP]", "[BOS]", "un", "##aff", "##able", "##a", "a", "b", "##b", "ab",
         "##ab", "!", "-", "_", "Hello", "hello", "##lo", "he", "##l", "x", "##x", "1", "##2", "12",
         "xxxxxxxxx"])}  # longer than max_input_chars_per_word: still [UNK]
    tok = RustTokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=max_chars))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.BertPreTokenizer()
    if post_processor == "template":  # more than one special token on a side
        tok.post_processor = processors.TemplateProcessing(
            single="[BOS] [CLS] $A [SEP]", special_tokens=[("[BOS]", 3), ("[CLS]", 1), ("[SEP]", 2)])
    elif post_processor == "bert":
        tok.post_processor = processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1))
    elif post_processor is not None:
        tok.post_processor = post_processor
    return tok


SMALL_VOCAB_TEXT = st.lists(st.sampled_from(["un", "aff", "able", "a", "b", "ab", "Hello", "hello", "lo", "l",
                                             "x", "1", "2", "z", "!", "-", "_", " ", "\t", "?", "xxxxxxxxx"]),
                            max_size=16).map("".join)


@pytest.mark.parametrize("post_processor", ["template", "bert", None])
@settings(deadline=None, max_examples=300)
@given(text=SMALL_VOCAB_TEXT)
def test_word_piece_gives_the_tokenizer_s_ids(post_processor, text):
    tok = _word_piece_tokenizer(post_processor)
    path = AsciiPath(tok)
    assert path._word_piece is not None
    assert path.encode(text) == tok.encode(text).ids, text


def test_word_piece_is_used_for_minilm_and_agrees_on_the_hard_cases(backend):
    path = AsciiPath(backend)
    assert path._word_piece is not None  # the bundled model's queries take it
    for text in ("unaffable xyzzyqwert", "x" * 101 + " ok", "x" * 100, "don't-stop_now!!", "a1b2 3.14", ""):
        assert path.encode(text) == backend.encode(text).ids, text


def test_word_piece_steps_aside_for_tokenizers_it_does_not_know(backend):
    from tokenizers import pre_tokenizers, processors

    others = [_word_piece_tokenizer(processors.RobertaProcessing(("[SEP]", 2), ("[CLS]", 1))),
              _word_piece_tokenizer(pre_tokenizer=pre_tokenizers.Whitespace())]
    truncating = copy.deepcopy(backend)
    truncating.enable_truncation(16)
    for tok in [*others, truncating]:
        path = AsciiPath(tok)
        assert path._word_piece is None
        assert path.encode("Hello unaffable!") == tok.encode("Hello unaffable!").ids
