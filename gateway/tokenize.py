"""Tokenization off the event loop, in two lanes, with truncation that costs what the model reads.

- Each thread has its own copy of the model's fast (Rust) tokenizer; calls release the GIL.
- Tiny requests (a search query) are tokenized on the event loop: cheaper than any thread hop;
  one ``encode`` call per text, and ASCII text without the normalizer (gateway/ascii_text.py).
- Two thread pools: ordinary requests on one sized to the cores, large ones (by bytes to tokenize)
  on a second pool with half as many threads. Large requests then wait for each other and
  never take every core or every thread: a one-word query behind six 8 MB callers still finds a
  free thread in its own lane and a core to run on. The large lane (``large_lane``) runs at a
  lower CPU priority and, while light calls are being served, takes at most its share of time.
- truncate=true tokenizes a prefix, not the whole string (``encode_truncated``): an 8 MB input
  costs about what a max-length one does, and the ids are those of tokenizing it all (see there).
  Without truncate=true, a long input is refused from its prefix too (``surely_too_long``).
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
from tokq.gateway.validate import decode_texts, not_utf8
from tokq.host import usable_cpus
from tokq.model.info import ModelInfo

# Our pools are the parallelism; the Rust tokenizer's own (rayon) would let one large batch
# take every core and undo the lanes. An operator's explicit setting still wins.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Requests with at most this many bytes to tokenize run on the event loop: tokenizing a search
# query (tens of microseconds) costs less than the hop to a pool thread and back (a submit, two
# wake-ups; ~5% of the gateway's CPU per call by py-spy), and holds the loop no longer.
INLINE_BYTES = 256

# Pool threads started, with their tokenizer copies, when a Tokenizer is made.
STARTED_THREADS = 4

# First prefix tried for truncate=true, in characters per token kept: ordinary text runs 3-5
# characters a token, so one tokenization of a prefix this long nearly always suffices.
PREFIX_CHARS_PER_TOKEN = 8


def encode_truncated(backend: RustTokenizer, text: str, max_length: int) -> list[int]:
    """``text``'s ids truncated to ``max_length`` (special tokens included), equal to tokenizing
    all of ``text`` with right-side truncation, while reading only a prefix of it. ``backend``
    must have truncation and padding off.

    Why a prefix gives the same ids: the normalizer works per character and the pre-tokenizer cuts
    words by local context, so every word of the prefix except the last (which the cut may have
    split) is a word of the whole text too, at the same place; the model then tokenizes each word
    on its own. So when the first ``k`` tokens of the prefix all come from words before its last
    one, they are the first ``k`` tokens of the whole text. Otherwise the prefix doubles; at worst
    it becomes the whole text, the exact path. Tokens with no word id (added tokens) end the
    shortcut: that case takes the next, longer prefix.
    """
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
    """True when ``text`` has more than ``max_length`` tokens for certain, read from a prefix (or
    from ever longer ones, short of the whole text): the prefix's first tokens are settled (as in
    ``encode_truncated``) and more follow. A long text sent without truncate=true is then refused
    for about the price of a max-length one. False means "not known from a prefix": the full
    tokenization decides."""
    return first_surely_too_long(backend, [text], max_length) == 0


def first_surely_too_long(backend: RustTokenizer, texts: list[str] | list[bytes],
                          max_length: int) -> int | None:
    """The index of the first text ``surely_too_long`` says is, else None. Texts may be UTF-8
    bytes (gRPC's inputs): only the prefixes read are decoded, so a request refused here never
    decodes the rest of its megabytes.

    One text at a time, its prefix doubling until it settles the question or is the whole text
    (then the full tokenization decides), stopping at the first text found too long: a request of
    32 inputs at the byte cap is refused for one input's prefixes, not 32 (bench hostile's
    gateway-bound row spent 85% of the gateway's CPU here). Text of long words (~9 characters a
    token) takes a second, doubled prefix rather than moving on to the next input's first."""
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
        self._ascii = AsciiPath(backend)  # used on the event loop's thread only
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
        """Start the ordinary pool's first threads now, each with its tokenizer copy, and this
        thread's (the event loop's, in a gateway): made on a thread's first call instead (~25 ms
        for MiniLM's, far more for a 150k vocabulary), a copy would hold up that call and, under
        load, the event loop (deepcopy holds the GIL). At most ``STARTED_THREADS``: on a host of
        many cores the rest start as calls need them."""
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

    def _backend_copy(self) -> RustTokenizer:
        tok = getattr(self._local, "tok", None)
        if tok is None:
            tok = self._local.tok = copy.deepcopy(self._backend)
        return tok

    def encode_sync(self, texts: list[str] | list[bytes], *, prompt: str = "",
                    truncate: bool = False) -> list[list[int]]:
        """Ids per text; texts may be UTF-8 bytes (``validate.decode_texts``), decoded here."""
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

    def _encode_small(self, texts: list[str] | list[bytes], prompt: str) -> list[list[int]] | None:
        """A tiny request's ids, one ``encode`` call per text (no truncation to set up, no GIL
        to give up and take back), ASCII text through ``AsciiPath``; None when a text needs
        ``encode_sync`` instead (it is too long, or not UTF-8: that path says which byte)."""
        out = []
        for text in texts:
            if isinstance(text, bytes):
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError:
                    return None
            text = prompt + text
            ids = self._ascii.encode(text)
            if ids is None:
                ids = self._backend_copy().encode(text).ids
            if len(ids) > self.info.max_length:  # truncate, or refuse: encode_sync decides
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
            ids = self._encode_small(texts, prompt)
            return ids if ids is not None else self.encode_sync(texts, prompt=prompt, truncate=truncate)
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
