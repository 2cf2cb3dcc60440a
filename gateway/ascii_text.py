"""ASCII text tokenized without the model's normalizer where its effect on ASCII is known, and
BERT-style WordPiece done in Python: both cost less than the Rust call (docs/internals.md).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable

from tokenizers import Tokenizer as RustTokenizer

# Control characters other than tab, newline and carriage return: BERT's clean-up removes them.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# BERT's clean-up turns these into a space.
_WHITESPACE = str.maketrans("\t\n\r", "   ")
# Normalizers that leave ASCII text as it is.
_IDENTITY = frozenset({"NFC", "NFD", "NFKC", "NFKD", "StripAccents"})


def _identity(text: str) -> str:
    return text


def ascii_normalizer(spec: dict | None) -> Callable[[str], str] | None:
    """What the normalizer ``spec`` (tokenizer.json's "normalizer") does to ASCII text without
    control characters, as a function; None when this module does not know it."""
    if spec is None:
        return _identity
    kind = spec.get("type")
    if kind in _IDENTITY:
        return _identity
    if kind == "Lowercase":
        return str.lower
    if kind == "BertNormalizer":
        # Chinese characters and accents are not ASCII; clean_text maps \t \n \r to spaces.
        clean, lower = spec.get("clean_text", True), spec.get("lowercase", True)
        if clean and lower:
            return lambda text: text.translate(_WHITESPACE).lower()
        if clean:
            return lambda text: text.translate(_WHITESPACE)
        return str.lower if lower else _identity
    if kind == "Sequence":
        steps = [ascii_normalizer(s) for s in spec.get("normalizers", [])]
        if any(step is None for step in steps):
            return None
        steps = [s for s in steps if s is not _identity]

        def sequence(text: str) -> str:
            for step in steps:
                text = step(text)
            return text
        return sequence
    return None


# BERT's pre-tokenizer on ASCII without control characters: runs of letters and digits, and each
# punctuation character (every other printable one) alone; whitespace splits and is dropped.
_BERT_WORDS = re.compile(r"[A-Za-z0-9]+|[!-/:-@\[-`{-~]")


class WordPiece:
    """BERT's pre-tokenizer, WordPiece and the post-processor's special tokens, on ASCII text
    without control characters: the ids the tokenizer gives, for the tokenizers ``of`` accepts."""

    def __init__(self, vocab: dict[str, int], unk_id: int, prefix: str, max_chars: int,
                 before: list[int], after: list[int]) -> None:
        self.vocab, self.unk_id, self.prefix, self.max_chars = vocab, unk_id, prefix, max_chars
        self.before, self.after = before, after

    @classmethod
    def of(cls, spec: dict) -> WordPiece | None:
        """From tokenizer.json's contents; None unless its model is WordPiece, its pre-tokenizer
        BERT's, its post-processor one that only adds fixed special tokens around the text, and
        it neither truncates nor pads."""
        model = spec.get("model") or {}
        if (model.get("type") != "WordPiece" or spec.get("pre_tokenizer") != {"type": "BertPreTokenizer"}
                or spec.get("truncation") is not None or spec.get("padding") is not None
                or model.get("unk_token") not in model.get("vocab", {})):
            return None
        specials = _special_tokens(spec.get("post_processor"))
        if specials is None:
            return None
        vocab = model["vocab"]
        return cls(vocab, vocab[model["unk_token"]], model.get("continuing_subword_prefix", "##"),
                   model.get("max_input_chars_per_word", 100), *specials)

    def encode(self, text: str) -> list[int]:
        words = _BERT_WORDS.findall(text)
        # Most words of a query are whole in the vocabulary: looked up in one C loop.
        ids = list(map(self.vocab.get, words))
        too_long = len(text) > self.max_chars and max(map(len, words), default=0) > self.max_chars
        if None in ids or too_long:  # the others split into pieces (a word too long: unknown)
            pieces: list[int] = []
            for word, whole in zip(words, ids):
                if whole is None or len(word) > self.max_chars:
                    pieces.extend(self._pieces(word))
                else:
                    pieces.append(whole)
            ids = pieces
        return self.before + ids + self.after

    def truncated(self, ids: list[int], max_length: int) -> list[int]:
        """``encode``'s ``ids`` cut to ``max_length`` as right-side truncation cuts: the first
        tokens of the text kept, the special tokens around them."""
        keep = max_length - len(self.before) - len(self.after)
        return ids[:len(self.before) + keep] + self.after

    def _pieces(self, word: str) -> list[int]:
        """Greedy longest match first, as the WordPiece model does; one unknown piece makes the
        whole word unknown."""
        vocab, pieces, start, n = self.vocab, [], 0, len(word)
        if n > self.max_chars:
            return [self.unk_id]
        while start < n:
            for end in range(n, start, -1):
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                if (token := vocab.get(piece)) is not None:
                    break
            else:
                return [self.unk_id]
            pieces.append(token)
            start = end
        return pieces


def _special_tokens(spec: dict | None) -> tuple[list[int], list[int]] | None:
    """The ids a post-processor puts before and after a single text, when that is all it does."""
    if spec is None:
        return [], []
    if spec.get("type") == "BertProcessing":
        return [spec["cls"][1]], [spec["sep"][1]]
    if spec.get("type") != "TemplateProcessing":
        return None
    parts: tuple[list[int], list[int]] = ([], [])
    seen_text = False
    for item in spec.get("single", []):
        if "Sequence" in item:
            if seen_text or item["Sequence"].get("id") != "A":
                return None
            seen_text = True
        elif "SpecialToken" in item:
            parts[seen_text].extend(spec["special_tokens"][item["SpecialToken"]["id"]]["ids"])
        else:
            return None
    return parts if seen_text else None


class AsciiPath:
    """``encode``: an ASCII text's ids (special tokens added) without the normalizer, by ``WordPiece``
    where it applies; None for text the tokenizer's own path must take, such as text that may
    hold an added token ("[SEP]"), which lowercasing would hide."""

    def __init__(self, backend: RustTokenizer) -> None:
        config = json.loads(backend.to_str())
        spec = config.get("normalizer")
        self.normalize = ascii_normalizer(spec)
        self._backend = None
        if self.normalize is not None:
            self._backend = backend
            if spec is not None:
                self._backend = copy.deepcopy(backend)
                self._backend.normalizer = None
        starts = set()
        for token in backend.get_added_tokens_decoder().values():
            forms = [token.content]
            if token.normalized and backend.normalizer is not None:
                forms.append(backend.normalizer.normalize_str(token.content))
            starts.update(c for form in forms if form for c in (form[0].lower(), form[0].upper()))
        self._added = re.compile("[" + "".join(re.escape(c) for c in sorted(starts)) + "]") if starts else None
        self._word_piece = WordPiece.of(config) if self._backend is not None else None

    def encode(self, text: str) -> list[int] | None:
        if self._backend is None or not text.isascii() or _CONTROL.search(text):
            return None
        normalized = self.normalize(text)
        # raw text for tokens matched before normalizing, normalized text for the others
        if self._added is not None and (self._added.search(text) or self._added.search(normalized)):
            return None
        if self._word_piece is not None:
            return self._word_piece.encode(normalized)
        return self._backend.encode(normalized).ids

    def encode_word_pieces(self, text: str, max_length: int | None = None) -> list[int] | None:
        """``encode`` where ``WordPiece`` does it whole, else None: pure Python, so any thread may
        call it (the Rust tokenizer this path holds is the loop thread's). ``max_length``: the
        ids right-side truncated to it."""
        if self._word_piece is None or (ids := self.encode(text)) is None:
            return None
        return ids if max_length is None or len(ids) <= max_length else self._word_piece.truncated(ids, max_length)
