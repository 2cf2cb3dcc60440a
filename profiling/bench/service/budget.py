"""`tokq bench service --budget-check`: does the budget `tokq profile` recommends serve as well as the
best fixed budget? Both in one run on one machine: profile the worker's engine on the bench's
own workload under the bench's latency goal, then drive tokq at the profiled budget and at a few
fixed budgets, and compare their sustainable rates at that goal. Rendered as its own section of
a results file (its own markers: the main "Service benchmark" section is left alone).
"""

from __future__ import annotations

import os
from pathlib import Path


from tokq.profiling.bench.service.report import fmt, other_cpu, run_header
from tokq.profiling.results_md import machine_cores, markers, write_block

BLOCK = "tokq bench service --budget-check"
SECTION_START, SECTION_END = markers(BLOCK)
MIN_RATIO = 0.90  # the profiled budget's sustainable rate / the best fixed budget's
PROFILE_PNG = "budget_check_profile.png"
BOUND_FRACTION = 0.8  # batches this full of the smallest budget: the budget capped them


def profile_budget(queries, *, device: str, threads: int, slo_ms: float, max_tokens: int,
                   model_dir: str | None = None, on_progress=None) -> dict:
    """`tokq profile` on the engine a worker would load (same device, same threads), on the
    workload the bench sends, with the bench's goal; returns the profile report."""
    from tokq.profiling.profile.run import run_profile
    from tokq.profiling.profile.sweep import SweepConfig
    from tokq.workers.device import use_threads
    from tokq.workers.engine import Engine

    with use_threads(threads):
        engine = Engine.load(model_dir, device=device)
        config = SweepConfig(min_tokens=16, max_tokens=max_tokens, points_per_doubling=2,
                             target_s_per_point=0.5, stop_ms=2000.0)
        return run_profile(engine, queries, config, slo_p99_ms=slo_ms, workload_source="the bench workload",
                           on_progress=on_progress)


def verdict(report: dict) -> dict:
    """The profiled budget's sustainable rate against the best fixed budget's."""
    check = report["budget_check"]
    profiled = check["profiled_budget"]
    rates = {s["token_budget"]: s["sustainable_rps"] for s in report["systems"] if s["kind"] == "tokq"}
    fixed = {b: rates[b] for b in check["fixed_budgets"] if b in rates}
    best_budget = max(fixed, key=fixed.get)
    profiled_rps = rates.get(profiled, 0.0)
    ratio = profiled_rps / fixed[best_budget] if fixed[best_budget] > 0 else 0.0
    return {"profiled_budget": profiled, "profiled_rps": profiled_rps, "best_fixed_budget": best_budget,
            "best_fixed_rps": fixed[best_budget], "ratio": round(ratio, 3), "min_ratio": MIN_RATIO,
            "passes": ratio >= MIN_RATIO, "profiled_is_a_fixed_budget": profiled in fixed}


def _budget_bound(report: dict) -> str | None:
    """Whether the budget capped any batch at the rates that decided the verdict: if every run's
    batches stayed well under the smallest budget, the rates differ by noise, not by budget."""
    tokq = [s for s in report["systems"] if s["kind"] == "tokq" and s.get("sustainable")]
    per_batch = [((s["sustainable"].get("batches") or {}).get("tokens_per_batch") or 0.0) for s in tokq]
    if not per_batch:
        return None
    smallest = min(s["token_budget"] for s in tokq)
    if max(per_batch) < BOUND_FRACTION * smallest:
        return (f"- **The budget did not bind**: at each system's sustainable rate its batches held at most "
                f"{max(per_batch):.0f} tokens on average, under {BOUND_FRACTION:.0%} of the smallest budget "
                f"({smallest}); the rates above then differ by what else the machine was doing, not by the "
                "budget. A verdict needs a run where the queue is deep enough to fill batches (a quieter "
                "machine, or a GPU host).")
    return None


def markdown_section(report: dict, profile_png: str | None = None) -> str:
    meta, check = report["meta"], report["budget_check"]
    v = verdict(report)
    prof = check["profile"]
    rec = prof["recommendation"] or {}
    o, m = meta["options"], meta["machine"]
    slo_ms = o["slo_ms"]
    rows = [f"| tokq budget | forward ms (one full batch) | max offered req/s at p99 <= {slo_ms:g} ms | p99 ms there "
            "| tokens/batch there | vs best fixed |", "|---|---:|---:|---:|---:|---:|"]
    for s in report["systems"]:
        if s["kind"] != "tokq":
            continue
        b = s["token_budget"]
        role = ("profiled" + (" and fixed" if v["profiled_is_a_fixed_budget"] else "")) if b == v["profiled_budget"] \
            else "fixed"
        at = s.get("sustainable") or {}
        batches = at.get("batches") or {}
        vs_best = f"{s['sustainable_rps'] / v['best_fixed_rps']:.2f}x" if v["best_fixed_rps"] else "–"
        rows.append(f"| {b} ({role}) | {fmt(meta.get('forward_ms_by_budget', {}).get(str(b)))} "
                    f"| {fmt(s['sustainable_rps'])} | {fmt((at.get('latency_ms') or {}).get('p99'))} "
                    f"| {fmt(batches.get('tokens_per_batch'))} | {vs_best} |")
    result = "**met**" if v["passes"] else "**not met**"
    lines = [
        SECTION_START, "## Budget check: the profiled budget against fixed budgets", "",
        *run_header(meta),
        f"Machine: {m['cpu']}, {m['num_cpus']} CPUs; device `{check['device']}`; load average at start "
        f"{' '.join(m.get('loadavg_at_start', []))}, at end {' '.join(meta.get('loadavg_at_end', []))} "
        f"(this run's own processes included). **{machine_cores(m['num_cpus'], capital=True)}: load generator, "
        "gateway, worker and Redis compete for the same cores, and other people's work runs beside them; rates "
        f"move by 10-20% between runs.** {other_cpu(meta)[:1].upper()}{other_cpu(meta)[1:]}.  ",
        f"Machine state: {meta.get('note') or 'not stated'}  ",
        f"Load: open loop, {o['arrivals']} arrivals, {o['step_duration_s']:g} s per step, x{o['step_factor']:g} "
        f"per step from {o['start_rate']:g} req/s, then {o['num_refinements']} bisections (resolution "
        f"~{(o['step_factor'] ** (0.5 ** o['num_refinements']) - 1) * 100:.0f}%); one query per request.", "",
        f"Profile (same run, before any load; {prof['device_name']}, {prof['threads']} torch thread(s) like "
        f"the worker, the bench's workload): {prof['summary']}", "",
        *rows, "",
        f"- **Profiled budget within {1 - MIN_RATIO:.0%} of the best fixed budget's sustainable rate at p99 <= "
        f"{slo_ms:g} ms**: {v['profiled_budget']} tokens sustains {fmt(v['profiled_rps'])} req/s, the best fixed "
        f"budget ({v['best_fixed_budget']}) {fmt(v['best_fixed_rps'])} req/s: {v['ratio']:.2f}x, {result}.",
        f"- The profile chose {rec.get('token_budget')} tokens, limited by {rec.get('limited_by')}: "
        f"{rec.get('reason', '')}.",
    ]
    bound = _budget_bound(report)
    if bound is not None:
        lines.append(bound)
    if profile_png:
        lines += ["", f"![budget check profile]({profile_png})"]
    lines += ["", SECTION_END]
    return "\n".join(lines) + "\n"


def render(report: dict, *, results_md: str | None, plots_dir: str | None) -> list[str]:
    """Write the profile figure and/or the results file section; returns the paths written."""
    written, png_rel = [], None
    if plots_dir:
        from tokq.profiling.profile.plot import plot_profile

        Path(plots_dir).mkdir(parents=True, exist_ok=True)
        png = plot_profile(report["budget_check"]["profile"], Path(plots_dir) / PROFILE_PNG)
        written.append(str(png))
        png_rel = os.path.relpath(png, Path(results_md).parent if results_md else Path("."))
    if results_md:
        write_block(results_md, BLOCK, markdown_section(report, png_rel))
        written.append(results_md)
    return written
