"""ASCII text tokenized without the model's normalizer, where what that normalizer does to ASCII
is known: nothing (Unicode normal forms, accent stripping), lowercasing, or BERT's clean-up.

Why: the Rust normalizer tracks every character's alignment through its steps, a third of
tokenizing a search query (~13 of ~36 us for MiniLM's BertNormalizer, on this project's 2-core
machine), and nearly every query is ASCII. Python's ``str.lower`` does the same to ASCII for a
fraction of that. Text with a control character, any non-ASCII text, and every normalizer not
listed here take the tokenizer's own path (``AsciiPath.encode`` returns None).
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


class AsciiPath:
    """``encode``: a text's ids (special tokens added), tokenized without the normalizer when the
    text is ASCII and the normalizer is one ``ascii_normalizer`` knows, else None.

    Text that may hold an added token ("[SEP]", "<|endoftext|>") takes the tokenizer's own path
    too: those are matched before normalizing, or after it (``normalized=True``) against their
    own normalized form, so lowercasing first would hide "[SEP]". Any character an added token,
    or its normalized form, starts with, in either case, sends the text there."""

    def __init__(self, backend: RustTokenizer) -> None:
        spec = json.loads(backend.to_str()).get("normalizer")
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

    def encode(self, text: str) -> list[int] | None:
        if self._backend is None or not text.isascii() or _CONTROL.search(text):
            return None
        normalized = self.normalize(text)
        # raw text for tokens matched before normalizing, normalized text for the others
        if self._added is not None and (self._added.search(text) or self._added.search(normalized)):
            return None
        return self._backend.encode(normalized).ids
