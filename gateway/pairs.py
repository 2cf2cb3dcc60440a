"""A reranker's (query, document) pairs as token ids, exactly as sentence-transformers' CrossEncoder
tokenizes them: text pairs through the tokenizer's pair template, chat pairs through the chat
template, whose text before the document is a shared prompt (docs/internals.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer as RustTokenizer

from tokq.gateway.errors import InvalidArgument
from tokq.model.info import ModelInfo, UnsupportedModel

# Stands for the document in one render of the template, so each document is the render's text
# around it: private-use characters no tokenizer merges with their neighbours in a template.
_DOC_MARK = "\ue000tokq-document\ue001"
# A document a template that edits its content (trims, escapes) would render otherwise.
_PROBE_DOC = " \n<b>probe</b> & 'quotes' \n"
# sentence-transformers' check that a template carries both roles, and its suffix fillers.
_ROLE_PROBES = (("alpha", "bravo"), ("charlie", "bravo"), ("alpha", "foxtrot"))
_SUFFIX_FILLERS = ("0", "1 2 3 4")


@dataclass(frozen=True)
class Pairs:
    ids: list[list[int]]  # one per document, special tokens included
    segment_starts: list[int]  # first token of the document's segment (0: one segment)
    prefix_ids: list[int] | None  # chat pairs: the tokens of the text before the document


class PairTemplate:
    """One reranker's way from a pair to ids; ``hf_tokenizer`` renders chat templates."""

    def __init__(self, info: ModelInfo, hf_tokenizer, backend: RustTokenizer) -> None:
        scoring = info.scoring
        if scoring is None:
            raise ValueError(f"{info.name} is not a reranker")
        self.info = info
        self.chat = scoring.pair_format == "chat"
        self.flat = scoring.message_format == "flat"
        self._hf = hf_tokenizer
        self._cut_right = getattr(hf_tokenizer, "truncation_side", "right") == "right"
        self._suffixes: dict[str, list[int]] = {}
        if self.chat:
            renders = [self._render(q, d, "") for q, d in _ROLE_PROBES]
            dropped = [role for role, r in zip(("query", "document"), renders[1:]) if r == renders[0]]
            if dropped:
                raise UnsupportedModel(f"the chat template of {info.name} drops the "
                                       f"{' and '.join(dropped)} of a pair: it cannot rerank")
        else:
            enc = backend.encode("a", "b", add_special_tokens=True)
            types = enc.type_ids
            first = types.index(1) if 1 in types else len(types)
            if set(types) - {0, 1} or any(t != (i >= first) for i, t in enumerate(types)):
                raise UnsupportedModel(f"the pair template of {info.name}'s tokenizer gives segment ids "
                                       f"{types}: tokq takes a first segment 0, then a second segment 1")

    def _messages(self, query: str, document: str, prompt: str) -> list[dict]:
        def message(role: str, text: str) -> dict:
            return {"role": role, "content": text if self.flat else [{"type": "text", "text": text}]}
        head = [message("system", prompt)] if prompt else []
        return head + [message("query", query), message("document", document)]

    def _render(self, query: str, document: str, prompt: str) -> str:
        return str(self._hf.apply_chat_template(self._messages(query, document, prompt), tokenize=False))

    def _suffix(self, backend: RustTokenizer, prompt: str) -> list[int]:
        """The template's tail after the content, as sentence-transformers derives it: the
        common token suffix of two renders with different fillers (system prompt kept)."""
        suffix = self._suffixes.get(prompt)
        if suffix is None:
            first, second = (backend.encode(self._render(f, f, prompt), add_special_tokens=False).ids
                             for f in _SUFFIX_FILLERS)
            count = 0
            for a, b in zip(reversed(first), reversed(second)):
                if a != b:
                    break
                count += 1
            suffix = first[len(first) - count:] if 0 < count < min(len(first), len(second)) else []
            self._suffixes[prompt] = suffix
        return suffix

    def _renders(self, query: str, documents: list[str], prompt: str) -> tuple[list[str], str | None]:
        """Each document's render, and the text before the document (None: not the same for all)."""
        marked = self._render(query, _DOC_MARK, prompt)
        if marked.count(_DOC_MARK) == 1:
            before, after = marked.split(_DOC_MARK)
            # the template passes a document through unchanged: renders are the text around it
            if all(self._render(query, d, prompt) == before + d + after for d in (documents[0], _PROBE_DOC)):
                return [before + d + after for d in documents], before
        return [self._render(query, d, prompt) for d in documents], None

    def encode(self, backend: RustTokenizer, pair_backend: RustTokenizer, query: str,
               documents: list[str], *, truncate: bool, prompt: str = "") -> Pairs:
        """``backend`` never truncates; ``pair_backend`` (text pairs) truncates longest-first to
        the model's max length. Over-long pairs without ``truncate``: INVALID_ARGUMENT naming
        the document."""
        max_len = self.info.max_length
        if not self.chat:
            query = prompt + query  # sentence-transformers prepends a prompt to the pair's first text
            encs = (pair_backend if truncate else backend).encode_batch(
                [(query, d) for d in documents], add_special_tokens=True)
            ids, starts = [], []
            for i, enc in enumerate(encs):
                if len(enc.ids) > max_len:
                    raise self.too_long(i, len(enc.ids))
                ids.append(enc.ids)
                types = enc.type_ids
                starts.append(types.index(1) if 1 in types else 0)
            return Pairs(ids, starts, None)
        texts, before = self._renders(query, documents, prompt)
        encs = backend.encode_batch(texts + ([before] if before else []), add_special_tokens=False)
        prefix = encs.pop().ids if before else None
        ids = []
        for i, enc in enumerate(encs):
            seq = enc.ids
            if len(seq) > max_len:
                if not truncate:
                    raise self.too_long(i, len(seq))
                seq = seq[:max_len] if self._cut_right else seq[-max_len:]
                suffix = self._suffix(backend, prompt)
                keep = min(len(suffix), max_len)
                if keep:
                    seq[max_len - keep:] = suffix[len(suffix) - keep:]
            ids.append(seq)
        return Pairs(ids, [0] * len(ids), prefix)

    def too_long(self, index: int, length: int) -> InvalidArgument:
        max_len = self.info.max_length
        return InvalidArgument(
            f"document {index} with the query is {length} tokens long; {self.info.name} takes at most "
            f"{max_len} tokens per pair (special tokens included). Shorten it or set truncate=true "
            f"to cut the pair to {max_len}.", param="documents")
