"""The gRPC reply is written as bytes (gateway/wire.py ``embed_response``, no Python float per
value): the bytes protobuf writes for the same message, for any vectors, model, usage and timing,
keeping every bit; and Embed's requests are read with their inputs as UTF-8 bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tokq.gateway.wire import embed_response
from tokq.v1 import embedder_pb2 as pb

TIMING_NAMES = ("tokenize_ms", "queue_ms", "inference_ms", "total_ms")


def _reference(vectors, model, num_tokens, timing) -> bytes:
    return pb.EmbedResponse(
        embeddings=[pb.Embedding(values=v.tolist()) for v in vectors], model=model,
        usage=pb.Usage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        timing=pb.Timing(**timing)).SerializeToString()


@settings(deadline=None, max_examples=150)
@given(vectors=st.lists(arrays(np.float32, st.integers(1, 600), elements=st.floats(width=32, allow_nan=False)),
                        max_size=4),
       model=st.text(max_size=40), num_tokens=st.integers(0, 2 ** 32 - 1),
       timing=st.fixed_dictionaries({name: st.one_of(st.floats(allow_nan=False), st.sampled_from([0.0, -0.0]))
                                     for name in TIMING_NAMES}))
def test_embed_response_bytes_are_protobuf_s_bytes(vectors, model, num_tokens, timing):
    got = embed_response(vectors, model, num_tokens, timing)
    assert got == _reference(vectors, model, num_tokens, timing)
    parsed = pb.EmbedResponse.FromString(got)
    assert [np.array(e.values, dtype=np.float32).tobytes() for e in parsed.embeddings] == [v.tobytes() for v in vectors]


def test_embed_response_keeps_nan_and_infinities_and_takes_any_float_view():
    timing = dict.fromkeys(TIMING_NAMES, 1.5)
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45], dtype=np.float32)
    parsed = pb.EmbedResponse.FromString(embed_response([special], "m", 3, timing))
    assert np.array(parsed.embeddings[0].values, dtype=np.float32).tobytes() == special.tobytes()
    view = np.arange(20, dtype=np.float64)[::2]  # non-contiguous, float64: converted, not misread
    parsed = pb.EmbedResponse.FromString(embed_response([view], "m", 3, timing))
    assert list(parsed.embeddings[0].values) == view.tolist()


@pytest.mark.parametrize("name", ["EmbedRequest", "TokenizeRequest"])
def test_requests_are_read_with_inputs_as_utf8_bytes_and_nothing_else_changed(name):
    from tokq.gateway import wire

    published, ours = getattr(pb, name).DESCRIPTOR, getattr(wire, f"{name}Utf8").DESCRIPTOR
    assert published.full_name == ours.full_name
    fields = {f.name: (f.number, f.type, f.is_repeated, f.has_presence) for f in published.fields}
    read = {f.name: (f.number, f.type, f.is_repeated, f.has_presence) for f in ours.fields}
    assert read.pop("inputs")[1] == ours.fields_by_name["inputs"].TYPE_BYTES
    assert fields.pop("inputs")[1] == published.fields_by_name["inputs"].TYPE_STRING
    assert read == fields


@settings(deadline=None, max_examples=100)
@given(st.lists(st.text(), max_size=5), st.booleans(), st.one_of(st.none(), st.booleans()),
       st.one_of(st.none(), st.integers(0, 4096)), st.one_of(st.none(), st.text(max_size=10)),
       st.lists(st.lists(st.integers(0, 2**31), max_size=5), max_size=3))
def test_any_published_request_reads_the_same_with_its_inputs_as_their_utf8(
        inputs, truncate, normalize, dimensions, prompt_name, token_inputs):
    from tokq.gateway.wire import EmbedRequestUtf8

    sent = pb.EmbedRequest(inputs=inputs, model="m", truncate=truncate, normalize=normalize,
                           dimensions=dimensions, prompt_name=prompt_name,
                           token_inputs=[pb.TokenIds(ids=ids) for ids in token_inputs])
    read = EmbedRequestUtf8.FromString(sent.SerializeToString())
    assert list(read.inputs) == [t.encode("utf-8") for t in inputs]
    for name in ("model", "truncate", "normalize", "dimensions", "prompt_name"):
        assert getattr(read, name) == getattr(sent, name)
        if name in ("normalize", "dimensions", "prompt_name"):
            assert read.HasField(name) == sent.HasField(name)
    assert [list(t.ids) for t in read.token_inputs] == token_inputs
