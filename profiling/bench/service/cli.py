"""`tokq bench service`: open-loop load through the whole service, against real baselines, in one run.

Each system (tokq at several budgets, FIFO and look-ahead; sentence-transformers one request at a
time; ONNX Runtime one at a time; padded dynamic batching; Infinity) is started as its own
processes, its vectors checked against sentence-transformers', warmed up, then driven by the
open-loop generator: in step mode the offered rate rises until p99 breaks ``--slo-ms``, giving each
system's highest sustainable rate at the same p99. Results go to a JSON file and, rendered by
report.py, to the "Service benchmark" section of profiling/results/service.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import click

from tokq.latency_goal import DEFAULT_SLO_P99_MS
from tokq.up import threads_per_worker

DEFAULT_INFINITY_BIN = Path(__file__).resolve().parents[3] / ".venv-infinity" / "bin" / "infinity_emb"
# Why Infinity runs from its own virtualenv (and how to make it), for the report.
INFINITY_WHY = ("`infinity-emb` 0.0.78 resolves offline without changing torch, but its `[server,torch]` extras pin "
                "numpy<2, sentence-transformers<4 (so transformers 4.57), rich<14 and click<8.2, which would downgrade "
                "the project's environment (numpy 2.4, transformers 5, sentence-transformers 6). So it is not installed "
                "in `.venv`; it runs from its own virtualenv with the same torch 2.13 CPU wheel: `make "
                ".venv-infinity/bin/infinity_emb` (`python3 -m venv .venv-infinity && .venv-infinity/bin/pip install "
                "torch==2.13.0 'infinity-emb[server,torch,optimum]==0.0.78'`; the optimum extra is its ONNX engine)")
ONNX_SYSTEMS = ("onnx", "infinity-onnx")  # the systems that run the ONNX export
NUM_PROBES = 48  # queries whose vectors each system must match before its figure counts


def find_infinity(path: str | None) -> str | None:
    """The `infinity_emb` to run: ``path``, else .venv-infinity's, else one on PATH."""
    import shutil

    return path or (str(DEFAULT_INFINITY_BIN) if DEFAULT_INFINITY_BIN.is_file() else shutil.which("infinity_emb"))


def optimum_cli_beside(infinity_bin: str | None) -> str | None:
    """optimum's exporter from Infinity's virtualenv, if it has one."""
    cli = Path(infinity_bin).with_name("optimum-cli") if infinity_bin else None
    return str(cli) if cli and cli.is_file() else None


def system_specs(names: list[str], *, budgets: list[int], profiled_budget: int | None, padded_max_batch: int,
                 padded_max_wait_ms: float, infinity_bin: str | None = None, onnx_dir: str = "",
                 infinity_onnx_dir: str = ""):
    from tokq.profiling.bench.service.systems import SystemSpec

    main_budget = budgets[-1]
    catalog = {
        "tokq": SystemSpec(f"tokq look-ahead b{main_budget}", "tokq", main_budget, None),
        "tokq-defaults": SystemSpec("tokq (`tokq up` defaults: {budget}, dtype auto)", "tokq"),
        "tokq-fifo": SystemSpec(f"tokq FIFO b{main_budget}", "tokq", main_budget, 0),
        "one-at-a-time": SystemSpec("one-at-a-time (sentence-transformers)", "one-at-a-time"),
        "onnx": SystemSpec("one-at-a-time (ONNX Runtime)", "onnx-one-at-a-time", onnx_dir=onnx_dir),
        "padded": SystemSpec(f"padded batching (<= {padded_max_batch} req, {padded_max_wait_ms:g} ms)", "padded-batching",
                             max_batch_size=padded_max_batch, max_wait_ms=padded_max_wait_ms)}
    if infinity_bin:
        catalog["infinity"] = SystemSpec(f"Infinity torch (HTTP, batch <= {padded_max_batch})", "infinity",
                                         max_batch_size=padded_max_batch, infinity_bin=infinity_bin)
        catalog["infinity-onnx"] = SystemSpec(f"Infinity ONNX, mean pooling (HTTP, batch <= {padded_max_batch})",
                                              "infinity", max_batch_size=padded_max_batch, infinity_bin=infinity_bin,
                                              engine="optimum", onnx_dir=infinity_onnx_dir or onnx_dir)
    for b in budgets[:-1]:
        catalog[f"tokq-b{b}"] = SystemSpec(f"tokq look-ahead b{b}", "tokq", b, None)
    for n in (int(name[len("tokq-defaults-t"):]) for name in names if re.fullmatch(r"tokq-defaults-t[1-9]\d*", name)):
        catalog[f"tokq-defaults-t{n}"] = SystemSpec(f"tokq ({{budget}}, dtype auto, {n} worker thread{'s' * (n > 1)})",
                                                   "tokq", worker_threads=n)
    if profiled_budget and profiled_budget not in budgets:
        catalog["tokq-profiled"] = SystemSpec(f"tokq look-ahead b{profiled_budget} (profiled)", "tokq",
                                              profiled_budget, None)
    names = list(catalog) if names == ["all"] else names
    if unknown := [n for n in names if n not in catalog]:
        hint = " (infinity: no infinity_emb found; see --infinity-bin)" if {"infinity", "infinity-onnx"} & set(unknown) else ""
        raise click.UsageError(f"unknown system(s) {unknown}; known: {', '.join(catalog)}{hint}")
    return [catalog[n] for n in names]


def reference_vectors(queries, n: int, *, model_dir: str | None = None, device: str = "cpu"):
    """``n`` probe texts spread over the workload (short and long) and sentence-transformers'
    vectors of each, encoded alone: what every system's vectors are checked against."""
    import numpy as np

    from tokq.profiling.bench.baselines.server import load_model

    by_length = sorted((q for q in queries if q.text), key=lambda q: q.num_tokens)
    picks = [by_length[round(i * (len(by_length) - 1) / max(n - 1, 1))].text for i in range(n)]
    model = load_model(model_dir, device)
    return picks, np.stack([model.encode([t], normalize_embeddings=True)[0] for t in picks]).astype(np.float32)


def measure_forward_ms(queries, budgets: list[int], threads: int, repeats: int = 5, *, model_dir: str | None = None,
                       device: str = "cpu") -> dict[str, float]:
    """Median forward time of one full-budget batch packed from the workload mix (the worker's
    engine, this process, the same thread count as the systems)."""
    import statistics
    import timeit

    from tokq.profiling.profile.batches import BatchMaker, token_ids_for
    from tokq.workers.device import use_threads
    from tokq.workers.engine import Engine

    with use_threads(threads):
        engine = Engine.load(model_dir, device=device)
        make, out = BatchMaker(queries, token_ids_for(engine.info), engine.info.max_length), {}
        for batch, budget in ((make(b), b) for b in budgets):  # embed returns host arrays: a CUDA forward is done
            times = timeit.repeat(lambda: engine.embed(batch), number=1, repeat=repeats + 1)[1:]  # the first warms
            out[str(budget)] = round(1000 * statistics.median(times), 2)
        return out


def profile_budget(queries, *, device: str, threads: int, slo_ms: float, max_tokens: int,
                   model_dir: str | None = None) -> dict:
    """`tokq profile` on the engine a worker would load (same device, same threads), on the
    workload the bench sends, with the bench's goal; returns the profile report."""
    from tokq.profiling.profile.run import run_profile
    from tokq.profiling.profile.sweep import SweepConfig
    from tokq.workers.device import use_threads
    from tokq.workers.engine import Engine

    with use_threads(threads):
        config = SweepConfig(min_tokens=16, max_tokens=max_tokens, points_per_doubling=2, target_s_per_point=0.5,
                             stop_ms=2000.0)
        return run_profile(Engine.load(model_dir, device=device), queries, config, slo_p99_ms=slo_ms,
                           workload_source="the bench workload")


@click.command("service")
@click.option("--all", "run_all", is_flag=True, help="Every system: tokq budgets, FIFO, and all baselines.")
@click.option("--system", "systems", multiple=True,
              help="tokq | tokq-defaults | tokq-defaults-t<threads> | tokq-fifo | tokq-b<N> | tokq-profiled | one-at-a-time | onnx | padded | "
                   "infinity | infinity-onnx (repeatable) [default: tokq and one-at-a-time].")
@click.option("--workload", "workload_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSONL workload [default: ../shared/workloads/short_queries.jsonl, else generated].")
@click.option("--num-queries", default=4000, show_default=True, help="Size of a generated workload.")
@click.option("--seed", default=1, show_default=True)
@click.option("--arrivals", type=click.Choice(["poisson", "replay"]), default="poisson", show_default=True,
              help="poisson: steady rate; replay: the workload's own (bursty) timestamps rescaled to the rate.")
@click.option("--rate", type=float, default=None,
              help="One run at this offered rate (req/s) instead of the step search.")
@click.option("--slo-ms", default=DEFAULT_SLO_P99_MS, show_default=True, help="p99 latency a sustainable rate must meet.")
@click.option("--start-rate", default=25.0, show_default=True, help="First step's offered rate (req/s).")
@click.option("--step-factor", default=1.3, show_default=True, help="Rate multiplier between steps.")
@click.option("--max-steps", default=20, show_default=True)
@click.option("--step-duration-s", default=4.0, show_default=True, help="Seconds of arrivals per step.")
@click.option("--timeout-ms", default=3000, show_default=True, help="Client deadline of each request.")
@click.option("--token-budgets", default="256,1024", show_default=True,
              help="tokq token budgets, comma-separated; the last is the main one.")
@click.option("--profile-json", type=click.Path(dir_okay=False), default="profiling/profile.json",
              show_default=True, help="`tokq profile --out` report whose budget is also measured, if present.")
@click.option("--profiled-budget", type=int, default=None,
              help="The budget `tokq profile` recommended, when its JSON is not at hand (overrides --profile-json).")
@click.option("--padded-max-batch", default=32, show_default=True,
              help="Inputs per batch of the padded baseline, and Infinity's --batch-size.")
@click.option("--padded-max-wait-ms", default=10.0, show_default=True)
@click.option("--infinity-bin", default=None, envvar="TOKQ_BENCH_INFINITY_BIN",
              help="infinity_emb executable [default: .venv-infinity/bin/infinity_emb, else on PATH; "
                   "none found: Infinity is left out and the report says why].")
@click.option("--threads", default=0, show_default=True,
              help="Intra-op threads of each baseline's model process; 0 = what `tokq up` gives its one "
                   "worker (cores - 1, at least 1), so both sides compute on the same threads.")
@click.option("--device", default="cpu", show_default=True,
              help="Device of tokq's worker and the sentence-transformers baselines (cuda: see `make bench-gpu`).")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Model directory for tokq and the sentence-transformers baselines [default: bundled "
                   "all-MiniLM-L6-v2; ONNX and Infinity always run the bundled model].")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default="bench.json", show_default=True)
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False), default=None,
              help="Write bench_latency.png and bench_throughput.png here.")
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite the 'Service benchmark' section of this file (profiling/results/service.md).")
@click.option("--budget-check", is_flag=True,
              help="Profile the worker's engine in this run (goal: --slo-ms), then measure tokq at the profiled "
                   "budget beside each of --token-budgets; writes its own section of the results file and, with --plots, "
                   "the profile figure (budget_check_profile.png).")
@click.option("--refinements", type=int, default=None,
              help="Bisections after the step search [default: 1; 3 with --budget-check, ~3% resolution].")
@click.option("--profile-max-tokens", default=4096, show_default=True,
              help="Largest batch --budget-check profiles (raise it on a GPU).")
@click.option("--section", default="", help="Write a block of its own, headed '...: SECTION', not the main one.")
@click.option("--note", default="", help="Free text for the report (e.g. whether the machine was idle).")
@click.option("--quiet", is_flag=True, help="No progress display.")
@click.option("--gateway-procs", type=click.IntRange(0, 64), default=0, show_default=True,
              help="tokq systems: gateway processes (`tokq up --gateway-procs`; one serves up to ~3,000 calls/s; "
                   "0: as tokq up chooses).")
@click.option("--generator-procs", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Load-generator processes (one sends up to ~3,000 calls/s; a GPU-served tokq needs more).")
def service_command(run_all, systems, workload_path, num_queries, seed, arrivals, rate, slo_ms, start_rate,
                    step_factor, max_steps, step_duration_s, timeout_ms, token_budgets, profile_json, profiled_budget,
                    padded_max_batch, padded_max_wait_ms, infinity_bin, threads, device, model_dir, out_path,
                    plots_dir, results_md, budget_check, refinements, profile_max_tokens, section, note, quiet,
                    gateway_procs, generator_procs) -> None:
    """Open-loop load through tokq and its baselines; sustainable rate at a p99 SLO."""
    import dataclasses
    import shutil
    import tempfile

    from rich.console import Console

    from tokq.model.info import ModelInfo, bundled_model_path
    from tokq.profiling.bench import loadgen
    from tokq.profiling.bench.service.report import budget_verdict, render_outputs
    from tokq.profiling.bench.service.run import BenchOptions, run_bench
    from tokq.workers.budget import default_budget as device_default_budget

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        budget_list = [int(b) for b in token_budgets.split(",") if b.strip()]
        if not budget_list or min(budget_list) < 1:
            raise ValueError("--token-budgets needs positive integers")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    names = ["all"] if run_all else (list(systems) or ["tokq", "one-at-a-time"])
    default_budget = device_default_budget(device.split(":")[0])  # the worker's, before it fits it
    profiled = profiled_budget
    if profiled is None and profile_json and Path(profile_json).is_file():
        profiled = json.loads(Path(profile_json).read_text()).get("recommended_budget")
    infinity_bin = find_infinity(infinity_bin)
    console = Console(stderr=True, quiet=quiet)
    queries, source = loadgen.load_queries(workload_path, num_queries, seed)
    threads = threads or threads_per_worker(1)
    profile = None
    if budget_check:
        with console.status("profiling the worker's engine (tokq profile) under the goal"):
            profile = profile_budget(queries, device=device, threads=threads, slo_ms=slo_ms,
                                     max_tokens=profile_max_tokens, model_dir=model_dir)
        console.print(profile["summary"])
        if profile["recommended_budget"] is None:
            raise click.ClickException("the profile recommends no budget: " + profile["summary"])
        profiled = profile["recommended_budget"]
        names = [f"tokq-b{b}" for b in budget_list[:-1]] + ["tokq"] + ([] if profiled in budget_list else ["tokq-profiled"])
    export_root = Path(tempfile.mkdtemp(prefix="tokq-bench-onnx-"))
    try:
        onnx_export, infinity_onnx_dir = None, ""
        if names == ["all"] or set(ONNX_SYSTEMS) & set(names):
            from tokq.profiling.bench.baselines.onnx_model import export, for_infinity

            with console.status("exporting the model to ONNX"):
                onnx_export = export(bundled_model_path(), export_root / "onnx",
                                     optimum_cli=optimum_cli_beside(infinity_bin))
            infinity_onnx_dir = str(for_infinity(onnx_export.path, export_root / "onnx-infinity",
                                                 ModelInfo.load(None).max_length))
        specs = system_specs(names, budgets=budget_list, profiled_budget=profiled, padded_max_batch=padded_max_batch,
                             padded_max_wait_ms=padded_max_wait_ms, infinity_bin=infinity_bin,
                             onnx_dir=str(onnx_export.path) if onnx_export else "", infinity_onnx_dir=infinity_onnx_dir)
        specs = [s if s.kind in ("infinity", "onnx-one-at-a-time")
                 else dataclasses.replace(s, model=model_dir or "", device=device) for s in specs]
        if gateway_procs:  # maybe no longer what `tokq up`'s defaults run: the name says so
            specs = [dataclasses.replace(s, gateway_procs=gateway_procs, name=f"{s.name}, {gateway_procs} "
                                         f"gateway{'s' if gateway_procs > 1 else ''}") if s.kind == "tokq" else s
                     for s in specs]
        infinity_note = (f"measured ({infinity_bin}). {INFINITY_WHY}" if any(s.kind == "infinity" for s in specs)
                         else f"not measured ({'not asked for' if infinity_bin else 'no infinity_emb found'}). "
                              f"{INFINITY_WHY}")
        with console.status("sentence-transformers' own vectors of the probe queries"):
            probe = reference_vectors(queries, NUM_PROBES, model_dir=model_dir, device=device)
        options = BenchOptions(arrivals=arrivals, rate=rate, slo_ms=slo_ms, start_rate=start_rate,
                               step_factor=step_factor, max_steps=max_steps, step_duration_s=step_duration_s,
                               timeout_s=timeout_ms / 1000, threads=threads, seed=seed,
                               num_refinements=refinements if refinements is not None else (3 if budget_check else 1),
                               generator_procs=generator_procs)
        report = asyncio.run(run_bench(specs, queries, options, console=console, probe=probe))
        # The budgets tokq served at: a worker left to its default fits it at start.
        tokq_budgets = sorted({s["token_budget"] for s in report["systems"] if s["kind"] == "tokq"})
        with console.status("timing single-batch forward passes"):
            forward_ms = (measure_forward_ms(queries, tokq_budgets, threads, model_dir=model_dir, device=device)
                          if tokq_budgets else {})
    finally:
        shutil.rmtree(export_root, ignore_errors=True)
    report["meta"].update(workload_source=source, forward_ms_by_budget=forward_ms, note=note, infinity=infinity_note,
                          section=section, profiled_budget=profiled, default_budget=default_budget,
                          onnx_export=onnx_export.exporter if onnx_export else None)
    if budget_check:
        report["budget_check"] = {"device": device, "profile": profile, "profiled_budget": profiled,
                                  "fixed_budgets": budget_list}
        report["budget_check"]["verdict"] = v = budget_verdict(report)
        console.print(f"profiled budget {v['profiled_budget']}: {v['profiled_rps']:.0f} req/s; best fixed "
                      f"{v['best_fixed_budget']}: {v['best_fixed_rps']:.0f} req/s; {v['ratio']:.2f}x "
                      f"({'met' if v['passes'] else 'NOT met'}: >= {v['min_ratio']:.2f}x)")
    Path(out_path).write_text(json.dumps(report, indent=2) + "\n")
    written = render_outputs(report, plots_dir=plots_dir, results_md=results_md)
    console.print(f"wrote {', '.join([out_path, *written])}")
