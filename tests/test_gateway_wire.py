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
