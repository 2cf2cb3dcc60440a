"""`tokq embed-file` against a real deployment (Redis, a gateway and a worker process, the bundled
all-MiniLM-L6-v2): vectors equal sentence-transformers', over-long rows fail or are cut as asked,
and a run killed with -9 or beside a gateway or Redis restart ends with the file an uninterrupted
run writes."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from service_stack import gateway_and_worker

from tokq.bulk.store import errors_path, parts_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack():
    with gateway_and_worker() as s:
        yield s


@pytest.fixture(scope="module")
def words(bundled_model_dir):
    return [w.strip() for w in open(bundled_model_dir / "vocab.txt", encoding="utf-8")
            if w.strip().isalpha() and w.strip().islower() and len(w.strip()) > 2][:20000]


@pytest.fixture(scope="module")
def reference(bundled_model_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(bundled_model_dir), device="cpu")
    return lambda texts: model.encode(texts, batch_size=64, normalize_embeddings=True)


def write_docs(path, words, n: int, seed: int, extra: dict[int, str] | None = None) -> list[str]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) for _ in range(n)]
    for i, text in (extra or {}).items():
        texts[i] = text
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    return texts


def embed_file(*args, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokq.cli", "embed-file", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout_s)


def spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tokq.cli", "embed-file", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_parts(output, count: int, proc: subprocess.Popen, timeout_s: float = 120) -> int:
    """Rows committed once at least ``count`` parts are."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = list(parts_path(output).glob("rows-*.arrow")) if parts_path(output).exists() else []
        if len(names) >= count:
            return sum(int(n.name[18:30]) - int(n.name[5:17]) for n in names)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} parts committed in {timeout_s} s")


def vectors(path) -> tuple[list, np.ndarray]:
    table = pq.read_table(path)
    return table.column("id").to_pylist(), np.array(table.column("embedding").to_pylist(), np.float32)


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999, f"min cosine {cos.min()}"


def test_vectors_equal_sentence_transformers_and_long_rows_fail_or_are_cut(stack, words, reference, tmp_path):
    long_text = " ".join(random.Random(5).choice(words) for _ in range(400))  # over 256 tokens
    texts = write_docs(tmp_path / "in.jsonl", words, 300, seed=1, extra={17: long_text})
    out = tmp_path / "out.parquet"
    done = embed_file(tmp_path / "in.jsonl", "--out", out, "--id-field", "id", "--target", stack.target)
    assert done.returncode == 3, done.stderr
    assert "1 rows failed" in done.stdout
    (error,) = [json.loads(line) for line in errors_path(out).read_text().splitlines()]
    assert error["row"] == 17 and error["id"] == 17
    assert error["reason"].startswith("INVALID_ARGUMENT: the text is") and "truncate" in error["reason"]
    ids, got = vectors(out)
    assert ids == [i for i in range(300) if i != 17]
    assert_close(got, reference([t for i, t in enumerate(texts) if i != 17]))
    cut = tmp_path / "cut.parquet"
    done = embed_file(tmp_path / "in.jsonl", "--out", cut, "--id-field", "id", "--truncate", "--target", stack.target)
    assert done.returncode == 0, done.stderr
    ids, got = vectors(cut)
    assert ids == list(range(300))
    assert_close(got, reference(texts))  # sentence-transformers cuts at max_seq_length too
    assert not errors_path(cut).exists()


def test_kill_9_mid_run_then_rerun_writes_what_an_uninterrupted_run_writes(stack, words, tmp_path):
    write_docs(tmp_path / "in.jsonl", words, 800, seed=2)
    args = [tmp_path / "in.jsonl", "--id-field", "id", "--commit-rows", 40, "--target", stack.target]
    whole = embed_file(*args, "--out", tmp_path / "whole.parquet")
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "out.parquet"
    proc = spawn(*args, "--out", out)
    wait_for_parts(out, 4, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    committed = sum(int(n.name[18:30]) - int(n.name[5:17]) for n in parts_path(out).glob("rows-*.arrow"))
    done = embed_file(*args, "--out", out)
    assert done.returncode == 0, done.stderr
    # the rerun embedded only the rows not committed
    assert f"({800 - committed:,} this run, {committed:,} committed before)" in done.stdout
    ids, got = vectors(out)
    want_ids, want = vectors(tmp_path / "whole.parquet")
    assert ids == want_ids == list(range(800))
    np.testing.assert_allclose(got, want, atol=2e-6)
    assert pq.read_schema(out).metadata == pq.read_schema(tmp_path / "whole.parquet").metadata


def restart_gateway(stack) -> None:
    stack.kill_gateway()  # kill -9: calls in flight lose their connection
    time.sleep(1)
    stack.start_gateway()
    stack.wait_ready()


def restart_redis(stack) -> None:
    stack.redis.stop()  # no persistence: queued work and replies are gone, as in a crash
    time.sleep(0.5)
    stack.redis.start()


@pytest.mark.parametrize("restart", [restart_gateway, restart_redis], ids=["gateway", "redis"])
def test_a_restart_mid_run_is_survived(stack, words, reference, tmp_path, restart):
    texts = write_docs(tmp_path / "in.jsonl", words, 600, seed=3)
    out = tmp_path / "out.parquet"
    proc = spawn(tmp_path / "in.jsonl", "--out", out, "--id-field", "id", "--commit-rows", 25,
                 "--target", stack.target, "--timeout", 30)
    try:
        wait_for_parts(out, 2, proc)
        restart(stack)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "retrying" in stderr
    ids, got = vectors(out)
    assert ids == list(range(600))
    assert_close(got, reference(texts))
