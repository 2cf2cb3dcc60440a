"""Bulk work is sent in the batch priority class unless told otherwise: `tokq embed-file`
(--priority), the column embedder and the Daft and Ray integrations (priority=), against the
stand-in gateway, which records each Embed's tokq.v1.Priority. A rerun may change the class and
still resume its job."""

from __future__ import annotations

import json

import numpy as np
import pytest
from bulk_fake_gateway import FakeGateway, vector_of
from click.testing import CliRunner

from tokq.bulk.cli import embed_file_command
from tokq.bulk.column import ColumnEmbedder


def write_jsonl(path, n: int) -> list[str]:
    texts = [f"document {i} about shoes" for i in range(n)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def embed_file(*args):
    return CliRunner().invoke(embed_file_command, [str(a) for a in args], catch_exceptions=False)


def test_embed_file_sends_batch_by_default_and_priority_changes_it(tmp_path):
    texts = write_jsonl(tmp_path / "in.jsonl", 50)
    with FakeGateway(budget=64) as gateway:
        done = embed_file(tmp_path / "in.jsonl", "--out", tmp_path / "a.npy", "--target", gateway.target)
        assert done.exit_code == 0, done.output
        assert gateway.calls > 1 and gateway.priorities_seen == {"BATCH"}
        np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.stack([vector_of(t) for t in texts]))

        gateway.priorities_seen.clear()
        done = embed_file(tmp_path / "in.jsonl", "--out", tmp_path / "b.npy", "--target", gateway.target,
                          "--priority", "interactive")
        assert done.exit_code == 0, done.output
        assert gateway.priorities_seen == {"INTERACTIVE"}

        refused = embed_file(tmp_path / "in.jsonl", "--out", tmp_path / "c.npy", "--target", gateway.target,
                             "--priority", "urgent")
        assert refused.exit_code == 2 and "'urgent' is not one of 'interactive', 'batch'" in refused.output


def test_a_rerun_with_another_priority_resumes_the_same_job(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", 40)
    out = tmp_path / "out.npy"
    with FakeGateway(budget=64) as gateway:
        assert embed_file(tmp_path / "in.jsonl", "--out", out, "--target", gateway.target).exit_code == 0
        calls = gateway.calls
        again = embed_file(tmp_path / "in.jsonl", "--out", out, "--target", gateway.target,
                           "--priority", "interactive")
        assert again.exit_code == 0 and "already complete" in again.output
        assert gateway.calls == calls  # nothing sent again


def test_column_embedder_and_ray_send_batch_unless_told_otherwise():
    from tokq.integrations.ray import TokqEmbed

    texts = ["red shoes", "blue shoes", "green hat"]
    with FakeGateway() as gateway:
        with ColumnEmbedder(gateway.target) as embedder:
            embedder.embed(texts)
        assert gateway.priorities_seen == {"BATCH"}
        for priority, sent in [("interactive", "INTERACTIVE"), (None, "PRIORITY_UNSPECIFIED")]:
            gateway.priorities_seen.clear()
            with ColumnEmbedder(gateway.target, priority=priority) as embedder:
                embedder.embed(texts)
            assert gateway.priorities_seen == {sent}

        gateway.priorities_seen.clear()
        actor = TokqEmbed(gateway.target)
        try:
            out = actor({"text": np.array(texts, dtype=object)})
        finally:
            actor.embedder.close()
        np.testing.assert_array_equal(out["embedding"], np.stack([vector_of(t) for t in texts]))
        assert gateway.priorities_seen == {"BATCH"}
        gateway.priorities_seen.clear()
        actor = TokqEmbed(gateway.target, priority="interactive")
        try:
            actor({"text": np.array(texts, dtype=object)})
        finally:
            actor.embedder.close()
        assert gateway.priorities_seen == {"INTERACTIVE"}
    with pytest.raises(ValueError, match="priority must be one of 'interactive', 'batch'"):
        ColumnEmbedder("127.0.0.1:9", priority="low")  # refused before connecting


def test_daft_sends_batch_unless_told_otherwise():
    daft = pytest.importorskip("daft")
    from tokq.integrations.daft import embedder

    texts = ["red shoes", "blue shoes"]
    with FakeGateway() as gateway:
        for kwargs, sent in [({}, "BATCH"), ({"priority": "interactive"}, "INTERACTIVE")]:
            gateway.priorities_seen.clear()
            embed = embedder(gateway.target, **kwargs)
            df = daft.from_pydict({"text": texts})
            rows = df.with_column("embedding", embed(df["text"])).to_pydict()
            np.testing.assert_array_equal(np.stack(rows["embedding"]), np.stack([vector_of(t) for t in texts]))
            assert gateway.priorities_seen == {sent}
        with pytest.raises(ValueError, match="priority must be one of"):
            embedder(gateway.target, priority="BATCH")
