"""Smoke tests run each benchmark for real at its smallest size: ``bench(command, args, block)``
invokes it with ``--results-md`` on a file holding another section and a stale copy of its own
block, and returns the file's text once the block was rewritten in place."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tokq.profiling.results_md import block


@pytest.fixture
def bench(tmp_path, monkeypatch):
    # workers keep their device's default budget: no fit to this moment's speed at start
    monkeypatch.setenv("TOKQ_LATENCY_GOAL_MS", "0")

    def run(command, args: list[str], name: str) -> str:
        results = tmp_path / "results.md"
        results.write_text("# Results\n\nkept\n\n" + block(name, ["stale figures"]) + "\n\nkept too\n")
        done = CliRunner().invoke(command, [*args, "--results-md", str(results)], catch_exceptions=False)
        assert done.exit_code == 0, done.output
        text = results.read_text()
        assert text.startswith("# Results\n\nkept\n") and text.rstrip().endswith("kept too")
        assert text.count(f"<!-- {name}: start") == 1 and "stale figures" not in text
        return text
    return run
