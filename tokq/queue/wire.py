"""Wire formats of what travels through Redis: queue entries
``<num_tokens>::<ts_ms>::<request_id>:<index>:<deadline_ms>:<attempt>:<body>``, entry bodies
(token ids and options, opaque to Lua) and per-input results (layouts: docs/internals.md).
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass

import numpy as np

FLAG_NORMALIZE = 1
FLAG_PROMPT = 2
FLAG_SEGMENT = 4  # a '<H' follows (after any prefix length): where the second segment starts
_BODY_HEAD = struct.Struct("<BBH")
_PROMPT_LEN = struct.Struct("<H")
_SEGMENT_START = struct.Struct("<H")
_RESULT_HEAD = struct.Struct("<ff")
# (width in bytes, array typecode); "H"/"I" are 2 and 4 bytes wherever CPython runs.
_ID_ARRAYS = ((2, "H"), (4, "I"))
if any(array(code).itemsize != width for width, code in _ID_ARRAYS):
    raise ImportError("array's 'H'/'I' are not 2/4 bytes here: entry bodies need them so")


def encode_body(token_ids, *, normalize: bool = True, dimensions: int = 0, prompt_len: int = 0,
                segment_start: int = 0) -> bytes:
    """Pack one item's token ids and options into an entry body. ``segment_start``: the first
    token of a pair's second segment (0: one segment)."""
    width, packed = _pack_ids(token_ids)
    if not 0 <= dimensions <= 0xFFFF:
        raise ValueError(f"dimensions {dimensions} out of range")
    size = len(packed) // width
    if not 0 <= prompt_len < size:
        raise ValueError(f"prompt_len {prompt_len} must leave at least one of {size} tokens")
    if not 0 <= segment_start < min(size, 0x10000):
        raise ValueError(f"segment_start {segment_start} must be inside the {size} tokens")
    flags = ((FLAG_NORMALIZE if normalize else 0) | (FLAG_PROMPT if prompt_len else 0)
             | (FLAG_SEGMENT if segment_start else 0))
    head = _BODY_HEAD.pack(width, flags, dimensions)
    if prompt_len:
        head += _PROMPT_LEN.pack(prompt_len)
    if segment_start:
        head += _SEGMENT_START.pack(segment_start)
    return head + packed


def _pack_ids(token_ids) -> tuple[int, bytes]:
    """(width, little-endian ids): uint16 when every id fits, else uint32. With ``array``, not
    numpy: cheaper for a query's few ids."""
    if isinstance(token_ids, np.ndarray):  # whole-array checks, not per id
        if token_ids.dtype.kind not in "iu" or token_ids.ndim != 1:
            raise ValueError("token ids must be integers")
        if not token_ids.size:
            raise ValueError("an item needs at least one token id")
        top = int(token_ids.max())
        if int(token_ids.min()) < 0 or top > 0xFFFFFFFF:
            raise ValueError("token ids must be integers in 0..2**32-1")
        width = 2 if top <= 0xFFFF else 4
        return width, token_ids.astype("<u2" if width == 2 else "<u4").tobytes()
    if not isinstance(token_ids, (list, tuple)):
        token_ids = list(token_ids)  # read twice if the first width is too narrow
    for width, code in _ID_ARRAYS:
        try:
            ids = array(code, token_ids)
        except OverflowError:  # an id past this width (or negative): try the next
            continue
        except TypeError:
            raise ValueError("token ids must be integers") from None
        if not ids:
            raise ValueError("an item needs at least one token id")
        if sys.byteorder != "little":
            ids.byteswap()
        return width, ids.tobytes()
    raise ValueError("token ids must be integers in 0..2**32-1")


@dataclass(frozen=True)
class Body:
    token_ids: np.ndarray  # int64 [n]
    normalize: bool
    dimensions: int  # 0 = the model's full dimension
    prompt_len: int = 0  # leading ids that are a shared prompt (0: none)
    segment_start: int = 0  # first id of a pair's second segment (0: one segment)


def decode_body(body: bytes) -> Body:
    width, flags, dims = _BODY_HEAD.unpack_from(body)
    if width not in (2, 4):
        raise ValueError(f"bad id width {width} in entry body")
    offset, prompt_len = _BODY_HEAD.size, 0
    if flags & FLAG_PROMPT:
        (prompt_len,) = _PROMPT_LEN.unpack_from(body, offset)
        offset += _PROMPT_LEN.size
    segment_start = 0
    if flags & FLAG_SEGMENT:
        (segment_start,) = _SEGMENT_START.unpack_from(body, offset)
        offset += _SEGMENT_START.size
    ids = np.frombuffer(body, dtype="<u2" if width == 2 else "<u4", offset=offset)
    if prompt_len >= ids.size:  # only a hint: a bad one costs speed, never the answer
        prompt_len = 0
    if segment_start >= ids.size:  # segments change the answer: refused, not guessed
        raise ValueError(f"segment start {segment_start} past the item's {ids.size} tokens")
    return Body(ids.astype(np.int64), bool(flags & FLAG_NORMALIZE), dims, prompt_len, segment_start)


@dataclass(frozen=True)
class Entry:
    """One parsed queue entry; ``raw`` is the exact bytes stored in Redis."""

    raw: bytes
    num_tokens: int
    ts_ms: int
    request_id: str
    index: int
    deadline_ms: int
    attempt: int
    body: bytes


def format_entry(num_tokens: int, ts_ms: int, request_id: str, index: int, deadline_ms: int,
                 attempt: int, body: bytes) -> bytes:
    """The bytes enqueue.lua builds (the tests check what Redis stores against it)."""
    head = f"{num_tokens}::{ts_ms}::{request_id}:{index}:{deadline_ms}:{attempt}:"
    return head.encode() + body


def parse_entry(raw: bytes) -> Entry:
    num_tokens, ts, rest = raw.split(b"::", 2)
    request_id, index, deadline, attempt, body = rest.split(b":", 4)
    return Entry(raw, int(num_tokens), int(ts), request_id.decode(), int(index), int(deadline),
                 int(attempt), body)


def encode_ok(vector: np.ndarray, queue_ms: float, inference_ms: float) -> bytes:
    return b"+" + _RESULT_HEAD.pack(queue_ms, inference_ms) + np.asarray(vector, "<f4").tobytes()


def encode_error(code: str, message: str) -> bytes:
    return b"-" + code.encode() + b":" + message.encode()


@dataclass(frozen=True)
class Result:
    ok: bool
    vector: np.ndarray | None = None  # float32 [d]
    queue_ms: float = 0.0
    inference_ms: float = 0.0
    code: str = ""  # gRPC status name when not ok
    message: str = ""


def decode_result(raw: bytes) -> Result:
    if raw[:1] == b"+":
        q, inf = _RESULT_HEAD.unpack_from(raw, 1)
        vec = np.frombuffer(raw, dtype="<f4", offset=1 + _RESULT_HEAD.size).astype(np.float32)
        return Result(True, vec, q, inf)
    if raw[:1] == b"-":
        code, _, msg = raw[1:].partition(b":")
        return Result(False, code=code.decode(), message=msg.decode(errors="replace"))
    raise ValueError(f"malformed result {raw[:16]!r}")
