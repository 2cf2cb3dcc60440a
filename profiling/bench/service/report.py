"""`tokq bench service` JSON -> the "Service benchmark" block of a results file and two figures that a
person reads without the JSON: latency against offered load, and sustainable throughput per
system. Re-render without re-measuring: ``tokq bench report profiling/bench.json --plots
profiling/ --results-md profiling/results/service.md`` (a ``--budget-check`` JSON renders its own block).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import click

from tokq.profiling.results_md import cpu_block_name, cpu_heading, cpu_label, markers, write_block

BLOCK = "tokq bench service"
SECTION_START, SECTION_END = markers(BLOCK)  # a run that did not record its CPU's vector extension
P99_BOUNDS_MS = (100, 250, 500, 1000)
# tokq (`tokq up`'s defaults) vs each baseline at equal p99: kind -> (ratio, what it is)
TARGETS = (("one-at-a-time", 5.0, "sentence-transformers one at a time"),
           ("infinity", 2.0, "Infinity's best engine"),
           ("onnx-one-at-a-time", 1.5, "ONNX Runtime one at a time"))
HALF_LOAD_FORWARD_MULTIPLE = 4.0  # p99 at half load must stay under this many single-batch forwards
LATENCY_PNG = "bench_latency.png"
THROUGHPUT_PNG = "bench_throughput.png"


def passes(step: dict, slo_ms: float, max_error_ratio: float = 0.01) -> bool:
    errors = 1 - step["num_ok"] / step["num_requests"]
    return step["latency_ms"]["p99"] <= slo_ms and errors <= max_error_ratio and step["generator_kept_up"]


def sustainable_at(steps: list[dict], slo_ms: float) -> float:
    """Highest offered rate that meets ``slo_ms`` with every lower measured rate meeting it too
    (a lucky step above a failed one does not count)."""
    best = 0.0
    # Runs where the generator fell behind measured nothing about the server: left out.
    for step in sorted((s for s in steps if s["generator_kept_up"]), key=lambda s: s["offered_rps"]):
        if not passes(step, slo_ms):
            break
        best = step["offered_rps"]
    return best


def counts(system: dict) -> bool:
    """A system's figure counts unless its vectors failed the check against sentence-transformers."""
    return (system.get("vectors") or {}).get("counts", True)


def _baseline(report: dict, kind: str) -> dict | None:
    """The best counted system of ``kind`` (e.g. Infinity's best engine)."""
    of_kind = [s for s in report["systems"] if s["kind"] == kind and counts(s)]
    return max(of_kind, key=lambda s: s["sustainable_rps"]) if of_kind else None


def _vectors(system: dict) -> str:
    v = system.get("vectors")
    if not v:
        return "not checked"
    cos = "–" if v["min_cos"] is None else f"{v['min_cos']:.5f}"
    if v["counts"]:
        return cos
    # tokq is measured whatever its dtype gives; a baseline below the bar is not
    return f"{cos} (below 0.9999)" if system["kind"] == "tokq" else f"{cos} (**not counted**)"


def fmt(value, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "–"


def _headline_table(report: dict, slo_ms: float) -> list[str]:
    ref = _baseline(report, "one-at-a-time")
    ref_rps = ref["sustainable_rps"] if ref else 0.0
    rows = [f"| system | max offered req/s at p99 <= {slo_ms:g} ms | done req/s | tokens/s | vs one-at-a-time "
            "| p50 ms | p90 ms | p99 ms | vectors vs sentence-transformers (min cos) | what broke at the next rate |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in report["systems"]:
        best = s.get("sustainable") or {}
        lat = best.get("latency_ms", {})
        at_least = ">= " if s.get("generator_limited") else ""  # the generator, not the server, gave out
        rows.append(f"| {s['name']} | {at_least}{fmt(s['sustainable_rps'])} | {fmt(best.get('throughput_rps'))} "
                    f"| {fmt(best.get('tokens_per_s'))} | {_ratio(s['sustainable_rps'], ref_rps)} "
                    f"| {fmt(lat.get('p50'))} | {fmt(lat.get('p90'))} | {fmt(lat.get('p99'))} | {_vectors(s)} "
                    f"| {s['limit']} |")
    return rows


def _bounds_table(report: dict) -> list[str]:
    rows = ["| system | " + " | ".join(f"p99 <= {b} ms" for b in P99_BOUNDS_MS) + " |",
            "|---|" + "---:|" * len(P99_BOUNDS_MS)]
    for s in report["systems"]:
        rows.append(f"| {s['name']} | " + " | ".join(fmt(sustainable_at(s["steps"], b)) for b in P99_BOUNDS_MS) + " |")
    return rows


def main_tokq(report: dict) -> dict | None:
    """The tokq system the targets judge: `tokq up`'s defaults (token budget 0 = the worker's
    own), else the best tokq system of the run."""
    tokq = [s for s in report["systems"] if s["kind"] == "tokq"]
    defaults = [s for s in tokq if not s.get("token_budget") and s.get("lookahead") is None]
    if defaults:
        return defaults[0]
    return max(tokq, key=lambda s: s["sustainable_rps"]) if tokq else None


def _targets(report: dict, slo_ms: float) -> list[str]:
    best = main_tokq(report)
    if best is None:
        return ["No tokq system in this run."]
    others = [s for s in report["systems"] if s["kind"] != "tokq"]
    lines = []
    for kind, ratio_needed, what in TARGETS:
        ref = _baseline(report, kind)
        label = f"- **>= {ratio_needed:g}x {what} at equal p99 (<= {slo_ms:g} ms)**: "
        if ref is None:
            dropped = [s for s in others if s["kind"] == kind]
            why = "; ".join(f"{s['name']}: {s['limit']}" for s in dropped) or "not in this run"
            lines.append(label + f"not judged ({why}).")
            continue
        if not ref["sustainable_rps"]:  # no ratio to judge: the baseline met the SLO at no rate
            lines.append(label + f"not judged: {ref['name']} met the SLO at no measured rate ({ref['limit']}).")
            continue
        ratio = best["sustainable_rps"] / ref["sustainable_rps"]
        lines.append(label + f"{best['name']} sustains {ratio:.2f}x {ref['name']} ({best['sustainable_rps']:.0f} vs "
                     f"{ref['sustainable_rps']:.0f} req/s): **{'met' if ratio >= ratio_needed else 'not met'}**.")
    counted = [o for o in others if counts(o)]
    if counted:
        beaten = [o["name"] for o in counted if best["sustainable_rps"] > o["sustainable_rps"]]
        lines.append(f"- **Ahead of every other baseline**: {'yes' if len(beaten) == len(counted) else 'no'} "
                     f"(ahead of {', '.join(beaten) or 'none'}).")
    forward_ms = report["meta"].get("forward_ms_by_budget", {})
    for s in (t for t in report["systems"] if t["kind"] == "tokq"):
        budget = s.get("token_budget") or report["meta"].get("default_budget")
        half, fwd = s.get("half_load"), forward_ms.get(str(budget))
        if half and fwd:
            limit = HALF_LOAD_FORWARD_MULTIPLE * fwd
            p99 = half["latency_ms"]["p99"]
            lines.append(f"- **p99 at half load < {HALF_LOAD_FORWARD_MULTIPLE:g}x single-batch forward**, "
                         f"{s['name']}: p99 {p99:.0f} ms at {half['offered_rps']:.0f} req/s vs "
                         f"{HALF_LOAD_FORWARD_MULTIPLE:g} x {fwd:.0f} ms = {limit:.0f} ms: "
                         f"**{'met' if p99 < limit else 'not met'}**.")
    return lines


def _batch_table(report: dict) -> list[str]:
    rows = ["| system | offered req/s | batches | items/batch | tokens/batch | fill ratio | forward ms "
            "| queue wait p50 / p99 ms | inference p50 ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in report["systems"]:
        for label, run in (("sustainable", s.get("sustainable")), ("half load", s.get("half_load"))):
            if not run:
                continue
            b = run.get("batches") or {}
            q, inf = run["server_queue_ms"], run["server_inference_ms"]
            rows.append(f"| {s['name']} ({label}) | {run['offered_rps']:.0f} | {fmt(b.get('num_batches'))} "
                        f"| {fmt(b.get('items_per_batch'), 1)} | {fmt(b.get('tokens_per_batch'))} "
                        f"| {fmt(b.get('fill_ratio'), 2)} | {fmt(b.get('forward_ms'), 1)} "
                        f"| {fmt(q['p50'])} / {fmt(q['p99'])} | {fmt(inf['p50'], 1)} |")
    return rows


def cpu_cores(step: dict | None) -> str:
    """The cores each process of a step used ("gateway 0.9, worker 1.0, ..."); '–' before
    `tokq bench service` counted them."""
    cores = (step or {}).get("cpu_cores")
    return ", ".join(f"{role} {c:.2f}" for role, c in cores.items()) if cores else "–"


def _steps_table(report: dict) -> list[str]:
    rows = ["| system | offered req/s | sent req/s | done req/s | tokens/s | p50 ms | p90 ms | p99 ms | max ms "
            "| errors | send lag p99 ms | CPU cores by process |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for s in report["systems"]:
        for st in sorted(s["steps"], key=lambda x: x["offered_rps"]):
            lat = st["latency_ms"]
            errors = ", ".join(f"{k} {v}" for k, v in st["errors"].items()) or "0"
            lag = fmt(st["send_lag_ms"]["p99"], 1) + ("" if st["generator_kept_up"] else " (fell behind)")
            rows.append(f"| {s['name']} | {st['offered_rps']:.1f} | {fmt(st.get('scheduled_rps'), 1)} "
                        f"| {st['throughput_rps']:.1f} "
                        f"| {fmt(st['tokens_per_s'])} | {fmt(lat['p50'])} | {fmt(lat['p90'])} "
                        f"| {fmt(lat['p99'])} | {fmt(lat['max'])} | {errors} | {lag} | {cpu_cores(st)} |")
    return rows


def run_header(meta: dict) -> list[str]:
    """The first lines of a block made from a `tokq bench service` JSON: its command and when."""
    return [f"Command: `{meta['command']}`  ",
            f"Date: {meta['started_at']} to {meta.get('finished_at', '?')} ({meta.get('duration_s', '?')} s)  "]


def other_cpu(meta: dict) -> str:
    other = meta.get("other_processes_cpu")
    if not other:
        return "CPU used by other processes during the run: not measured"
    return (f"processes outside this benchmark used {other['cpu_s']:.0f} CPU-seconds during the run "
            f"({other['share_of_machine']:.0%} of the machine's CPU time)")


def _machine(meta: dict) -> dict:
    """The run's machine; a run on CUDA from before the GPU's name was recorded is still a GPU
    run (its block must not replace the host CPU's)."""
    m = meta["machine"]
    if "gpu" not in m and "--device cuda" in meta.get("command", ""):
        return {**m, "gpu": "a CUDA GPU (name not recorded)"}
    return m


def block_name(report: dict) -> str:
    return cpu_block_name(BLOCK, _machine(report["meta"]))


def markdown_section(report: dict, plot_paths: dict[str, str] | None = None) -> str:
    meta = report["meta"]
    slo_ms = meta["options"]["slo_ms"]
    m, w, o = _machine(meta), meta["workload"], meta["options"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    forward = ", ".join(f"b{b}: {ms:.0f} ms" for b, ms in meta.get("forward_ms_by_budget", {}).items())
    start, end = markers(block_name(report), BLOCK)
    lines = [
        start, cpu_heading("Service benchmark", m), "",
        *run_header(meta),
        f"Machine: {cpu_label(m)}, {m['num_cpus']} CPUs, {m['platform']}; load average at start "
        f"{' '.join(m.get('loadavg_at_start', []))}, at end {' '.join(meta.get('loadavg_at_end', []))} "
        "(1/5/15-minute load averages, this run's own processes included). Everything (load generator, gateway, worker, Redis, "
        "baselines) ran on this one machine.  ",
        f"Machine state: {meta.get('note') or 'not stated'}; {other_cpu(meta)}  ",
        f"Versions: {versions}  ",
        f"Workload: {meta.get('workload_source', '?')}: {w['num_queries']} queries, tokens p50 "
        f"{w['p50_tokens']:.0f} / p90 {w['p90_tokens']:.0f} / p99 {w['p99_tokens']:.0f} / max {w['max_tokens']} "
        "(capped at the model's 256). One query per request.  ",
        f"Load: open loop, {o['arrivals']} arrivals, {o['step_duration_s']:g} s per step, rate x{o['step_factor']:g} "
        f"per step from {o['start_rate']:g} req/s, then one bisection; latency counted from each request's "
        f"intended send time; client deadline {o['timeout_s']:g} s (p99 of an overloaded step is capped "
        f"near it). Torch threads: {o['threads']} per baseline model process, and `tokq up`'s own "
        "choice for its worker (cores - 1), the same number.  ",
        f"Single-batch forward time (tokq engine, full budget packed from the workload): {forward or '–'}.",
        "", f"### Sustainable throughput at p99 <= {slo_ms:g} ms", "",
        f"Rates come from the step grid (x{o['step_factor']:g}, one bisection), so systems whose limits "
        "fall between the same two grid points show the same rate, and ratios are quantized by the grid. "
        "`>=` marks a rate where the load generator, not the server, gave out.", "",
        *_headline_table(report, slo_ms), "",
        "### Targets", "", *_targets(report, slo_ms), "",
        "### Highest rate meeting other p99 bounds (same steps)", "", *_bounds_table(report), "",
        "### Batches (read from tokq's worker metrics and queue counters; timings from responses)", "",
        *_batch_table(report), "",
    ]
    if plot_paths:
        lines += ["### Figures", ""] + [f"![{name}]({path})" for name, path in plot_paths.items()] + [""]
    lines += ["### Every step", "", "<details><summary>every offered rate of every system "
              "(p99 of overloaded steps is capped near the client deadline)</summary>", "",
              *_steps_table(report), "", "</details>", "",
              f"Infinity (`infinity-emb`): {meta.get('infinity', 'not measured')}.", "",
              f"ONNX export for the ONNX Runtime baselines: {meta.get('onnx_export') or 'none (not asked for)'}. "
              "Every system's vectors of the probe queries (one request per query) are compared with "
              "sentence-transformers encoding each alone before it is measured; a baseline below cosine "
              "0.9999 is not measured and its figure does not count.", "", end]
    return "\n".join(lines) + "\n"


def render_outputs(report: dict, *, plots_dir: str | None, results_md: str | None, json_path: str) -> list[str]:
    """Write the figures and/or the markdown section; returns the paths written."""
    written: list[str] = []
    plots: dict[str, str] = {}
    if plots_dir:
        from tokq.profiling.bench.service.plots import plot_latency, plot_throughput

        Path(plots_dir).mkdir(parents=True, exist_ok=True)
        for name, draw in ((LATENCY_PNG, plot_latency), (THROUGHPUT_PNG, plot_throughput)):
            path = Path(plots_dir) / name
            draw(report, path)
            written.append(str(path))
            base = Path(results_md).parent if results_md else Path(".")
            plots[name.removesuffix(".png").replace("_", " ")] = os.path.relpath(path, base)
    if results_md:
        write_block(results_md, block_name(report), markdown_section(report, plots))
        written.append(results_md)
    return written


@click.command("report")
@click.argument("json_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False), default=None)
@click.option("--results-md", type=click.Path(dir_okay=False), default=None)
def report_command(json_path, plots_dir, results_md) -> None:
    """Re-render a `tokq bench service --out` JSON (figures, results file block) without measuring again."""
    import json

    report = json.loads(Path(json_path).read_text())
    if "budget_check" in report:
        from tokq.profiling.bench.service.budget import render

        written = render(report, results_md=results_md, plots_dir=plots_dir)
    else:
        written = render_outputs(report, plots_dir=plots_dir, results_md=results_md, json_path=json_path)
    for path in written:
        click.echo(f"wrote {path}")
