"""Daft and Ray Data on a tokq fleet: the column embedder they share (against the stand-in
gateway: order, failed rows raised or left null), and docs/bulk.md's two examples run as written
against a real deployment, their vectors equal to sentence-transformers'."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bulk_fake_gateway import DIMS, FakeGateway, vector_of

from tokq.bulk.column import ColumnEmbedder, RowsFailed

DOCS = Path(__file__).resolve().parents[2] / "docs" / "bulk.md"


def example(heading: str) -> str:
    """The first python block under ``## heading`` in docs/bulk.md."""
    section = DOCS.read_text().split(f"\n## {heading}\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 10, f"the {heading} example is over ten lines"
    return code


def test_column_embedder_keeps_order_and_says_which_rows_failed():
    texts = [f"row {i}" for i in range(300)]
    with FakeGateway(budget=128) as gateway, ColumnEmbedder(gateway.target) as embedder:
        assert embedder.dimensions == DIMS and embedder.model == "fake-model"
        np.testing.assert_array_equal(embedder.embed(texts), np.stack([vector_of(t) for t in texts]))
        assert gateway.calls > 3  # split into requests of about half a budget
        bad = ["fine", None, "", "TOOLONG x", 7, "also fine"]
        with pytest.raises(RowsFailed, match="4 rows could not be embedded: row 1: the text is null; row 2: "
                                             "empty text; row 3: INVALID_ARGUMENT: the text is 999 tokens long"):
            embedder.embed(bad)
    with FakeGateway() as gateway, ColumnEmbedder(gateway.target, on_error="null", truncate=True) as embedder:
        vectors, errors = embedder.embed_with_errors(bad)
        assert sorted(errors) == [1, 2, 4] and errors[4] == "the text is a int, not a string"
        assert np.isnan(vectors[[1, 2, 4]]).all()
        np.testing.assert_array_equal(vectors[3], vector_of("TOOLONG x"))
    with pytest.raises(ValueError, match="on_error must be one of raise, null"):
        ColumnEmbedder("127.0.0.1:9", on_error="skip")


@pytest.fixture(scope="module")
def stack():
    from service_stack import gateway_and_worker

    with gateway_and_worker() as s:
        yield s


@pytest.fixture(scope="module")
def docs(bundled_model_dir, tmp_path_factory):
    """docs.parquet (id, text) in a folder of its own, and sentence-transformers' vectors by id."""
    import random

    from sentence_transformers import SentenceTransformer

    words = [w.strip() for w in open(bundled_model_dir / "vocab.txt", encoding="utf-8")
             if w.strip().isalpha() and w.strip().islower() and len(w.strip()) > 2][:20000]
    rng = random.Random(7)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 25))) for _ in range(200)]
    folder = tmp_path_factory.mktemp("docs")
    pq.write_table(pa.table({"id": list(range(200)), "text": texts}), folder / "docs.parquet", row_group_size=64)
    model = SentenceTransformer(str(bundled_model_dir), device="cpu")
    return folder, model.encode(texts, batch_size=64, normalize_embeddings=True)


def run_example(heading: str, target: str, folder: Path) -> None:
    """The example as written, but for the gateway's address and its files' folder (a Ray
    worker does not share the test's working directory)."""
    code = example(heading)
    for name, value in [("localhost:50051", target), ("docs.parquet", f"{folder}/docs.parquet"),
                        ("embedded/", f"{folder}/embedded/")]:
        assert f'"{name}"' in code
        code = code.replace(f'"{name}"', repr(value))
    exec(compile(code, f"docs/bulk.md ({heading})", "exec"), {"__name__": "__example__"})


def written(folder: Path) -> tuple[list[int], np.ndarray]:
    table = pq.read_table(folder / "embedded", columns=["id", "embedding"])
    ids = table.column("id").to_pylist()
    column = table.column("embedding").combine_chunks()
    if isinstance(column.type, pa.ExtensionType):  # Ray's tensor column
        column = column.storage
    dims = len(column[0])
    values = column.flatten().to_numpy(zero_copy_only=False)
    return ids, values.reshape(-1, dims).astype(np.float32)


def assert_matches(ids: list[int], got: np.ndarray, want: np.ndarray) -> None:
    assert sorted(ids) == list(range(len(want)))
    want = want[ids]
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999, f"min cosine {cos.min()}"


@pytest.mark.slow
def test_the_daft_example_embeds_a_column_on_the_fleet(stack, docs, tmp_path):
    folder, want = docs
    (tmp_path / "docs.parquet").symlink_to(folder / "docs.parquet")
    run_example("Daft", stack.target, tmp_path)
    ids, got = written(tmp_path)
    assert got.shape == (200, 384)
    assert_matches(ids, got, want)


@pytest.mark.slow
def test_the_ray_example_embeds_a_column_on_the_fleet(stack, docs, tmp_path):
    import ray

    folder, want = docs
    (tmp_path / "docs.parquet").symlink_to(folder / "docs.parquet")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        run_example("Ray Data", stack.target, tmp_path)
    finally:
        ray.shutdown()
    ids, got = written(tmp_path)
    assert got.shape == (200, 384)
    assert_matches(ids, got, want)
