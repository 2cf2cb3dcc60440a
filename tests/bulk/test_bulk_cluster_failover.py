"""`tokq embed-file` across a Redis Cluster primary failover: a real loopback cluster (3 primaries,
a replica each), a gateway and a worker of the bundled all-MiniLM-L6-v2 on it, the queue in 6
shards (two on each primary). Mid-job the primary holding shard 0 (the budget, the heartbeats)
is killed -9 and its replica takes over. The job finishes by itself, or stops and a rerun of the
same command finishes it; either way the output is the file an uninterrupted run writes, and no
committed part is written again.

The cluster is this module's own (a node is killed)."""

from __future__ import annotations

import json
import os
import random
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from cluster_support import local_cluster
from service_stack import ServiceStack
from test_bulk_real_fleet import embed_file, spawn, vectors, wait_for_parts

from tokq.bulk.store import PART_RE, errors_path, parts_path
from tokq.queue.keys import QueueKeys, shard_queue_name

pytestmark = pytest.mark.slow
SHARDS = 6  # the bundled model's shards land two on each of the 3 primaries
ROWS = 3000
COMMIT_ROWS = 100


@pytest.fixture(scope="module")
def stack():
    with local_cluster(num_primaries=3, replicas_per_primary=1) as cluster:
        # A short lease, so a batch whose ack the failover lost is redone within seconds.
        s = ServiceStack(env={"TOKQ_QUEUE_SHARDS": str(SHARDS), "TOKQ_LEASE_MS": "2000"}, cluster=cluster)
        try:
            s.start_gateway()
            s.start_worker("w1")
            s.wait_ready()
            yield s
        finally:
            s.close()


@pytest.fixture(scope="module")
def words(bundled_model_dir):
    return [w.strip() for w in open(bundled_model_dir / "vocab.txt", encoding="utf-8")
            if w.strip().isalpha() and w.strip().islower() and len(w.strip()) > 2][:20000]


def write_short_docs(path, words, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))}) + "\n")


class PartWatch:
    """Records each committed part's inode while a job runs: a part renamed into place twice
    (its rows embedded again after their commit) shows as a second inode under one name."""

    def __init__(self, output) -> None:
        self.parts = parts_path(output)
        self.inodes: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for entry in os.scandir(self.parts):
                    if PART_RE.match(entry.name):
                        self.inodes.setdefault(entry.name, set()).add(entry.inode())
            except OSError:  # not made yet, or removed once the output is written
                pass
            time.sleep(0.01)

    def stop(self) -> dict[str, set[int]]:
        self._stop.set()
        self._thread.join()
        return self.inodes


def committed_rows(output) -> int:
    return sum(int(m[2]) - int(m[1]) for p in parts_path(output).glob("rows-*.arrow")
               if (m := PART_RE.match(p.name)))


def test_a_primary_failover_mid_job_ends_with_what_an_uninterrupted_run_writes(stack, words, tmp_path):
    cluster = stack.cluster
    queue = stack.keys.queue
    shard_owners = [cluster.owner_port(QueueKeys(shard_queue_name(queue, s)).pending) for s in range(SHARDS)]
    assert set(shard_owners) == set(cluster.primary_ports()), shard_owners  # work on every primary
    write_short_docs(tmp_path / "in.jsonl", words, ROWS, seed=7)
    args = [tmp_path / "in.jsonl", "--id-field", "id", "--commit-rows", COMMIT_ROWS,
            "--target", stack.target, "--timeout", 30]
    whole = embed_file(*args, "--out", tmp_path / "whole.parquet")
    assert whole.returncode == 0, whole.stderr

    out = tmp_path / "out.parquet"
    watch = PartWatch(out)
    proc = spawn(*args, "--out", out)
    try:
        wait_for_parts(out, 3, proc)
        victim = shard_owners[0]
        cluster.kill(victim)
        assert proc.poll() is None, "the job ended before the primary died"
        cluster.wait_ok(timeout_s=60)  # its replica took over its slots
        assert cluster.owner_port(QueueKeys(queue).pending) != victim
        assert proc.poll() is None or committed_rows(out) < ROWS, "the job had no rows left after the failover"
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"first run: exit {proc.returncode}\n{stdout}{stderr}")
    if proc.returncode != 0:  # stopped: a rerun of the same command continues it
        assert proc.returncode == 1, stderr
        assert "rerun the same command" in stderr, stderr
        committed = committed_rows(out)
        done = embed_file(*args, "--out", out)
        assert done.returncode == 0, done.stderr
        # the rerun embedded only the rows not committed
        assert f"({ROWS - committed:,} this run, {committed:,} committed before)" in done.stdout
    else:
        assert f"({ROWS:,} this run)" in stdout
    seen = watch.stop()
    assert len(seen) >= 3, seen  # the watch saw the parts committed before the kill at least
    rewritten = {name: inodes for name, inodes in seen.items() if len(inodes) > 1}
    assert not rewritten, f"parts committed twice: {sorted(rewritten)}"
    assert not parts_path(out).exists()
    assert not errors_path(out).exists()  # no row failed
    ids, got = vectors(out)
    want_ids, want = vectors(tmp_path / "whole.parquet")
    assert ids == want_ids == list(range(ROWS))
    np.testing.assert_allclose(got, want, atol=2e-6)
    assert pq.read_schema(out).metadata == pq.read_schema(tmp_path / "whole.parquet").metadata
