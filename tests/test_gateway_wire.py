"""The gRPC reply's vectors are built from their bytes (no Python float per value): the message
is the one building it from a list gives, for any length and value, and keeps every bit."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tokq.gateway.service import _embedding
from tokq.v1 import embedder_pb2 as pb


@settings(deadline=None, max_examples=60)
@given(arrays(np.float32, st.integers(1, 5000), elements=st.floats(width=32, allow_nan=False)))
def test_embedding_from_bytes_is_the_embedding_from_a_list(vector):
    got = _embedding(vector)
    assert got.SerializeToString() == pb.Embedding(values=vector.tolist()).SerializeToString()
    assert np.array(got.values, dtype=np.float32).tobytes() == vector.tobytes()


def test_embedding_keeps_nan_and_infinities_and_takes_any_float_view():
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45], dtype=np.float32)
    assert np.array(_embedding(special).values, dtype=np.float32).tobytes() == special.tobytes()
    view = np.arange(20, dtype=np.float64)[::2]  # non-contiguous, float64: converted, not misread
    assert list(_embedding(view).values) == view.tolist()


def test_embed_requests_are_read_with_inputs_as_utf8_bytes_and_nothing_else_changed():
    from tokq.gateway.wire import EmbedRequestUtf8

    published, ours = pb.EmbedRequest.DESCRIPTOR, EmbedRequestUtf8.DESCRIPTOR
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
