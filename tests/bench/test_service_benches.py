"""The service benchmarks (`tokq bench service` and its `--budget-check`, `report`, `hostile`,
`crash-recovery`, `idle-workers`), each run on real processes at its smallest size; and the
service report's judgements, from its numbers."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from tokq.host import vector_extension
from tokq.profiling import workload
from tokq.profiling.bench import crash_recovery, hostile, idle_workers, loadgen
from tokq.profiling.bench.service import report as bench_report
from tokq.profiling.bench.service.cli import service_command
from tokq.profiling.bench.service.report import report_command

pytestmark = pytest.mark.slow
FAST = ["--rate", "8", "--start-rate", "8", "--step-duration-s", "1.5", "--slo-ms", "20000", "--timeout-ms", "20000",
        "--quiet"]


def test_service_and_its_report(bench, tmp_path):
    """tokq and a baseline; each step says the cores every part used; `tokq bench report` renders
    the same section from the JSON."""
    out = tmp_path / "bench.json"
    args = ["--system", "tokq", "--system", "one-at-a-time", "--token-budgets", "64", *FAST,
            "--profile-json", str(tmp_path / "none.json"), "--out", str(out), "--plots", str(tmp_path)]
    text = bench(service_command, args, f"{bench_report.BLOCK} ({vector_extension()})")
    report = json.loads(out.read_text())
    tokq, baseline = report["systems"]
    assert tokq["name"] == "tokq look-ahead b64" and baseline["kind"] == "one-at-a-time"
    for s in report["systems"]:
        only = s["steps"][0]
        assert only["num_ok"] == only["num_requests"] > 0 and s["vectors"]["min_cos"] >= 0.9999
    step = tokq["steps"][0]
    assert set(step["cpu_cores"]) == {"gateway", "worker", "redis", "load generator"}
    assert min(step["cpu_cores"][k] for k in ("gateway", "worker", "load generator")) > 0
    assert step["batches"]["num_batches"] >= 1 and report["meta"]["forward_ms_by_budget"]["64"] > 0
    # why each claim stopped (the worker's counter) and the lanes' depth (the gateway's gauges), per step
    assert sum(step["batches"]["claim_stops"].values()) == pytest.approx(1, abs=0.01)
    assert set(step["batches"]["queued_tokens"]) >= {"light", "heavy"} and "### Why claims stopped" in text
    assert set(baseline["steps"][0]["cpu_cores"]) == {"server", "load generator"}
    assert "| CPU cores by process |" in text and "![bench latency](bench_latency.png)" in text
    again = tmp_path / "again.md"
    assert CliRunner().invoke(report_command, [str(out), "--plots", str(tmp_path), "--results-md", str(again)]).exit_code == 0
    assert again.read_text().split("\n", 2)[2] in text  # the block, as the run wrote it


def test_budget_check(bench, tmp_path):
    out = tmp_path / "bench.json"
    args = ["--budget-check", "--token-budgets", "32", "--profile-max-tokens", "32", *FAST, "--out", str(out),
            "--plots", str(tmp_path)]
    text = bench(service_command, args, bench_report.BUDGET_BLOCK)
    check = json.loads(out.read_text())["budget_check"]
    assert [p["num_tokens"] for p in check["profile"]["points"]] == [16, 23, 32]
    assert check["verdict"]["best_fixed_budget"] == 32 and "## Service benchmark" not in text
    assert "![budget check profile](budget_check_profile.png)" in text and (tmp_path / "budget_check_profile.png").is_file()


def test_hostile(bench, monkeypatch):
    """One of its four scenarios: requests at the caps, refused by the gateway (the reference's)."""
    scenarios = hostile.scenarios
    monkeypatch.setattr(hostile, "scenarios", lambda limits: dict(list(scenarios(limits).items())[1:2]))
    monkeypatch.setattr(hostile, "PRESSURE_S", 0.2)
    monkeypatch.setattr(hostile, "WARMUP_S", 0.3)
    text = bench(hostile.hostile_command, ["--rounds", "1", "--phase-s", "0.3"], hostile.BLOCK)
    rows = [line for line in text.splitlines() if re.match(r"\| (8 MB|\d+ x \d+ KiB)", line)]
    assert len(rows) == 1 and re.search(r"\*\*[\d.]+x\*\*", rows[0])
    assert "| bare grpc.aio server |" in text and "Reading (generated from the figures above)" in text


def test_crash_recovery(bench, monkeypatch):
    monkeypatch.setattr(crash_recovery, "PRE_S", 1.5)
    monkeypatch.setattr(crash_recovery, "OBSERVE_LEASES", 4)
    text = bench(crash_recovery.crash_recovery_command, ["--burst", "40", "--lease-ms", "400", "--rounds", "1"],
                 "tokq bench crash-recovery")
    assert re.search(r"^\| redone in batches \(tokq's rule\) \| [\d.]+ L \|", text, re.M)
    assert "| every redone item alone (`max_attempts=2`) |" in text and "Recovery, in batches / alone:" in text


def test_idle_workers(bench, monkeypatch):
    monkeypatch.setattr(idle_workers, "SETTLE_S", 0.5)
    text = bench(idle_workers.idle_workers_command, ["--workers", "1", "--idle-s", "1", "--items", "5"],
                 "tokq bench idle-workers")
    assert re.search(r"^\| Redis commands/s per idle worker \| [\d.]+ \|", text, re.M)
    assert "| wake-up of a new item, p99 (Redis clock, ms) |" in text


# -- the report, from numbers ------------------------------------------------------------------

def step(rate: float, latency_ms: float, *, errors: int = 0, n: int = 100) -> dict:
    samples = [loadgen.Sample(i / rate, i / rate, i / rate + latency_ms / 1000,
                              "DEADLINE_EXCEEDED" if i >= n - errors else "OK", 12, 1.0, 5.0) for i in range(n)]
    return loadgen.summarize(samples, rate)


def system(name: str, kind: str, steps: list[dict], **extra) -> dict:
    good = [s for s in steps if loadgen.within_slo(s, 500.0)]
    best = max(good, key=lambda s: s["offered_rps"]) if good else None
    return {"name": name, "kind": kind, "steps": steps, "sustainable": best, "limit": "p99 over SLO",
            "sustainable_rps": best["offered_rps"] if best else 0.0, "half_load": None, **extra}


def test_the_report_judges_tokq_up_defaults_against_each_counted_baseline():
    from tokq.profiling.bench.service.run import BenchOptions, machine

    ok = {"num_probes": 48, "min_cos": 1.0, "counts": True, "why": ""}
    past = {**step(240, 900), "batches": {"claim_stops": {"full": 0.75, "dry": 0.25}, "fill_ratio": 0.9,
                                          "queued_tokens": {"light": 3000, "heavy": 0}}}
    report = {"meta": {"command": "tokq bench service", "started_at": "t0", "machine": machine(),
                       "options": BenchOptions(slo_ms=500.0).__dict__, "workload": workload.describe(workload.generate(50)),
                       "forward_ms_by_budget": {"1024": 100.0}, "default_budget": 1024},
              "systems": [system("tokq (defaults)", "tokq", [step(100, 50), step(160, 100), past],
                                 token_budget=0, half_load=step(80, 500)),
                          system("one-at-a-time", "one-at-a-time", [step(40, 30), step(80, 900)], vectors=ok),
                          system("ONNX", "onnx-one-at-a-time", [step(100, 80), step(150, 900)], vectors=ok),
                          {**system("Infinity ONNX", "infinity", [], vectors={**ok, "min_cos": 0.5, "counts": False}),
                           "limit": "not counted: vectors differ"}]}
    md = bench_report.markdown_section(report)
    assert "tokq (defaults) sustains 4.00x one-at-a-time (160 vs 40 req/s): **not met**" in md
    assert "sustains 1.60x ONNX (160 vs 100 req/s): **met**" in md
    assert "Infinity's best engine at equal p99 (<= 500 ms)**: not judged (Infinity ONNX: not counted" in md
    assert "| 0.50000 (**not counted**) |" in md and "Ahead of every other baseline**: yes" in md
    assert "p99 500 ms at 80 req/s vs 4 x 100 ms = 400 ms: **not met**" in md
    assert "| tokq (defaults) (past the limit) | 240 | 900 | – | 75% | 25% | 0.90 | – | 3,000 | 0 |" in md
    assert "| tokq (defaults) (sustainable) | 160 | 100 | – | – | – | – | – | – | – |" in md
    lucky = [step(10, 50), step(20, 700), step(30, 100)]  # a lucky step above a failed one does not count
    assert bench_report.sustainable_at(lucky, 500) == 10 and bench_report.sustainable_at(lucky, 1000) == 30


def test_the_budget_check_passes_within_ten_percent_of_the_best_fixed_budget():
    def run(rates: dict[int, float], profiled: int, fixed: list[int]) -> dict:
        return {"budget_check": {"profiled_budget": profiled, "fixed_budgets": fixed},
                "systems": [{"kind": "tokq", "token_budget": b, "sustainable_rps": r} for b, r in rates.items()]}
    v = bench_report.budget_verdict(run({64: 250.0, 256: 390.0, 181: 370.0}, 181, [64, 256]))
    assert (v["best_fixed_budget"], v["passes"]) == (256, True) and v["ratio"] == pytest.approx(370 / 390, abs=1e-3)
    assert not bench_report.budget_verdict(run({64: 250.0, 256: 390.0, 45: 265.0}, 45, [64, 256]))["passes"]
    assert bench_report.budget_verdict(run({64: 250.0, 256: 390.0}, 256, [64, 256]))["profiled_is_a_fixed_budget"]


def test_a_thread_variant_of_tokq_up_defaults_runs_its_worker_on_that_many_threads():
    from tokq.profiling.bench.service.cli import system_specs

    specs = system_specs(["tokq-defaults", "tokq-defaults-t2"], budgets=[1024], profiled_budget=None,
                         padded_max_batch=32, padded_max_wait_ms=10.0)
    assert [s.worker_threads for s in specs] == [0, 2]
    assert specs[1].label(1024) == "tokq (budget 1024, dtype auto, 2 worker threads)"
    report = {"systems": [{**s.describe(), "sustainable_rps": r} for s, r in zip(specs, (100.0, 200.0))]}
    assert bench_report.main_tokq(report)["worker_threads"] == 0  # the targets judge `tokq up`'s own choice
