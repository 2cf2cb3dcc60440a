"""`tokq bench bulk` at its smallest, on real processes: a few documents, one round, short phases;
both of its sections are rewritten in place."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from tokq.profiling.bench import bulk
from tokq.profiling.results_md import block

pytestmark = pytest.mark.slow


def test_bulk_bench_rewrites_both_sections(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKQ_LATENCY_GOAL_MS", "0")  # the worker keeps its default budget: no fit at start
    monkeypatch.setattr(bulk, "PRESSURE_S", 0.5)
    names = [f"{bulk.BLOCK} (bulk)", f"{bulk.BLOCK} (mixed)"]
    results = tmp_path / "bulk.md"
    results.write_text("# Results\n\nkept\n\n" + "\n\nbetween\n\n".join(block(n, ["stale figures"]) for n in names)
                       + "\n\nkept too\n")
    args = ["--docs", "40", "--duration-s", "2.0", "--capacity-s", "1.0", "--rounds", "1"]
    done = CliRunner().invoke(bulk.bulk_command, [*args, "--results-md", str(results)], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    text = results.read_text()
    assert text.startswith("# Results\n\nkept\n") and text.rstrip().endswith("kept too")
    assert "stale figures" not in text and text.count("\nbetween\n") == 1
    for name in names:
        assert text.count(f"<!-- {name}: start") == 1 and f"<!-- {name}: end -->" in text
    assert text.count(f"Command: `tokq bench bulk {' '.join(args)} --results-md") == 2
    assert "N = 40 seeded documents" in text and "N is below the default 50,000" in text
    for system in ("`tokq embed-file`", "`SentenceTransformer.encode", "the worker's engine alone"):
        assert re.search(rf"^\| {re.escape(system)}[^|]* \| [\d,.]+ \| [\d,]+ \| \*\*[\d.]+x\*\* \|", text, re.M)
    assert float(re.search(r"cosine to SentenceTransformer's >= ([\d.]+)", text).group(1)) > 0.999
    for phase in bulk.PHASES.values():
        assert re.search(rf"^\| {re.escape(phase)} \|", text, re.M)
    assert re.search(r"^\| batch class \| [\d,]+ / [\d,]+ \| \*\*[\d.]+x\*\* \| -?[\d,]+ \| \*\*-?\d+%\*\* \|", text, re.M)


def test_bulk_bench_parts_rewrites_only_the_chosen_section(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKQ_LATENCY_GOAL_MS", "0")
    monkeypatch.setattr(bulk, "PRESSURE_S", 0.5)
    results = tmp_path / "bulk.md"
    results.write_text("\n\n".join(block(f"{bulk.BLOCK} ({n})", [f"stale {n}"]) for n in bulk.PARTS) + "\n")
    args = ["--docs", "40", "--duration-s", "2.0", "--capacity-s", "1.0", "--rounds", "1", "--parts", "mixed",
            "--json", str(tmp_path / "raw.json")]
    done = CliRunner().invoke(bulk.bulk_command, [*args, "--results-md", str(results)], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    text = results.read_text()
    assert "stale bulk" in text and "stale mixed" not in text
    raw = json.loads((tmp_path / "raw.json").read_text())  # the raw figures: the part run, each phase's
    assert "bulk" not in raw and [set(r) for r in raw["mixed"]] == [set(bulk.PHASES)]
    assert raw["mixed"][0]["batch"]["live"]["server_queue_ms"]["p99"] >= 0
    assert re.search(r"^\| batch class \| [\d,]+ / [\d,]+ \| \*\*[\d.]+x\*\* \|", text, re.M)
    bad = CliRunner().invoke(bulk.bulk_command, ["--parts", "bulk,nope", "--results-md", str(results)])
    assert bad.exit_code == 2 and "choose among bulk, mixed" in bad.output
