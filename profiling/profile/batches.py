"""Packed batches for the profile: exact token totals, the workload's lengths, and its texts' token ids
(else random ordinary ids in the model's special tokens, or in [0, vocab_size) without a tokenizer)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from tokq.batch import PackedBatch
from tokq.model.info import ModelInfo
from tokq.profiling.workload import Query


@dataclass
class TokenIds:
    """Builds one query's token ids (specials included), capped at a length."""

    vocab_ids: np.ndarray  # ordinary (non-special) ids to draw bodies from
    prefix: tuple[int, ...] = ()  # special ids before the body, e.g. [CLS]
    suffix: tuple[int, ...] = ()  # special ids after it, e.g. [SEP]
    tokenize: Callable[[str], list[int]] | None = None  # text -> ids with specials
    seed: int = 0

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        self._cache: dict[str, np.ndarray] = {}

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenize is not None

    def __call__(self, query: Query, max_tokens: int) -> np.ndarray:
        """The query's ids, at most ``max_tokens``: its text's own when it has one, else "tokens" random ids."""
        if self.tokenize is None or query.text is None:
            return self.random_ids(min(query.num_tokens, max_tokens))
        ids = self._cache.get(query.text)
        if ids is None:  # keyed by text: a user's file may reuse ids
            ids = self._cache[query.text] = np.asarray(self.tokenize(query.text), np.int64)
        if ids.size <= max_tokens:
            return ids
        # Cut the body, keep the closing special token(s) in place.
        keep_tail = min(len(self.suffix), max_tokens - 1)
        return np.concatenate([ids[:max_tokens - keep_tail], ids[ids.size - keep_tail:]])

    def random_ids(self, length: int) -> np.ndarray:
        specials = list(self.prefix) + list(self.suffix)
        if length <= len(specials):  # too short for a body: the specials, cut (e.g. just [CLS])
            return np.asarray(specials[:length], np.int64)
        body = self._rng.choice(self.vocab_ids, size=length - len(specials))
        return np.concatenate([np.asarray(self.prefix, np.int64), body, np.asarray(self.suffix, np.int64)])


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")


def _random_ids(info: ModelInfo, seed: int) -> TokenIds:
    vocab_size = int(info.config.get("vocab_size", 0))
    if vocab_size <= 0:
        raise ValueError(f"{info.path} has neither a tokenizer nor a vocab_size in config.json")
    return TokenIds(vocab_ids=np.arange(vocab_size, dtype=np.int64), seed=seed)


def token_ids_for(info: ModelInfo, *, seed: int = 0) -> TokenIds:
    """The model's tokenizer when it has one, else random ids over its config's vocab_size."""
    # transformers 5 builds an empty tokenizer for a directory without one: look for files first.
    if not any((info.path / name).is_file() for name in TOKENIZER_FILES):
        return _random_ids(info, seed)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(info.path))
    if not tok("hello", add_special_tokens=False)["input_ids"]:
        return _random_ids(info, seed)
    special = set(tok.all_special_ids)
    vocab_ids = np.array([i for i in range(len(tok)) if i not in special], dtype=np.int64)
    # Find the specials the tokenizer wraps text with by where a probe word's body sits.
    with_specials = tok("hello", add_special_tokens=True)["input_ids"]
    body = tok("hello", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(with_specials) - len(body) + 1)
                 if with_specials[i:i + len(body)] == body)
    return TokenIds(
        vocab_ids=vocab_ids,
        prefix=tuple(with_specials[:start]),
        suffix=tuple(with_specials[start + len(body):]),
        tokenize=lambda text: tok(text, add_special_tokens=True, truncation=True,
                                  max_length=info.max_length)["input_ids"],
        seed=seed,
    )


class BatchMaker:
    """Packs batches of an exact token count from the workload in order (the last sequence cut), each
    call going on where the last stopped; ``prompt_ids``: each query behind it, after ``lead`` specials."""

    def __init__(self, queries: Sequence[Query], make_ids: Callable[[Query, int], np.ndarray],
                 max_length: int, *, prompt_ids: np.ndarray | None = None, lead: int = 0) -> None:
        if not queries:
            raise ValueError("empty workload")
        self.queries, self.make_ids, self.max_length = queries, make_ids, max_length
        self.prompt_ids = np.asarray(prompt_ids if prompt_ids is not None else [], dtype=np.int64)
        self.lead = lead if self.prompt_ids.size else 0
        self._next: Iterator[Query] = self._cycle()

    def _cycle(self) -> Iterator[Query]:
        while True:
            yield from self.queries

    def __call__(self, num_tokens: int) -> PackedBatch:
        if self.prompt_ids.size:
            return self._prompted(num_tokens)
        seqs: list[np.ndarray] = []
        remaining = num_tokens
        while remaining > 0:
            seqs.append(self.make_ids(next(self._next), min(self.max_length, remaining)))
            remaining -= seqs[-1].size
        return PackedBatch.pack(seqs)

    def _prompted(self, num_tokens: int) -> PackedBatch:
        seqs: list[np.ndarray] = []
        prompt_len = self.lead + self.prompt_ids.size
        remaining = num_tokens
        while remaining > 0:
            query = next(self._next)
            cap = max(1, min(self.max_length - self.prompt_ids.size, remaining + self.lead))
            ids = self.make_ids(query, cap)
            if ids.size <= self.lead:  # too short to have tokens of its own
                continue
            seqs.append(np.concatenate([ids[:self.lead], self.prompt_ids, ids[self.lead:]]))
            remaining -= ids.size - self.lead
        return PackedBatch.pack(seqs, prompt_lens=prompt_len)


def shared_prompt_ids(engine, token_ids: TokenIds) -> np.ndarray | None:
    """The default prompt's ids (no specials) when the worker computes it once, else None."""
    info = engine.info
    prompt = info.prompt(None) if info.default_prompt_name else ""
    if not prompt or getattr(engine, "prompt_cache", None) is None or not token_ids.has_tokenizer:
        return None
    ids = list(token_ids.tokenize(prompt))
    body = ids[len(token_ids.prefix):len(ids) - len(token_ids.suffix)]
    return np.asarray(body, dtype=np.int64) if body else None
