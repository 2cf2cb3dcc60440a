"""`tokq bench --budget-check`: the profiled budget judged against fixed budgets from the
numbers, its own RESULTS.md section beside the main one, and the whole command end to end."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from tokq.profiling import workload
from tokq.profiling.bench.service import budget as bench_budget
from tokq.profiling.bench.service import report as bench_report
from tokq.profiling.bench.service.run import BenchOptions, machine
from tokq.profiling.profile.knee import fit_knee, recommend_budget

GRID = [16, 32, 64, 128, 256, 512, 1024, 2048]


def profile_report(slo_ms: float = 500.0) -> dict:
    """A profile report of a CPU-shaped curve (2.7 ms + 0.25 ms per token)."""
    x = np.array(GRID, float)
    y = 2.7 + 0.25 * x
    fit = fit_knee(x, y)
    rec = recommend_budget(x, y, fit, slo_ms)
    points = [{"num_tokens": int(t), "median_ms": float(ms), "p10_ms": float(ms), "p90_ms": float(ms),
               "tokens_per_s": float(t / ms * 1000)} for t, ms in zip(x, y)]
    return {"model": "all-MiniLM-L6-v2", "device": "cpu", "device_name": "test CPU, 1 thread", "dtype": "float32",
            "threads": 1, "points": points, "fit": fit.to_dict(), "knee_tokens": fit.knee_tokens,
            "recommendation": rec.to_dict(), "recommended_budget": rec.token_budget,
            "saturation": {"fraction": rec.saturation_fraction, "tokens": rec.throughput_cap_tokens,
                           "peak_tokens_per_s": rec.peak_tokens_per_s},
            "summary": f"Recommended token budget: {rec.token_budget}, limited by {rec.limited_by}."}


def tokq_system(budget: int, rps: float) -> dict:
    return {"name": f"tokq look-ahead b{budget}", "kind": "tokq", "token_budget": budget, "sustainable_rps": rps,
            "sustainable": {"latency_ms": {"p99": 400.0}, "batches": {"tokens_per_batch": budget * 0.8}},
            "steps": [], "limit": "p99 over SLO", "half_load": None}


def report(rates: dict[int, float], profiled: int, fixed: list[int]) -> dict:
    return {"meta": {"command": "tokq bench --budget-check", "started_at": "2026-01-01T00:00:00+00:00",
                     "finished_at": "2026-01-01T00:06:00+00:00", "duration_s": 360.0, "machine": machine(),
                     "options": {**BenchOptions(num_refinements=3).__dict__},
                     "workload": workload.describe(workload.generate(100)), "note": "test",
                     "forward_ms_by_budget": {str(b): 2.7 + 0.25 * b for b in rates},
                     "loadavg_at_end": ["1.0", "1.0", "1.0"],
                     "other_processes_cpu": {"cpu_s": 3.0, "share_of_machine": 0.01}},
            "systems": [tokq_system(b, r) for b, r in rates.items()],
            "budget_check": {"device": "cpu", "profile": profile_report(), "profiled_budget": profiled,
                             "fixed_budgets": fixed}}


def test_profiled_budget_within_ten_percent_of_the_best_fixed_one_passes():
    r = report({64: 250.0, 256: 390.0, 1024: 345.0, 181: 370.0}, profiled=181, fixed=[64, 256, 1024])
    v = bench_budget.verdict(r)
    assert (v["best_fixed_budget"], v["best_fixed_rps"], v["profiled_rps"]) == (256, 390.0, 370.0)
    assert v["ratio"] == pytest.approx(370 / 390, abs=1e-3) and v["passes"]
    section = bench_budget.markdown_section(r)
    assert "181 tokens sustains 370 req/s" in section and "0.95x, **met**" in section
    assert "| 181 (profiled) |" in section and "| 256 (fixed) |" in section
    assert f"shared {os.cpu_count()}-CPU machine" in section and "load average" in section


def test_a_run_where_no_batch_filled_any_budget_says_the_budget_did_not_bind():
    r = report({64: 77.0, 256: 50.0, 1024: 57.0}, profiled=256, fixed=[64, 256, 1024])
    for s in r["systems"]:
        s["sustainable"]["batches"]["tokens_per_batch"] = 35.0
    assert "did not bind" in bench_budget.markdown_section(r)
    for s in r["systems"]:
        s["sustainable"]["batches"]["tokens_per_batch"] = 60.0  # 64's batches were full
    assert "did not bind" not in bench_budget.markdown_section(r)


def test_profiled_budget_further_than_ten_percent_behind_fails():
    r = report({64: 250.0, 256: 390.0, 45: 265.0}, profiled=45, fixed=[64, 256])
    v = bench_budget.verdict(r)
    assert v["ratio"] == pytest.approx(265 / 390, abs=1e-3) and not v["passes"]
    assert "**not met**" in bench_budget.markdown_section(r)


def test_a_profiled_budget_among_the_fixed_ones_is_measured_once():
    r = report({64: 250.0, 256: 390.0, 1024: 345.0}, profiled=256, fixed=[64, 256, 1024])
    v = bench_budget.verdict(r)
    assert v["profiled_is_a_fixed_budget"] and v["ratio"] == 1.0 and v["passes"]
    assert "| 256 (profiled and fixed) |" in bench_budget.markdown_section(r)


def test_budget_section_sits_beside_the_service_benchmark_section(tmp_path):
    results = tmp_path / "RESULTS.md"
    main_section = f"{bench_report.SECTION_START}\n## Service benchmark\nfigures\n{bench_report.SECTION_END}\n"
    results.write_text("# Results\n\n" + main_section)
    r = report({64: 250.0, 256: 390.0}, profiled=256, fixed=[64, 256])
    for _ in range(2):  # a second run replaces its own section only
        written = bench_budget.render(r, results_md=str(results), plots_dir=str(tmp_path))
    text = results.read_text()
    assert main_section in text and text.count("## Budget check") == 1
    assert f"![budget check profile]({bench_budget.PROFILE_PNG})" in text
    assert str(tmp_path / bench_budget.PROFILE_PNG) in written


@pytest.mark.slow
def test_budget_check_runs_the_profile_and_the_budgets_end_to_end(tmp_path):
    from tokq.profiling.bench.service.cli import service_command

    out, md = tmp_path / "bench.json", tmp_path / "RESULTS.md"
    args = ["--budget-check", "--token-budgets", "32", "--profile-max-tokens", "32", "--rate", "8",
            "--start-rate", "8", "--step-duration-s", "1.5", "--slo-ms", "20000", "--timeout-ms", "20000",
            "--out", str(out), "--plots", str(tmp_path), "--results-md", str(md), "--quiet"]
    result = CliRunner().invoke(service_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    check = r["budget_check"]
    profile = check["profile"]
    assert [p["num_tokens"] for p in profile["points"]] == [16, 23, 32]
    assert profile["slo_p99_ms"] == 20000 and check["profiled_budget"] == profile["recommended_budget"]
    budgets = [s["token_budget"] for s in r["systems"]]
    assert budgets == [32] + ([] if check["profiled_budget"] == 32 else [check["profiled_budget"]])
    assert all(s["steps"][0]["num_ok"] > 0 for s in r["systems"])
    assert check["verdict"]["best_fixed_budget"] == 32 and r["meta"]["options"]["num_refinements"] == 3
    text = md.read_text()
    assert "## Budget check" in text and "## Service benchmark" not in text
    assert (tmp_path / bench_budget.PROFILE_PNG).is_file()
