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
    start, end = markers(BLOCK)
    results.write_text(f"# Results\n\nkept\n\n{start}\nstale figures\n{end}\n\nkept too\n")  # an earlier run's
    args = ["--shards", "1,2", "--procs", "1", "--seconds", "0.3", "--rounds", "1", "--results-md", str(results)]
    done = CliRunner().invoke(shards_command, args, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    text = results.read_text()
    assert text.startswith("# Results\n\nkept\n") and text.rstrip().endswith("kept too")
    assert text.count(start) == 1 and "stale figures" not in text
    assert f"    tokq bench shards {' '.join(args)}" in text
    assert "| 1 |" in text and "| 2 |" in text and "### Estimate: 1,000 GPUs" in text
