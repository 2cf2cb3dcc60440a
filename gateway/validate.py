"""Checks every request passes before any real work, whatever its transport: byte caps (before
tokenizing, so a hostile input costs a length check) and token ids against the vocabulary.

The caps default from the model's max length (``Limits.resolve``; docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokq.config import GatewayConfig
from tokq.gateway.errors import InvalidArgument
from tokq.model.info import ModelInfo, first_out_of_vocab

INPUT_BYTES_PER_TOKEN = 256
REQUEST_BYTES_PER_TOKEN = 16
MAX_DEFAULT_REQUEST_BYTES = 64 << 20


class InputTooLarge(InvalidArgument):
    """Over a byte cap: INVALID_ARGUMENT on gRPC, 413 on HTTP."""

    http_status = 413


@dataclass(frozen=True)
class Limits:
    max_input_bytes: int
    max_request_bytes: int
    max_message_bytes: int  # gRPC receive limit and HTTP body limit

    @classmethod
    def resolve(cls, info: ModelInfo, config: GatewayConfig) -> Limits:
        per_input = config.max_input_bytes or info.max_length * INPUT_BYTES_PER_TOKEN
        per_request = config.max_request_bytes or min(
            MAX_DEFAULT_REQUEST_BYTES,
            max(per_input, config.max_inputs * info.max_length * REQUEST_BYTES_PER_TOKEN))
        # Room for a request twice over the caps (it gets our message naming the cap) or a full
        # request of token ids (<= 5 bytes each), plus framing.
        token_ids = config.max_inputs * info.max_length * 5
        message = config.max_message_bytes or max(2 * per_request, token_ids) + (1 << 20)
        return cls(per_input, per_request, message)


def utf8_len(text: str | bytes) -> int:
    # bytes are UTF-8 already (gRPC's inputs: gateway/wire.py). isascii() is O(1) on CPython's
    # compact strings: the common str case costs no encoding.
    if isinstance(text, bytes) or text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def check_text_sizes(texts: Sequence[str | bytes], limits: Limits) -> list[int]:
    """Each input's UTF-8 size, after checking both caps; an 8 MB string is measured, never
    tokenized. Inputs are str, or bytes holding UTF-8 not yet decoded (``decode_texts``)."""
    sizes = []
    total = 0
    for i, text in enumerate(texts):
        # a string's length in characters is a lower bound of its bytes: no encoding needed
        # to refuse one that is over by characters alone
        size = len(text) if len(text) > limits.max_input_bytes else utf8_len(text)
        if size > limits.max_input_bytes:
            raise InputTooLarge(
                f"input {i} is {size:,} bytes; the limit is {limits.max_input_bytes:,} bytes per "
                "input (max_input_bytes: --max-input-bytes / TOKQ_MAX_INPUT_BYTES)", param="input")
        total += size
        sizes.append(size)
    if total > limits.max_request_bytes:
        raise InputTooLarge(
            f"the request's inputs are {total:,} bytes; the limit is {limits.max_request_bytes:,} "
            "bytes per request (max_request_bytes: --max-request-bytes / TOKQ_MAX_REQUEST_BYTES): "
            "split the request", param="input")
    return sizes


def check_pair_sizes(query: str, documents: Sequence[str], limits: Limits) -> list[int]:
    """A rerank request's UTF-8 sizes, query first, after the same caps as inputs: the query and
    each document under the per-input cap, all of them under the per-request cap."""
    sizes = []
    for i, text in enumerate([query, *documents]):
        what, param = ("the query", "query") if i == 0 else (f"document {i - 1}", "documents")
        size = len(text) if len(text) > limits.max_input_bytes else utf8_len(text)
        if size > limits.max_input_bytes:
            raise InputTooLarge(
                f"{what} is {size:,} bytes; the limit is {limits.max_input_bytes:,} bytes per input "
                "(max_input_bytes: --max-input-bytes / TOKQ_MAX_INPUT_BYTES)", param=param)
        sizes.append(size)
    if sum(sizes) > limits.max_request_bytes:
        raise InputTooLarge(
            f"the query and documents are {sum(sizes):,} bytes; the limit is {limits.max_request_bytes:,} "
            "bytes per request (max_request_bytes: --max-request-bytes / TOKQ_MAX_REQUEST_BYTES): "
            "split the request", param="documents")
    return sizes


def decode_texts(texts: Sequence[str | bytes]) -> list[str]:
    """Inputs as str, UTF-8 bytes decoded after the caps; bad UTF-8 is refused naming the input
    and the byte."""
    out = []
    for i, text in enumerate(texts):
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise not_utf8(i, exc) from None
        out.append(text)
    return out


def not_utf8(index: int, exc: UnicodeDecodeError) -> InvalidArgument:
    return InvalidArgument(f"input {index} is not valid UTF-8 (byte {exc.start:,}): text inputs "
                           "must be UTF-8", param="input")


def check_token_ids(seqs: Sequence[Sequence[int]], info: ModelInfo) -> None:
    """INVALID_ARGUMENT for the first input holding an id outside the model's vocabulary."""
    for i, seq in enumerate(seqs):
        bad = first_out_of_vocab(seq, info.vocab_size)
        if bad is not None:
            raise InvalidArgument(f"input {i} has token id {bad!r} outside {info.name}'s vocabulary "
                                  f"(0..{info.vocab_size - 1})", param="input")
