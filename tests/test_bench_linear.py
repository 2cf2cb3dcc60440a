"""`tokq bench linear` (profiling/bench/linear.py): both fp32 kernels timed at each row count,
and its block written to a RESULTS file, replacing the old one."""

from __future__ import annotations

import re

import pytest
import torch
from click.testing import CliRunner

from tokq.profiling.bench.linear import linear_command
from tokq.workers.kernels import cpu_linear
from tokq.workers.models import layers


@pytest.mark.skipif(cpu_linear.unavailable_reason(torch.device("cpu"), torch.float32) is not None
                    or not layers._onednn_works(), reason="needs the C linear and oneDNN")
def test_bench_linear_writes_its_block(tmp_path):
    results = tmp_path / "RESULTS.md"
    for _ in range(2):
        args = ["--rows", "3,40", "--rounds", "1", "--threads", "1,2", "--results-md", str(results)]
        out = CliRunner().invoke(linear_command, args, catch_exceptions=False)
        assert out.exit_code == 0, out.output
    text = results.read_text()
    assert text.count("<!-- tokq bench linear") == 2  # one block (start and end), rewritten in place
    rows = re.findall(r"^\| (3|40) \| ([\d.]+) ms \| ([\d.]+) ms \|", text, re.M)
    assert [r[0] for r in rows] == ["3", "40"] * 2  # a table per thread count
    assert all(float(a) > 0 and float(b) > 0 for _, a, b in rows)
    assert "Command: `tokq bench linear --rows 3,40 --rounds 1 --threads 1,2 --results-md" in text
