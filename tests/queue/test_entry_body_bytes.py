"""Entry bodies (tokq/queue/wire.py): the bytes a gateway packs and a worker reads back."""

import struct

import numpy as np
import pytest

from tokq.queue.wire import FLAG_NORMALIZE, FLAG_PROMPT, decode_body, encode_body


def test_a_body_is_its_head_then_little_endian_uint16_ids():
    body = encode_body([101, 2054, 102], dimensions=8)
    assert body == struct.pack("<BBH", 2, FLAG_NORMALIZE, 8) + struct.pack("<3H", 101, 2054, 102)


def test_ids_past_uint16_take_four_bytes_each():
    # Qwen-sized vocabularies (151k ids): every id of the item is then written as uint32.
    body = encode_body([151_000, 5], normalize=False, prompt_len=1)
    assert body == (struct.pack("<BBH", 4, FLAG_PROMPT, 0) + struct.pack("<H", 1)
                    + struct.pack("<2I", 151_000, 5))
    decoded = decode_body(body)
    assert decoded.token_ids.tolist() == [151_000, 5]
    assert (decoded.normalize, decoded.prompt_len) == (False, 1)


@pytest.mark.parametrize("ids", [
    [0, 65_535], (7, 8, 9), range(3, 6), np.arange(1000, 1010), np.array([1, 70_000], dtype=np.int64),
    np.array([3, 4], dtype=np.uint64), (i for i in [70_000, 2])])
def test_any_sequence_of_integer_ids_round_trips(ids):
    expected = [int(i) for i in ids] if not hasattr(ids, "__next__") else [70_000, 2]
    assert decode_body(encode_body(ids)).token_ids.tolist() == expected


@pytest.mark.parametrize("ids, message", [
    ([], "at least one"), (np.array([], dtype=np.int64), "at least one"),
    ([-1], r"0\.\.2\*\*32-1"), ([2 ** 32], r"0\.\.2\*\*32-1"),
    ([1.5], "integers"), (np.array([1.0]), "integers"), (["7"], "integers"), (np.ones((2, 2), int), "integers")])
def test_ids_that_are_not_token_ids_are_refused(ids, message):
    with pytest.raises(ValueError, match=message):
        encode_body(ids)


def test_options_out_of_range_are_refused():
    with pytest.raises(ValueError, match="dimensions"):
        encode_body([1, 2], dimensions=70_000)
    with pytest.raises(ValueError, match="prompt_len"):
        encode_body([1, 2], prompt_len=2)
