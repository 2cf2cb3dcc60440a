"""`tokq bench` output: the RESULTS.md section and figures render from a report, the targets
are judged from the numbers, and the whole command runs end to end on real processes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from tokq.profiling import workload
from tokq.profiling.bench import loadgen
from tokq.profiling.bench.service import report as bench_report
from tokq.profiling.bench.service.run import BenchOptions, machine
from tokq.profiling.results_md import markers


def step(rate: float, latency_ms: float, *, errors: int = 0, n: int = 100) -> dict:
    """A run's summary from samples that all took ``latency_ms`` (the last ``errors`` failed)."""
    samples = []
    for i in range(n):
        t = i / rate
        status = "DEADLINE_EXCEEDED" if i >= n - errors else "OK"
        samples.append(loadgen.Sample(t, t, t + latency_ms / 1000, status, 12, 1.0, 5.0))
    return loadgen.summarize(samples, rate)


def system(name: str, kind: str, steps: list[dict], slo_ms: float, **extra) -> dict:
    good = [s for s in steps if loadgen.within_slo(s, slo_ms)]
    best = max(good, key=lambda s: s["offered_rps"]) if good else None
    return {"name": name, "kind": kind, "slo_ms": slo_ms, "steps": steps, "sustainable": best,
            "sustainable_rps": best["offered_rps"] if best else 0.0, "limit": "p99 over SLO",
            "half_load": None, **extra}


@pytest.fixture
def report():
    slo_ms = 500.0
    tokq_steps = [step(50, 40), step(100, 60), step(200, 300), step(400, 2000, errors=30)]
    tokq_steps[2]["batches"] = {"num_batches": 40, "items_per_batch": 12.5, "tokens_per_batch": 150.0,
                                "fill_ratio": 0.15, "forward_ms": 30.0}
    half = step(100, 60)
    return {
        "meta": {"command": "tokq bench --all", "started_at": "2026-01-01T00:00:00+00:00",
                 "finished_at": "2026-01-01T00:08:00+00:00", "duration_s": 480.0, "machine": machine(),
                 "options": {**BenchOptions(slo_ms=slo_ms).__dict__},
                 "workload": workload.describe(workload.generate(100)), "workload_source": "generated",
                 "forward_ms_by_budget": {"1024": 100.0}, "note": "machine otherwise idle",
                 "infinity": "not installed (test)",
                 "other_processes_cpu": {"cpu_s": 12.0, "share_of_machine": 0.05}},
        "systems": [
            system("tokq look-ahead b1024", "tokq", tokq_steps, slo_ms, token_budget=1024, half_load=half),
            system("one-at-a-time (sentence-transformers)", "one-at-a-time",
                   [step(40, 30), step(80, 900)], slo_ms, vectors=checked(1.0)),
            system("one-at-a-time (ONNX Runtime)", "onnx-one-at-a-time",
                   [step(100, 80), step(150, 900)], slo_ms, vectors=checked(0.99999)),
            system("Infinity torch", "infinity", [step(90, 200), step(120, 3000)], slo_ms, vectors=checked(1.0)),
            # Wrong vectors: not measured, so neither its (absent) rate nor the 2x target uses it.
            {**system("Infinity ONNX", "infinity", [], slo_ms, vectors=checked(0.5)),
             "limit": "not counted: vectors differ"},
            system("padded batching", "padded-batching", [step(50, 200), step(100, 3000)], slo_ms),
        ],
    }


def checked(min_cos: float) -> dict:
    ok = min_cos >= 0.9999
    return {"num_probes": 48, "min_cos": min_cos, "counts": ok, "why": "" if ok else "vectors differ"}


def test_sustainable_rate_ignores_a_lucky_step_above_a_failed_one():
    steps = [step(10, 50), step(20, 700), step(30, 100)]
    assert bench_report.sustainable_at(steps, 500) == 10
    assert bench_report.sustainable_at(steps, 1000) == 30
    assert bench_report.sustainable_at([step(10, 50, errors=5)], 500) == 0  # 5% errors
    behind = step(20, 700)
    behind["generator_kept_up"] = False  # measured the generator, not the server: skipped
    assert bench_report.sustainable_at([step(10, 50), behind, step(20, 100)], 500) == 20


def test_section_states_ratios_and_targets(report):
    md = bench_report.markdown_section(report)
    start, end = markers(bench_report.block_name(report), bench_report.BLOCK)
    assert md.startswith(start) and md.rstrip().endswith(end)
    assert "tokq bench --all" in md and "machine otherwise idle" in md
    # tokq sustains 200 req/s: 5x one-at-a-time (40), 2.2x Infinity's best counted engine (torch,
    # 90: the ONNX one was not counted), 2x ONNX Runtime (100)
    assert "| tokq look-ahead b1024 | 200 |" in md and "5.00x" in md
    assert "sustains 5.00x one-at-a-time (sentence-transformers) (200 vs 40 req/s): **met**" in md
    assert "sustains 2.22x Infinity torch (200 vs 90 req/s): **met**" in md
    assert "sustains 2.00x one-at-a-time (ONNX Runtime) (200 vs 100 req/s): **met**" in md
    assert "Ahead of every other baseline**: yes" in md
    assert "| 0.50000 (**not counted**) | not counted: vectors differ |" in md
    # half load p99 60 ms against 4 x 100 ms forward
    assert "p99 60 ms at 100 req/s vs 4 x 100 ms = 400 ms: **met**" in md
    assert "| tokq look-ahead b1024 (sustainable) | 200 | 40 | 12.5 | 150 | 0.15 | 30.0 |" in md
    assert "DEADLINE_EXCEEDED 30" in md  # errors by status in the step table
    assert "Infinity (`infinity-emb`): not installed (test)" in md
    assert "outside this benchmark used 12 CPU-seconds during the run (5% of the machine's CPU time)" in md


def test_targets_not_met_are_said_so(report):
    report["systems"][1] = system("one-at-a-time (sentence-transformers)", "one-at-a-time",
                                  [step(50, 30), step(80, 100), step(120, 900)], 500.0)
    md = bench_report.markdown_section(report)
    assert "sustains 2.50x one-at-a-time (sentence-transformers) (200 vs 80 req/s): **not met**" in md


def test_targets_judge_tokq_up_defaults_and_say_when_a_baseline_is_missing(report):
    tokq_steps = [step(100, 50), step(160, 100), step(240, 900)]
    defaults = system("tokq (defaults)", "tokq", tokq_steps, 500.0, token_budget=0, lookahead=None,
                      half_load=step(80, 500))
    report["systems"].insert(0, defaults)  # the best tokq system (b1024, 200) is not the one judged
    report["systems"] = [s for s in report["systems"] if s["kind"] != "onnx-one-at-a-time"]
    report["meta"]["default_budget"] = 1024
    md = bench_report.markdown_section(report)
    assert "tokq (defaults) sustains 4.00x one-at-a-time (sentence-transformers) (160 vs 40 req/s): **not met**" in md
    assert "ONNX Runtime one at a time at equal p99 (<= 500 ms)**: not judged (not in this run)." in md
    i = next(i for i, s in enumerate(report["systems"]) if s["kind"] == "one-at-a-time")
    report["systems"][i] = system("one-at-a-time (sentence-transformers)", "one-at-a-time", [step(25, 900)], 500.0)
    md = bench_report.markdown_section(report)  # a baseline that met the SLO at no rate gives no ratio
    assert "one at a time at equal p99 (<= 500 ms)**: not judged: one-at-a-time (sentence-transformers) met" in md
    # its half-load p99 against the default budget's forward time
    assert "tokq (defaults): p99 500 ms at 80 req/s vs 4 x 100 ms = 400 ms: **not met**" in md


def test_outputs_replace_only_their_own_section(report, tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## Queue\n\nqueue figures\n")
    for _ in range(2):  # a second run replaces the section, never appends another
        written = bench_report.render_outputs(report, plots_dir=str(tmp_path / "plots"),
                                              results_md=str(results), json_path="bench.json")
    text = results.read_text()
    assert text.startswith("# Results\n\n## Queue\n\nqueue figures\n")
    assert text.count("## Service benchmark") == 1
    assert "![bench latency](plots/bench_latency.png)" in text
    for png in written[:2]:
        image = imread(png)
        assert image.shape[0] > 300 and image.shape[1] > 600 and np.std(image) > 0.01


def test_each_cpu_vector_extension_and_gpu_keeps_its_own_section(report, tmp_path):
    """An AVX2 machine's run beside an AVX-512 machine's (both "AMD EPYC"), the section of a
    run from before the extension was recorded, and a run on a GPU of an AVX-512 host (`--device
    cuda`), each replaced only by its own kind of run."""
    results = tmp_path / "RESULTS.md"
    gpu = {"vector_extension": "AVX-512", "gpu": "NVIDIA H100 80GB HBM3"}
    for extension in (None, "AVX-512", "AVX2", gpu, "AVX2", gpu):
        machine = {k: v for k, v in report["meta"]["machine"].items() if k != "vector_extension"}
        if extension:
            machine.update(extension if isinstance(extension, dict) else {"vector_extension": extension})
        run = {**report, "meta": {**report["meta"], "machine": machine}}
        bench_report.render_outputs(run, plots_dir=None, results_md=str(results), json_path="bench.json")
    text = results.read_text()
    assert text.count("## Service benchmark\n") == 1
    assert text.count("## Service benchmark, AVX-512 CPU\n") == 1
    assert text.count("## Service benchmark, AVX2 CPU\n") == 1
    assert text.count("<!-- tokq bench service (AVX2): start") == 1
    assert text.count("## Service benchmark, NVIDIA H100 80GB HBM3\n") == 1
    assert text.count("Machine: NVIDIA H100 80GB HBM3 beside ") == 1
    # a CUDA run saved before the GPU's name was recorded keeps off the host CPU's block too
    machine = {**report["meta"]["machine"], "vector_extension": "AVX-512"}
    machine.pop("gpu", None)
    old_gpu_run = {**report, "meta": {**report["meta"], "machine": machine,
                                      "command": "tokq bench service --device cuda --quiet"}}
    bench_report.render_outputs(old_gpu_run, plots_dir=None, results_md=str(results), json_path="bench.json")
    text = results.read_text()
    assert text.count("## Service benchmark, AVX-512 CPU\n") == 1
    assert text.count("## Service benchmark, a CUDA GPU (name not recorded)\n") == 1


@pytest.mark.slow
def test_service_command_runs_tokq_and_a_baseline_end_to_end(tmp_path):
    from tokq.profiling.bench.service.cli import service_command

    out, md = tmp_path / "bench.json", tmp_path / "RESULTS.md"
    args = ["--system", "tokq", "--system", "one-at-a-time", "--token-budgets", "64", "--rate", "8",
            "--start-rate", "8", "--step-duration-s", "1.5", "--slo-ms", "20000", "--timeout-ms", "20000",
            "--profile-json", str(tmp_path / "none.json"), "--out", str(out), "--plots", str(tmp_path),
            "--results-md", str(md), "--quiet"]
    result = CliRunner().invoke(service_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    names = [s["name"] for s in report["systems"]]
    assert names == ["tokq look-ahead b64", "one-at-a-time (sentence-transformers)"]
    for s in report["systems"]:
        only = s["steps"][0]
        assert only["offered_rps"] == 8 and only["num_ok"] == only["num_requests"] > 0, only["errors"]
        # Sustainable unless this busy machine held the generator back (then it must say so).
        assert s["sustainable_rps"] == (8 if only["generator_kept_up"] else 0)
    tokq = report["systems"][0]
    batches = tokq["steps"][0]["batches"]  # read from the worker's metrics and Redis
    assert batches["num_batches"] >= 1 and 0 < batches["fill_ratio"] <= 4
    assert tokq["steps"][0]["server_inference_ms"]["p50"] > 0
    if tokq["sustainable_rps"]:
        assert tokq["half_load"]["offered_rps"] == 4
    assert report["meta"]["forward_ms_by_budget"]["64"] > 0
    for s in report["systems"]:  # each checked against sentence-transformers before measuring
        assert s["vectors"]["counts"] and s["vectors"]["min_cos"] >= 0.9999, s["vectors"]
    # CPU per process, each step: tokq's parts and a baseline's server, and the load generator
    assert set(tokq["steps"][0]["cpu_cores"]) == {"gateway", "worker", "redis", "load generator"}
    assert set(report["systems"][1]["steps"][0]["cpu_cores"]) == {"server", "load generator"}
    assert all(s["steps"][0]["cpu_cores"]["load generator"] > 0 for s in report["systems"])
    assert tokq["steps"][0]["cpu_cores"]["worker"] > 0 and report["systems"][1]["steps"][0]["cpu_cores"]["server"] > 0
    assert "## Service benchmark" in md.read_text()
    assert "Command: `tokq bench service --system tokq --system one-at-a-time --rate 8" in md.read_text()
    assert "| CPU cores by process |" in md.read_text() and ", worker " in md.read_text()


def test_cpu_accounting_sees_a_waited_child_as_the_runs_own():
    import subprocess
    import sys

    from tokq.profiling.bench.service.run import cpu_busy_s, own_cpu_s

    busy_before, own_before = cpu_busy_s(), own_cpu_s()
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    own = own_cpu_s() - own_before
    assert own >= 0.5  # the child's CPU time counts as this run's
    assert cpu_busy_s() - busy_before >= 0.45  # and the machine saw it (clock ticks: 10 ms)
