"""`tokq bench rerank` at its smallest: tiny cross-encoder and causal shapes, one request per
system, one round, short fairness phases; each of its sections is rewritten in place."""

from __future__ import annotations

import re

import pytest

from click.testing import CliRunner

from tokq.profiling.bench import rerank
from tokq.profiling.results_md import block

pytestmark = pytest.mark.slow


def test_rerank_bench_rewrites_each_section(tmp_path, monkeypatch):
    monkeypatch.setattr(rerank, "CROSS_ENCODER", dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                      intermediate_size=64))
    monkeypatch.setattr(rerank, "QWEN3", dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                              head_dim=16, intermediate_size=64))
    names = [f"{rerank.BLOCK} ({part})" for part in rerank.PARTS]
    results = tmp_path / "rerank.md"
    results.write_text("# Results\n\nkept\n\n" + "\n\nbetween\n\n".join(block(n, ["stale figures"]) for n in names)
                       + "\n\nkept too\n")
    args = ["--requests", "1", "--rounds", "1", "--threads", "1", "--causal-layers", "1", "--phase-s", "0.5"]
    done = CliRunner().invoke(rerank.rerank_command, [*args, "--results-md", str(results)], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    text = results.read_text()
    assert text.startswith("# Results\n\nkept\n") and text.rstrip().endswith("kept too")
    assert "stale figures" not in text and text.count("\nbetween\n") == len(names) - 1
    for name in names:
        assert text.count(f"<!-- {name}: start") == 1 and f"<!-- {name}: end -->" in text
    assert text.count(f"Command: `tokq bench rerank {' '.join(args)} --results-md") == len(names)
    assert re.search(r"^\| tokq: gateway \+ 1 worker \(1 threads\) \| 1 \| [\d,]+ \|", text, re.M)
    assert re.search(r"^\| 2 workers x 1 thread \| 1 \| [\d,]+ \| [\d,]+ / [\d,]+ \| [01]/1 \|", text, re.M)
    assert re.search(r"^\| \d+ idle, \d+ burst \|", text, re.M)
    assert re.search(r"^\| query once per request \(prefix cache\) \| \d+ \| [\d,]+ \|", text, re.M)
