"""The gateway's tokenizer: limits named in errors, and safe under concurrent calls."""

from __future__ import annotations

import asyncio

import pytest

from tokq.gateway.errors import InvalidArgument
from tokq.gateway.tokenize import Tokenizer
from tokq.model_info import ModelInfo


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(ModelInfo.load(), num_threads=2)
    yield tok
    tok.close()


def test_over_long_input_names_the_limit_unless_truncated(tokenizer):
    long_text = "word " * 400
    with pytest.raises(InvalidArgument, match="input 1 is 402 tokens long.*at most 256"):
        tokenizer.encode_sync(["short", long_text])
    ids = tokenizer.encode_sync(["short", long_text], truncate=True)
    assert len(ids[1]) == 256 and ids[1][-1] == ids[0][-1]  # still ends with [SEP]


async def test_concurrent_calls_with_and_without_truncation_do_not_mix(tokenizer):
    # A fast tokenizer keeps its truncation setting as state: shared across threads, calls
    # without truncation came back cut and truncated ones came back over the limit.
    long_text, medium_text = "word " * 400, "word " * 200  # 402 and 202 tokens
    calls = []
    for i in range(100):
        calls.append(tokenizer.encode([long_text] * 64, truncate=True))
        calls.append(tokenizer.encode([medium_text] * 64, truncate=False))
    results = await asyncio.gather(*calls)
    truncated, full = results[0::2], results[1::2]
    assert {len(seq) for r in truncated for seq in r} == {256}
    assert {len(seq) for r in full for seq in r} == {202}
