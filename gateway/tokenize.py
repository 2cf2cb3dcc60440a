"""Tokenization off the event loop, in two lanes, with truncation that costs what the model reads.

Tiny requests run on the event loop, large ones on a lane of their own; long inputs are cut or
refused from a prefix (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import copy
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from tokenizers import Encoding
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import normalizers
from transformers import AutoTokenizer

from tokq.gateway.ascii_text import AsciiPath
from tokq.gateway.helper_threads import batch_this_thread
from tokq.gateway.errors import InvalidArgument
from tokq.gateway.large_lane import LargeLane
from tokq.gateway.pairs import Pairs, PairTemplate
from tokq.gateway.validate import decode_texts, not_utf8
from tokq.host import usable_cpus
from tokq.model.info import ModelInfo

# Our pools are the parallelism; the Rust tokenizer's own (rayon) would let one large batch
# take every core and undo the lanes. An operator's explicit setting still wins.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Requests with at most this many bytes to tokenize run on the event loop: a search query
# costs less to tokenize than the hop to a pool thread and back.
INLINE_BYTES = 256

# Pool threads started, with their tokenizer copies, when a Tokenizer is made.
STARTED_THREADS = 4

# First prefix tried for truncate=true, in characters per token kept: ordinary text runs 3-5
# characters a token, so one tokenization of a prefix this long nearly always suffices.
PREFIX_CHARS_PER_TOKEN = 8

# Requests up to this many first prefixes long are read whole by the Python WordPiece.
WORD_PIECE_PREFIXES = 2


def encode_truncated(backend: RustTokenizer, text: str, max_length: int) -> list[int]:
    """``text``'s ids truncated to ``max_length`` (special tokens included), equal to right-side
    truncation of the whole text, while reading only a prefix (why: docs/internals.md).
    ``backend`` must have truncation and padding off."""
    return encode_truncated_batch(backend, [text], max_length)[0]


def encode_truncated_batch(backend: RustTokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """``encode_truncated`` for many texts, through ``encode_batch``: unlike ``encode`` it
    releases the GIL, so a large request never holds up the event loop or the other lane."""
    keep = max_length - backend.num_special_tokens_to_add(False)
    cut = max(64, keep * PREFIX_CHARS_PER_TOKEN)
    out: list[list[int] | None] = [None] * len(texts)
    todo = list(range(len(texts)))
    while todo:
        encs = backend.encode_batch([texts[i][:cut] for i in todo], add_special_tokens=False)
        widen = []
        for i, enc in zip(todo, encs):
            if cut >= len(texts[i]) or _prefix_is_settled(enc, keep):
                enc.truncate(keep)
                out[i] = backend.post_process(enc).ids
            else:
                widen.append(i)
        todo, cut = widen, cut * 2
    return out


def surely_too_long(backend: RustTokenizer, text: str, max_length: int) -> bool:
    """True when ``text`` surely has more than ``max_length`` tokens, read from ever longer prefixes
    as in ``encode_truncated``, so a long text is refused for the price of a max-length one.
    False means "not known from a prefix": the full tokenization decides."""
    return first_surely_too_long(backend, [text], max_length) == 0


def first_surely_too_long(backend: RustTokenizer, texts: list[str] | list[bytes],
                          max_length: int) -> int | None:
    """The index of the first text ``surely_too_long`` says is, else None; it stops at that text.
    Texts may be UTF-8 bytes (gRPC's inputs): only the prefixes read are decoded."""
    keep = max_length - backend.num_special_tokens_to_add(False)
    cut = max(64, keep * PREFIX_CHARS_PER_TOKEN)
    for i, text in enumerate(texts):
        try:
            head = _head(text, cut)
            while head is not None:
                # encode_batch, not encode: it releases the GIL
                [enc] = backend.encode_batch([head], add_special_tokens=False)
                if _prefix_is_settled(enc, keep):
                    return i
                head = _head(text, 2 * len(head))
        except UnicodeDecodeError as exc:
            raise not_utf8(i, exc) from None
    return None


def _head(text: str | bytes, chars: int) -> str | None:
    """``text``'s first ``chars`` characters when it has more, else None. UTF-8 bytes are decoded
    only as far as that takes (at most 4 bytes a character)."""
    if isinstance(text, str):
        return text[:chars] if len(text) > chars else None
    if len(text) <= chars:  # no more bytes than that, so no more characters
        return None
    span = 4 * (chars + 1)  # holds chars + 1 whole characters, if the text has them
    head = codecs.getincrementaldecoder("utf-8")().decode(text[:span], final=len(text) <= span)
    return head[:chars] if len(head) > chars else None


def _prefix_is_settled(enc: Encoding, keep: int) -> bool:
    words = enc.word_ids
    if len(words) <= keep:
        return False
    last_kept, last = words[keep - 1], words[-1]
    return last_kept is not None and last is not None and last_kept < last and None not in words[:keep]


def lowercase_first(backend: RustTokenizer) -> None:
    """A Lowercase step in front of ``backend``'s normalizer, unless it has one: what
    sentence-transformers does for do_lower_case=true (a BertNormalizer's own lowercasing does
    not count there; lowercasing twice changes nothing). The ASCII path reads the new normalizer."""
    spec = json.loads(backend.to_str()).get("normalizer") or {}
    steps = spec.get("normalizers", []) if spec.get("type") == "Sequence" else [spec]
    if any(step.get("type") == "Lowercase" for step in steps):
        return
    current = backend.normalizer
    backend.normalizer = normalizers.Sequence(
        [normalizers.Lowercase()] + ([current] if current is not None else []))


class Tokenizer:
    def __init__(self, info: ModelInfo, threads: int = 0, heavy_bytes: int = 0,
                 large_share: float = 1.0) -> None:
        self.info = info
        self._tok = AutoTokenizer.from_pretrained(str(info.require_tokenizer().path))
        # Our own copy, never truncating or padding by itself: the HF wrapper sets those on its
        # backend per call, and ``encode_truncated`` does the truncation.
        backend = copy.deepcopy(self._tok.backend_tokenizer)
        backend.no_truncation()
        backend.no_padding()
        if info.lowercase:
            lowercase_first(backend)
        self._backend = backend
        self._ascii = AsciiPath(backend)  # its Rust path on the event loop's thread only
        # Requests of at most this many characters go through AsciiPath's WordPiece in the pools
        # too: for a long query it costs a fifth of the Rust call, which tracks offsets.
        self._word_piece_chars = WORD_PIECE_PREFIXES * PREFIX_CHARS_PER_TOKEN * info.max_length
        # a reranker's (query, document) pairs, as its tokenizer pairs them (gateway/pairs.py)
        self.pairs = PairTemplate(info, self._tok, backend) if info.is_reranker else None
        self._cut_prefix = getattr(self._tok, "truncation_side", "right") == "right"
        light = threads or usable_cpus()
        # Its threads yield to the event loop's (gateway/helper_threads.py), however late they start.
        self._light = ThreadPoolExecutor(light, thread_name_prefix="tokenize", initializer=batch_this_thread)
        self._large = LargeLane(max(1, light // 2), large_share)
        # Large: more than ~16 max-length inputs of ordinary text (4 bytes a token) to read, i.e.
        # a few milliseconds of one core. A search query (a few short inputs) is never large.
        self.heavy_bytes = heavy_bytes or 64 * info.max_length
        self._local = threading.local()
        try:
            self._start_light_threads(light)
        except BaseException:
            self.close()
            raise

    def _start_light_threads(self, n: int) -> None:
        """Start up to ``STARTED_THREADS`` pool threads and this thread, each with its tokenizer
        copy: made on a first call, the copy (deepcopy holds the GIL) would stall the event loop."""
        self._backend_copy()
        n = min(n, STARTED_THREADS)
        started = threading.Barrier(n)

        def start() -> None:
            try:
                self._backend_copy()
            except BaseException:
                started.abort()  # the others stop waiting; this error is the one raised
                raise
            started.wait(timeout=60)  # each task on its own thread: the pool starts n of them
        futures = [self._light.submit(start) for _ in range(n)]
        concurrent.futures.wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])

    def _pair_backend_copy(self) -> RustTokenizer:
        """This thread's copy that cuts pairs longest-first to the max length, as the model's
        tokenizer does under sentence-transformers."""
        tok = getattr(self._local, "pair_tok", None)
        if tok is None:
            tok = copy.deepcopy(self._backend)
            side = "right" if self._cut_prefix else "left"
            tok.enable_truncation(self.info.max_length, strategy="longest_first", direction=side)
            self._local.pair_tok = tok
        return tok

    def encode_pairs_sync(self, query: str, documents: list[str], *, truncate: bool = False,
                          prompt: str = "") -> Pairs:
        """A reranker's ids for (query, document) pairs (gateway/pairs.py)."""
        if self.pairs is None:
            raise ValueError(f"{self.info.name} is not a reranker")
        return self.pairs.encode(self._backend_copy(), self._pair_backend_copy(), query, documents,
                                 truncate=truncate, prompt=prompt)

    async def encode_pairs(self, query: str, documents: list[str], *, truncate: bool = False,
                           prompt: str = "", cost_bytes: int | None = None) -> Pairs:
        """``encode_pairs_sync`` in the lane ``cost_bytes`` picks, as ``encode`` does."""
        if cost_bytes is None:
            cost_bytes = len(query) * len(documents) + sum(len(d) for d in documents)

        def run() -> Pairs:
            return self.encode_pairs_sync(query, documents, truncate=truncate, prompt=prompt)
        if cost_bytes > self.heavy_bytes:
            return await self._large.run(run)
        self._large.light_seen()
        if cost_bytes <= INLINE_BYTES:
            return run()
        return await asyncio.get_running_loop().run_in_executor(self._light, run)

    def _backend_copy(self) -> RustTokenizer:
        tok = getattr(self._local, "tok", None)
        if tok is None:
            tok = self._local.tok = copy.deepcopy(self._backend)
        return tok

    def encode_sync(self, texts: list[str] | list[bytes], *, prompt: str = "",
                    truncate: bool = False) -> list[list[int]]:
        """Ids per text; texts may be UTF-8 bytes (``validate.decode_texts``), decoded here."""
        if sum(map(len, texts)) <= self._word_piece_chars and (
                ids := self._encode_small(texts, prompt, truncate, word_pieces_only=True)) is not None:
            return ids
        return self._encode_general(texts, prompt, truncate)

    def _encode_general(self, texts: list[str] | list[bytes], prompt: str, truncate: bool) -> list[list[int]]:
        """``encode_sync`` through the Rust tokenizer, cutting or refusing long inputs from a prefix."""
        max_len = self.info.max_length
        backend = self._backend_copy()
        if prompt:
            texts = [prompt + t for t in decode_texts(texts)]
        # Before decoding the rest: a request refused here decodes only the prefixes it read.
        if not truncate and (i := first_surely_too_long(backend, texts, max_len)) is not None:
            raise self._too_long(i, f"more than {max_len}")
        texts = decode_texts(texts)
        if truncate and self._cut_prefix:
            return encode_truncated_batch(backend, texts, max_len)
        if truncate:  # left-side truncation keeps a suffix: the exact path on the whole text
            keep = max_len - backend.num_special_tokens_to_add(False)
            out = []
            for enc in backend.encode_batch(texts, add_special_tokens=False):
                enc.truncate(keep, direction="left")
                out.append(backend.post_process(enc).ids)
            return out
        encs = backend.encode_batch(texts, add_special_tokens=True)
        ids = [enc.ids for enc in encs]
        for i, seq in enumerate(ids):
            if len(seq) > max_len:
                raise self._too_long(i, str(len(seq)))
        return ids

    def _encode_small(self, texts: list[str] | list[bytes], prompt: str, truncate: bool = False,
                      word_pieces_only: bool = False) -> list[list[int]] | None:
        """A request's ids, one ``encode`` call per text (no truncation to set up, no GIL to give
        up and take back), ASCII text through ``AsciiPath``; None when a text needs the general
        path of ``encode_sync`` instead (too long and not cut here, or not UTF-8: that path says
        which byte). ``word_pieces_only``: only what ``AsciiPath`` does in Python (pool threads:
        the loop thread's Rust copy is its own)."""
        max_len = self.info.max_length
        cut = max_len if truncate and self._cut_prefix else None  # right-side truncation, as the general path's
        out = []
        for text in texts:
            if isinstance(text, bytes):
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError:
                    return None
            text = prompt + text
            ids = self._ascii.encode_word_pieces(text, cut)
            if ids is None:
                if word_pieces_only:
                    return None
                ids = self._ascii.encode(text) or self._backend_copy().encode(text).ids
            if len(ids) > max_len:  # truncate, or refuse: the general path decides
                return None
            out.append(ids)
        return out

    def _too_long(self, index: int, length: str) -> InvalidArgument:
        max_len = self.info.max_length
        return InvalidArgument(
            f"input {index} is {length} tokens long; {self.info.name} takes at most {max_len} "
            f"tokens per input (special tokens included). Shorten it or set truncate=true to cut "
            f"it to {max_len}.", param="input")

    async def encode(self, texts: list[str], *, prompt: str = "", truncate: bool = False,
                     cost_bytes: int | None = None) -> list[list[int]]:
        """``cost_bytes``: the bytes this call will tokenize (after any cut); it picks the lane:
        the event loop itself for tiny requests (``INLINE_BYTES``), else one of the pools."""
        if cost_bytes is None:
            cost_bytes = sum(len(t) for t in texts)  # characters or bytes: about the same
        if cost_bytes > self.heavy_bytes:
            return await self._large.run(
                lambda: self.encode_sync(texts, prompt=prompt, truncate=truncate))
        self._large.light_seen()
        if cost_bytes <= INLINE_BYTES:
            ids = self._encode_small(texts, prompt, truncate)
            return ids if ids is not None else self._encode_general(texts, prompt, truncate)
        return await asyncio.get_running_loop().run_in_executor(
            self._light, lambda: self.encode_sync(texts, prompt=prompt, truncate=truncate))

    def cost_bytes(self, sizes: list[int], truncate: bool) -> int:
        """About the bytes tokenizing inputs of these UTF-8 sizes reads: a long input costs about
        a first prefix (cut by ``encode_truncated``, or refused by ``surely_too_long``), an input
        of words longer than the model reads being the rare exception that reads further."""
        first_cut = 4 * PREFIX_CHARS_PER_TOKEN * self.info.max_length  # <= 4 bytes a char
        return sum(min(n, first_cut) for n in sizes)

    def tokens(self, ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids)

    def close(self) -> None:
        self._light.shutdown(wait=False, cancel_futures=True)
        self._large.close()
