"""`tokq bench service` JSON -> its sections of profiling/results/service.md ("Service benchmark", or
"Budget check" for a ``--budget-check`` run) and figures that read without the JSON. ``tokq bench
report bench.json --plots DIR --results-md FILE`` re-renders a run without measuring again."""

from __future__ import annotations

import math
import os
from pathlib import Path

import click

from tokq.profiling.bench.loadgen import within_slo
from tokq.profiling.bench.service.run import LANE_SAMPLE_S
from tokq.profiling.results_md import (block, cpu_block_name, cpu_heading, cpu_label, machine_cores, markers, table,
                                       write_block)

BLOCK = "tokq bench service"
BUDGET_BLOCK = "tokq bench service --budget-check"
SECTION_START, SECTION_END = markers(BLOCK)  # a run that did not record its CPU's vector extension
P99_BOUNDS_MS = (100, 250, 500, 1000)
# tokq (`tokq up`'s defaults) against each baseline at equal p99: kind -> (ratio, what it is)
TARGETS = (("one-at-a-time", 5.0, "sentence-transformers one at a time"), ("infinity", 2.0, "Infinity's best engine"),
           ("onnx-one-at-a-time", 1.5, "ONNX Runtime one at a time"))
HALF_LOAD_FORWARD_MULTIPLE = 4.0  # p99 at half load must stay under this many single-batch forwards
MIN_RATIO = 0.90  # the profiled budget's sustainable rate / the best fixed budget's
BOUND_FRACTION = 0.8  # batches this full of the smallest budget: the budget capped them
PROFILE_PNG = "budget_check_profile.png"


def fmt(value, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}"


def sustainable_at(steps: list[dict], slo_ms: float) -> float:
    """Highest offered rate meeting ``slo_ms`` with every lower measured rate meeting it too (a
    lucky step above a failed one does not count; steps the generator fell behind on are left out)."""
    best = 0.0
    for step in sorted((s for s in steps if s["generator_kept_up"]), key=lambda s: s["offered_rps"]):
        if not within_slo(step, slo_ms):
            break
        best = step["offered_rps"]
    return best


def counts(system: dict) -> bool:
    """A system's figure counts unless its vectors failed the check against sentence-transformers."""
    return (system.get("vectors") or {}).get("counts", True)


def _baseline(report: dict, kind: str) -> dict | None:
    """The best counted system of ``kind`` (e.g. Infinity's best engine)."""
    return max((s for s in report["systems"] if s["kind"] == kind and counts(s)),
               key=lambda s: s["sustainable_rps"], default=None)


def _vectors(system: dict) -> str:
    if not (v := system.get("vectors")):
        return "not checked"
    cos = "–" if v["min_cos"] is None else f"{v['min_cos']:.5f}"
    if v["counts"]:
        return cos
    # tokq is measured whatever its dtype gives; a baseline below the bar is not
    return f"{cos} (below 0.9999)" if system["kind"] == "tokq" else f"{cos} (**not counted**)"


def main_tokq(report: dict) -> dict | None:
    """The tokq system the targets judge: `tokq up`'s defaults, else the best tokq system of the run."""
    tokq = [s for s in report["systems"] if s["kind"] == "tokq"]
    defaults = [s for s in tokq if not (s.get("token_budget") or s.get("worker_threads")) and s.get("lookahead") is None]
    return defaults[0] if defaults else max(tokq, key=lambda s: s["sustainable_rps"], default=None)


def _targets(report: dict, slo_ms: float) -> list[str]:
    if (best := main_tokq(report)) is None:
        return ["No tokq system in this run."]
    others, lines = [s for s in report["systems"] if s["kind"] != "tokq"], []
    for kind, needed, what in TARGETS:
        ref, label = _baseline(report, kind), f"- **>= {needed:g}x {what} at equal p99 (<= {slo_ms:g} ms)**: "
        if ref is None:
            why = "; ".join(f"{s['name']}: {s['limit']}" for s in others if s["kind"] == kind) or "not in this run"
            lines.append(label + f"not judged ({why}).")
        elif not ref["sustainable_rps"]:  # no ratio to judge: the baseline met the SLO at no rate
            lines.append(label + f"not judged: {ref['name']} met the SLO at no measured rate ({ref['limit']}).")
        else:
            ratio = best["sustainable_rps"] / ref["sustainable_rps"]
            lines.append(label + f"{best['name']} sustains {ratio:.2f}x {ref['name']} ({best['sustainable_rps']:.0f} "
                         f"vs {ref['sustainable_rps']:.0f} req/s): **{'met' if ratio >= needed else 'not met'}**.")
    if counted := [o for o in others if counts(o)]:
        beaten = [o["name"] for o in counted if best["sustainable_rps"] > o["sustainable_rps"]]
        lines.append(f"- **Ahead of every other baseline**: {'yes' if len(beaten) == len(counted) else 'no'} "
                     f"(ahead of {', '.join(beaten) or 'none'}).")
    for s in (t for t in report["systems"] if t["kind"] == "tokq"):
        budget = s.get("token_budget") or report["meta"].get("default_budget")
        half, fwd = s.get("half_load"), report["meta"].get("forward_ms_by_budget", {}).get(str(budget))
        if half and fwd:
            limit, p99 = HALF_LOAD_FORWARD_MULTIPLE * fwd, half["latency_ms"]["p99"]
            lines.append(f"- **p99 at half load < {HALF_LOAD_FORWARD_MULTIPLE:g}x single-batch forward**, {s['name']}: "
                         f"p99 {p99:.0f} ms at {half['offered_rps']:.0f} req/s vs {HALF_LOAD_FORWARD_MULTIPLE:g} x "
                         f"{fwd:.0f} ms = {limit:.0f} ms: **{'met' if p99 < limit else 'not met'}**.")
    return lines


def cpu_cores(step: dict | None) -> str:
    """The cores each process of a step used ("gateway 0.9, worker 1.0, ...")."""
    cores = (step or {}).get("cpu_cores")
    return ", ".join(f"{role} {c:.2f}" for role, c in cores.items()) if cores else "–"


def _stops(systems: list[dict]) -> list[str]:
    """Why each tokq claim stopped, with the fill and the lanes' depth, at half load, at the sustainable
    rate and past it."""
    from tokq.metrics import QUEUE_LANES
    from tokq.queue.claim_rule import STOP_REASONS

    runs = [(s, label, run, run.get("batches") or {}) for s in systems if s["kind"] == "tokq"
            for label, run in [("half load", s["half_load"])] * bool(s.get("half_load")) + [
                ("sustainable" if st == s["sustainable"] else "past the limit" if st["offered_rps"] > s["sustainable_rps"]
                 else "that rate again", st)
                for st in sorted(s["steps"], key=lambda x: x["offered_rps"]) if st["offered_rps"] >= s["sustainable_rps"]]]
    reasons = [r for r in STOP_REASONS if any(b.get("claim_stops", {}).get(r) for *_, b in runs)]
    lanes = [lane for lane in QUEUE_LANES if any(lane in b.get("queued_tokens", {}) for *_, b in runs)] or ["light"]
    rows = [[f"{s['name']} ({label})", f"{run['offered_rps']:.0f}", fmt(run["latency_ms"]["p99"]), fmt(b.get("num_batches")),
             *(f"{b['claim_stops'].get(r, 0):.0%}" if "claim_stops" in b else "–" for r in reasons or ["–"]),
             fmt(b.get("fill_ratio"), 2), fmt(b.get("tokens_per_batch")),
             *(fmt(b.get("queued_tokens", {}).get(lane)) for lane in lanes)] for s, label, run, b in runs]
    return table(f"system (step) | offered req/s | p99 ms | batches | {' | '.join(reasons) or 'claims by stop reason'} | fill ratio | "
                 "tokens/batch | " + " | ".join(f"{lane} lane queued tokens" for lane in lanes), rows)


def _tables(report: dict, slo_ms: float) -> dict[str, list[str]]:
    systems, ref = report["systems"], _baseline(report, "one-at-a-time")
    ref_rps = ref["sustainable_rps"] if ref else 0.0
    headline = []
    for s in systems:
        best = s.get("sustainable") or {}
        lat = best.get("latency_ms", {})
        headline.append([s["name"], (">= " if s.get("generator_limited") else "") + fmt(s["sustainable_rps"]),
                         fmt(best.get("throughput_rps")), fmt(best.get("tokens_per_s")),
                         f"{s['sustainable_rps'] / ref_rps:.2f}x" if ref_rps > 0 else "–", fmt(lat.get("p50")),
                         fmt(lat.get("p90")), fmt(lat.get("p99")), _vectors(s), s["limit"]])
    batches = []
    for s in systems:
        for label, run in (("sustainable", s.get("sustainable")), ("half load", s.get("half_load"))):
            if run:
                b, q, inf = run.get("batches") or {}, run["server_queue_ms"], run["server_inference_ms"]
                batches.append([f"{s['name']} ({label})", f"{run['offered_rps']:.0f}", fmt(b.get("num_batches")),
                                fmt(b.get("items_per_batch"), 1), fmt(b.get("tokens_per_batch")),
                                fmt(b.get("fill_ratio"), 2), fmt(b.get("forward_ms"), 1),
                                f"{fmt(q['p50'])} / {fmt(q['p99'])}", fmt(inf["p50"], 1)])
    steps = [[s["name"], f"{st['offered_rps']:.1f}", fmt(st.get("scheduled_rps"), 1), f"{st['throughput_rps']:.1f}",
              fmt(st["tokens_per_s"]), *(fmt(st["latency_ms"][k]) for k in ("p50", "p90", "p99", "max")),
              ", ".join(f"{k} {v}" for k, v in st["errors"].items()) or "0",
              fmt(st["send_lag_ms"]["p99"], 1) + ("" if st["generator_kept_up"] else " (fell behind)"), cpu_cores(st)]
             for s in systems for st in sorted(s["steps"], key=lambda x: x["offered_rps"])]
    return {
        "headline": table(f"system | max offered req/s at p99 <= {slo_ms:g} ms | done req/s | tokens/s | vs "
                          "one-at-a-time | p50 ms | p90 ms | p99 ms | vectors vs sentence-transformers (min cos) | "
                          "what broke at the next rate", headline, "lrrrrrrrrl"),
        "bounds": table("system | " + " | ".join(f"p99 <= {b} ms" for b in P99_BOUNDS_MS),
                        ([s["name"], *(fmt(sustainable_at(s["steps"], b)) for b in P99_BOUNDS_MS)] for s in systems)),
        "stops": _stops(systems),
        "batches": table("system | offered req/s | batches | items/batch | tokens/batch | fill ratio | forward ms | "
                         "queue wait p50 / p99 ms | inference p50 ms", batches),
        "steps": table("system | offered req/s | sent req/s | done req/s | tokens/s | p50 ms | p90 ms | p99 ms | max ms | "
                       "errors | send lag p99 ms | CPU cores by process", steps, "lrrrrrrrrlrl")}


def run_header(meta: dict) -> list[str]:
    """The first lines of a block made from a `tokq bench service` JSON: its command and when."""
    return [f"Command: `{meta['command']}`  ",
            f"Date: {meta['started_at']} to {meta.get('finished_at', '?')} ({meta.get('duration_s', '?')} s)  "]


def other_cpu(meta: dict) -> str:
    if not (other := meta.get("other_processes_cpu")):
        return "CPU used by other processes during the run: not measured"
    return (f"processes outside this benchmark used {other['cpu_s']:.0f} CPU-seconds during the run "
            f"({other['share_of_machine']:.0%} of the machine's CPU time)")


def block_name(report: dict) -> str:
    """The main block, or a ``--section`` run's own: "tokq bench service, worker threads (AVX-512)"."""
    section = report["meta"].get("section")
    return cpu_block_name(f"{BLOCK}, {section}" if section else BLOCK, report["meta"]["machine"])


def markdown_section(report: dict, plot_paths: dict[str, str] | None = None) -> str:
    meta = report["meta"]
    m, w, o = meta["machine"], meta["workload"], meta["options"]
    slo_ms, tables = o["slo_ms"], _tables(report, o["slo_ms"])
    forward = ", ".join(f"b{b}: {ms:.0f} ms" for b, ms in meta.get("forward_ms_by_budget", {}).items())
    lines = [
        cpu_heading("Service benchmark", m) + (f": {meta['section']}" if meta.get("section") else ""), "",
        *run_header(meta),
        f"Machine: {cpu_label(m)}, {m['num_cpus']} CPUs, {m['platform']}; load average at start "
        f"{' '.join(m.get('loadavg_at_start', []))}, at end {' '.join(meta.get('loadavg_at_end', []))} (1/5/15-minute "
        "load averages, this run's own processes included). Everything (load generator, gateway, worker, Redis, "
        "baselines) ran on this one machine.  ",
        f"Machine state: {meta.get('note') or 'not stated'}; {other_cpu(meta)}  ",
        f"Versions: {', '.join(f'{k} {v}' for k, v in m['versions'].items())}  ",
        f"Workload: {meta.get('workload_source', '?')}: {w['num_queries']} queries, tokens p50 {w['p50_tokens']:.0f} / "
        f"p90 {w['p90_tokens']:.0f} / p99 {w['p99_tokens']:.0f} / max {w['max_tokens']} (capped at the model's 256). "
        "One query per request.  ",
        f"Load: open loop, {o['arrivals']} arrivals, {o['step_duration_s']:g} s per step, rate x{o['step_factor']:g} per "
        f"step from {o['start_rate']:g} req/s, then one bisection; latency counted from each request's intended send "
        f"time; client deadline {o['timeout_s']:g} s (p99 of an overloaded step is capped near it). Torch threads: "
        f"{o['threads']} per baseline model process, and `tokq up`'s own choice for its worker (cores - 1), the same "
        "number.  ",
        f"Single-batch forward time (tokq engine, full budget packed from the workload): {forward or '–'}.", "",
        f"### Sustainable throughput at p99 <= {slo_ms:g} ms", "",
        f"Rates come from the step grid (x{o['step_factor']:g}, one bisection), so systems whose limits fall between "
        "the same two grid points show the same rate, and ratios are quantized by the grid. `>=` marks a rate where "
        "the load generator, not the server, gave out.", "", *tables["headline"], "",
        "### Targets", "", *_targets(report, slo_ms), "",
        "### Highest rate meeting other p99 bounds (same steps)", "", *tables["bounds"], "",
        "### Batches (read from tokq's worker metrics and queue counters; timings from responses)", "",
        *tables["batches"], "", "### Why claims stopped (tokq's worker metrics and lane gauges, per step)", "",
        "Share of claims by the reason their batch stopped growing (`tokq_worker_claim_stops_total{reason}`: `full`, the "
        "budget was reached; `dry`, the lanes ran out; `heavy_item`, a heavy item did not fit; `lookahead`, the look-ahead "
        "ran out), and mean tokens queued per lane (`tokq_queue_lane_queued_tokens{lane}`, read every "
        f"{LANE_SAMPLE_S:g} s from 1 s into the step; the gateway refreshes it every 2 s).", "", *tables["stops"], ""]
    if plot_paths:
        lines += ["### Figures", "", *(f"![{name}]({path})" for name, path in plot_paths.items()), ""]
    lines += ["### Every step", "", "<details><summary>every offered rate of every system (p99 of overloaded steps is "
              "capped near the client deadline)</summary>", "", *tables["steps"], "", "</details>", "",
              f"Infinity (`infinity-emb`): {meta.get('infinity', 'not measured')}.", "",
              f"ONNX export for the ONNX Runtime baselines: {meta.get('onnx_export') or 'none (not asked for)'}. Every "
              "system's vectors of the probe queries (one request per query) are compared with sentence-transformers "
              "encoding each alone before it is measured; a baseline below cosine 0.9999 is not measured and its figure "
              "does not count.", ""]
    return block(block_name(report), lines, generated_by=BLOCK) + "\n"


def budget_verdict(report: dict) -> dict:
    """The profiled budget's sustainable rate against the best fixed budget's."""
    check = report["budget_check"]
    profiled = check["profiled_budget"]
    rates = {s["token_budget"]: s["sustainable_rps"] for s in report["systems"] if s["kind"] == "tokq"}
    fixed = {b: rates[b] for b in check["fixed_budgets"] if b in rates}
    best = max(fixed, key=fixed.get)
    ratio = rates.get(profiled, 0.0) / fixed[best] if fixed[best] > 0 else 0.0
    return {"profiled_budget": profiled, "profiled_rps": rates.get(profiled, 0.0), "best_fixed_budget": best,
            "best_fixed_rps": fixed[best], "ratio": round(ratio, 3), "min_ratio": MIN_RATIO, "passes": ratio >= MIN_RATIO,
            "profiled_is_a_fixed_budget": profiled in fixed}


def budget_section(report: dict, profile_png: str | None = None) -> str:
    meta, check, v = report["meta"], report["budget_check"], budget_verdict(report)
    prof, o, m = check["profile"], meta["options"], meta["machine"]
    rec, slo_ms, rows = prof["recommendation"] or {}, meta["options"]["slo_ms"], []
    for s in (s for s in report["systems"] if s["kind"] == "tokq"):
        b, at = s["token_budget"], s.get("sustainable") or {}
        role = ("profiled" + (" and fixed" if v["profiled_is_a_fixed_budget"] else "")) if b == v["profiled_budget"] \
            else "fixed"
        rows.append([f"{b} ({role})", fmt(meta.get("forward_ms_by_budget", {}).get(str(b))), fmt(s["sustainable_rps"]),
                     fmt((at.get("latency_ms") or {}).get("p99")), fmt((at.get("batches") or {}).get("tokens_per_batch")),
                     f"{s['sustainable_rps'] / v['best_fixed_rps']:.2f}x" if v["best_fixed_rps"] else "–"])
    lines = [
        "## Budget check: the profiled budget against fixed budgets", "", *run_header(meta),
        f"Machine: {m['cpu']}, {m['num_cpus']} CPUs; device `{check['device']}`; load average at start "
        f"{' '.join(m.get('loadavg_at_start', []))}, at end {' '.join(meta.get('loadavg_at_end', []))} (this run's own "
        f"processes included). **{machine_cores(m['num_cpus'], capital=True)}: load generator, gateway, worker and Redis "
        "compete for the same cores, and other people's work runs beside them; rates move by 10-20% between runs.** "
        f"{other_cpu(meta)[:1].upper()}{other_cpu(meta)[1:]}.  ",
        f"Machine state: {meta.get('note') or 'not stated'}  ",
        f"Load: open loop, {o['arrivals']} arrivals, {o['step_duration_s']:g} s per step, x{o['step_factor']:g} per step "
        f"from {o['start_rate']:g} req/s, then {o['num_refinements']} bisections (resolution "
        f"~{(o['step_factor'] ** (0.5 ** o['num_refinements']) - 1) * 100:.0f}%); one query per request.", "",
        f"Profile (same run, before any load; {prof['device_name']}, {prof['threads']} torch thread(s) like the worker, "
        f"the bench's workload): {prof['summary']}", "",
        *table(f"tokq budget | forward ms (one full batch) | max offered req/s at p99 <= {slo_ms:g} ms | p99 ms there | "
               "tokens/batch there | vs best fixed", rows), "",
        f"- **Profiled budget within {1 - MIN_RATIO:.0%} of the best fixed budget's sustainable rate at p99 <= "
        f"{slo_ms:g} ms**: {v['profiled_budget']} tokens sustains {fmt(v['profiled_rps'])} req/s, the best fixed budget "
        f"({v['best_fixed_budget']}) {fmt(v['best_fixed_rps'])} req/s: {v['ratio']:.2f}x, "
        f"{'**met**' if v['passes'] else '**not met**'}.",
        f"- The profile chose {rec.get('token_budget')} tokens, limited by {rec.get('limited_by')}: {rec.get('reason', '')}."]
    # Did the budget cap any batch at the rates that decided it? If not, the rates differ by noise.
    tokq = [s for s in report["systems"] if s["kind"] == "tokq" and s.get("sustainable")]
    per_batch = [(s["sustainable"].get("batches") or {}).get("tokens_per_batch") or 0.0 for s in tokq]
    smallest = min((s["token_budget"] for s in tokq), default=0)
    if per_batch and max(per_batch) < BOUND_FRACTION * smallest:
        lines.append(f"- **The budget did not bind**: at each system's sustainable rate its batches held at most "
                     f"{max(per_batch):.0f} tokens on average, under {BOUND_FRACTION:.0%} of the smallest budget "
                     f"({smallest}); the rates above then differ by what else the machine was doing, not by the budget. "
                     "A verdict needs a run where the queue is deep enough to fill batches (a quieter machine, or a "
                     "GPU host).")
    if profile_png:
        lines += ["", f"![budget check profile]({profile_png})"]
    return block(BUDGET_BLOCK, [*lines, ""]) + "\n"


def render_outputs(report: dict, *, plots_dir: str | None, results_md: str | None) -> list[str]:
    """Write the figures and/or the section (the budget check's for a --budget-check run)."""
    written, links = [], {}
    base = Path(results_md).parent if results_md else Path(".")
    if plots_dir:
        if "budget_check" in report:
            from tokq.profiling.profile.plot import plot_profile

            figures = [(PROFILE_PNG, lambda r, p: plot_profile(r["budget_check"]["profile"], p))]
        else:
            from tokq.profiling.bench.service.plots import plot_latency, plot_throughput

            figures = [("bench_latency.png", plot_latency), ("bench_throughput.png", plot_throughput)]
        Path(plots_dir).mkdir(parents=True, exist_ok=True)
        for name, draw in figures:
            draw(report, Path(plots_dir) / name)
            written.append(str(Path(plots_dir) / name))
            links[name.removesuffix(".png").replace("_", " ")] = os.path.relpath(Path(plots_dir) / name, base)
    if results_md:
        if "budget_check" in report:
            write_block(results_md, BUDGET_BLOCK, budget_section(report, links.get("budget check profile")))
        else:
            write_block(results_md, block_name(report), markdown_section(report, links))
        written.append(results_md)
    return written


@click.command("report")
@click.argument("json_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False), default=None)
@click.option("--results-md", type=click.Path(dir_okay=False), default=None)
def report_command(json_path, plots_dir, results_md) -> None:
    """Re-render a `tokq bench service --out` JSON (figures, results section) without measuring again."""
    import json

    for path in render_outputs(json.loads(Path(json_path).read_text()), plots_dir=plots_dir, results_md=results_md):
        click.echo(f"wrote {path}")
