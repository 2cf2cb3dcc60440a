"""`tokq bench shards`: a tiny run on a real local Redis Cluster rewrites its block of RESULTS.md
(once, in place) with the command that made it and the 1,000-GPU estimate from its figures."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tokq.profiling.bench.shards import BLOCK, shards_command
from tokq.profiling.results_md import markers


@pytest.mark.slow
def test_tokq_bench_shards_rewrites_its_block(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nkept\n")
    args = ["--shards", "1,2", "--procs", "1", "--seconds", "0.3", "--rounds", "1", "--results-md", str(results)]
    for _ in range(2):
        done = CliRunner().invoke(shards_command, args, catch_exceptions=False)
        assert done.exit_code == 0, done.output
    text = results.read_text()
    assert text.startswith("# Results\n\nkept\n") and text.count(markers(BLOCK)[0]) == 1
    assert f"    tokq bench shards {' '.join(args)}" in text
    assert "| 1 |" in text and "| 2 |" in text and "### Estimate: 1,000 GPUs" in text
