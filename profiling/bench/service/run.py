"""One `tokq bench service` run: for each system, start it, check its vectors, warm it up, drive it
open-loop (a step search to the SLO, or one fixed rate), read its batch figures, stop it; a rich
progress display shows which system and rate are running and how many requests came back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from tokq.profiling import harness
from tokq.profiling.bench import loadgen
from tokq.profiling.bench.proc_cpu import cores_between, cpu_by_role, machine_busy_s
from tokq.profiling.bench.service.systems import (SystemSpec, batch_stats, fetch_vectors, min_cosine, sender_factory,
                                                  start_system)
from tokq.profiling.results_md import command_line

WARMUP_S = 2.0
MIN_REQUESTS_PER_STEP = 20  # a step down from a failing first rate stops before fewer than this
MIN_COSINE = 0.9999  # a system's vectors against sentence-transformers', for its figure to count
SETTLE_S = 0.5  # pause between runs so one run's stragglers never land in the next
LANE_SAMPLE_S = 0.5  # lane gauges read this often in a step, from 1 s in (the gateway refreshes them every 2 s)


@dataclass(frozen=True)
class BenchOptions:
    arrivals: str = "poisson"  # poisson | replay
    rate: float | None = None  # one run at this rate instead of the step search
    slo_ms: float = 500.0
    start_rate: float = 25.0
    step_factor: float = 1.3
    max_steps: int = 20
    step_duration_s: float = 4.0
    timeout_s: float = 3.0
    threads: int = 1
    seed: int = 1
    num_refinements: int = 1
    generator_procs: int = 1  # load-generator processes (loadgen.GeneratorProcs past one)


async def measure(system, queries, options: BenchOptions, progress=None, *, label: str = "") -> dict:
    """Drive one system through the step search (or one fixed rate) and, for tokq, a run at half
    its sustainable rate."""
    make_sender = sender_factory(system, options.timeout_s)
    generators = (await asyncio.to_thread(loadgen.GeneratorProcs, make_sender, options.generator_procs)
                  if options.generator_procs > 1 else None)
    sender = None if generators else make_sender()
    pids = generators.pids if generators else []

    def cpu_now() -> dict[str, dict[int, float]]:
        """The system's processes by role, and the load generator: this process and any others."""
        return {**cpu_by_role(system.process_roles()),
                "load generator": {os.getpid(): time.process_time(), **cpu_by_role({"g": pids})["g"]}}

    async def sample_lanes(into: list[dict]) -> None:
        while True:
            await asyncio.sleep(LANE_SAMPLE_S * (1 + (not into)))
            with contextlib.suppress(OSError):
                into.append(await asyncio.to_thread(system.lane_tokens))

    async def run_at(rate: float, duration_s: float = options.step_duration_s) -> dict:
        if options.arrivals == "replay":
            arrivals = loadgen.replay_schedule(queries, rate, duration_s)
        else:
            arrivals = loadgen.poisson_schedule(queries, rate, duration_s, seed=options.seed)
        task = progress.add_task(f"{label} @ {rate:.0f} req/s", total=len(arrivals)) if progress else None
        before, cpu_before, wall_before = system.batch_snapshot(), cpu_now(), time.monotonic()
        lanes: list[dict] = []
        sampler = asyncio.create_task(sample_lanes(lanes)) if system.spec.kind == "tokq" else None
        if generators:  # the processes report at the end of the run, not per reply
            samples = await generators.run(arrivals)
            if progress:
                progress.advance(task, len(samples))
        else:
            samples = await loadgen.run_open_loop(sender, arrivals,
                                                  on_done=(lambda _s: progress.advance(task)) if progress else None)
        cpu_after, wall_s = cpu_now(), time.monotonic() - wall_before
        if sampler:
            sampler.cancel()
        summary = loadgen.summarize(samples, rate, duration_s)
        summary["batches"] = batch_stats(before, system.batch_snapshot())
        if lanes and summary["batches"]:  # mean tokens queued in each lane over the step
            summary["batches"]["queued_tokens"] = {lane: round(sum(x.get(lane, 0) for x in lanes) / len(lanes))
                                                   for lane in {lane for x in lanes for lane in x}}
        # Cores each part used during the step: a single-threaded part near 1.0 limits it.
        summary["cpu_cores"] = cores_between(cpu_before, cpu_after, wall_s)
        if progress:
            progress.console.print(
                f"{label} @ {rate:.0f} req/s: p50 {summary['latency_ms']['p50']:.0f} ms, p99 "
                f"{summary['latency_ms']['p99']:.0f} ms, {summary['throughput_rps']:.0f} req/s done, errors "
                f"{summary['errors'] or 0}{'' if summary['generator_kept_up'] else ', LOAD GENERATOR FELL BEHIND'}")
            progress.remove_task(task)
        await asyncio.sleep(SETTLE_S)
        return summary

    try:
        await run_at(options.start_rate, WARMUP_S)  # not recorded: caches, connections, JIT paths
        if options.rate is not None:
            only = await run_at(options.rate)
            ok = loadgen.within_slo(only, options.slo_ms)
            result = {"slo_ms": options.slo_ms, "sustainable_rps": only["offered_rps"] if ok else 0.0,
                      "sustainable": only if ok else None, "limit": loadgen.failure_reason(only, options.slo_ms),
                      "steps": [only]}
        else:
            result = await loadgen.step_search(run_at, start_rate_per_s=options.start_rate, slo_ms=options.slo_ms,
                                               factor=options.step_factor, max_steps=options.max_steps,
                                               num_refinements=options.num_refinements,
                                               min_rate_per_s=MIN_REQUESTS_PER_STEP / options.step_duration_s)
        result["half_load"] = None
        if system.spec.kind == "tokq" and result["sustainable_rps"] > 0:
            result["half_load"] = await run_at(result["sustainable_rps"] / 2)
        return result
    finally:
        if generators:
            await asyncio.to_thread(generators.close)
        else:
            await sender.close()


def own_cpu_s() -> float:
    """CPU-seconds of this process and of every child it has waited for: the whole run's."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def machine(cuda: str | None = None) -> dict:
    """The host, and the GPU's name where the systems run on one (``cuda``: its device)."""
    import grpc
    import sentence_transformers
    import torch
    import transformers

    return {**harness.machine(), "loadavg_at_start": harness.loadavg(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__,
                         "sentence_transformers": sentence_transformers.__version__, "grpcio": grpc.__version__},
            **({"gpu": torch.cuda.get_device_name(torch.device(cuda))} if cuda else {})}


def cuda_device(device: str) -> str | None:
    """The CUDA device a system given ``device`` runs on (None: the CPU)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else None
    return device if device.startswith("cuda") else None


async def check_vectors(system, probe) -> dict:
    """The system's vectors of the probe texts against sentence-transformers' (``probe``: texts,
    reference vectors); ``counts`` is False when they differ, with the reason."""
    texts, want = probe
    try:
        got = await fetch_vectors(system, texts)
    except Exception as exc:  # the check failing is a result too
        return {"num_probes": len(texts), "min_cos": None, "counts": False,
                "why": f"could not fetch its vectors: {type(exc).__name__}: {exc}"}
    if got.shape != want.shape:
        return {"num_probes": len(texts), "min_cos": None, "counts": False,
                "why": f"vectors of shape {got.shape}, sentence-transformers gives {want.shape}"}
    cos = min_cosine(got, want)
    return {"num_probes": len(texts), "min_cos": round(cos, 6), "counts": cos >= MIN_COSINE,
            "why": "" if cos >= MIN_COSINE else f"vectors differ from sentence-transformers: min cosine {cos:.6f} < {MIN_COSINE}"}


async def run_bench(specs: list[SystemSpec], queries, options: BenchOptions, *, console=None, probe=None) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tokq.profiling.workload import describe

    started = datetime.now(timezone.utc)
    report = {"meta": {"command": command_line(), "started_at": started.isoformat(timespec="seconds"),
                       "machine": machine(next(filter(None, map(cuda_device, (s.device for s in specs))), None)),
                       "options": asdict(options), "workload": describe(list(queries))}, "systems": []}
    log_dir = Path(tempfile.mkdtemp(prefix="tokq-bench-logs-"))
    busy_start_s, own_start_s = machine_busy_s(), own_cpu_s()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, refresh_per_second=4, disable=console is None or console.quiet)
    with progress:
        overall = progress.add_task("systems", total=len(specs))
        for spec in specs:
            progress.update(overall, description=f"starting {spec.label()}")
            log_path = log_dir / f"{spec.name.split()[0]}-{len(report['systems'])}.log"
            system = await asyncio.to_thread(start_system, spec, threads=options.threads, log_path=str(log_path))
            name = spec.label(system.token_budget, system.budget_source)
            try:
                vectors = await check_vectors(system, probe) if probe else None
                if vectors and not vectors["counts"] and spec.kind != "tokq":
                    progress.console.print(f"{name}: not measured, {vectors['why']}")
                    result = {"slo_ms": options.slo_ms, "sustainable_rps": 0.0, "sustainable": None,
                              "limit": f"not counted: {vectors['why']}", "steps": [], "half_load": None}
                else:
                    progress.update(overall, description=f"measuring {name}")
                    result = await measure(system, queries, options, progress, label=name)
            finally:
                await asyncio.to_thread(system.close)
            served = ({"token_budget": system.token_budget, "budget_source": system.budget_source}
                      if spec.kind == "tokq" else {})
            report["systems"].append({**system.spec.describe(), "name": name, **served, **result, "vectors": vectors,
                                      "log": str(log_path)})
            progress.advance(overall)
    duration_s = (datetime.now(timezone.utc) - started).total_seconds()
    if busy_start_s is not None:  # what other processes (other people's tests, builds) took meanwhile
        other_s = max(0.0, machine_busy_s() - busy_start_s - (own_cpu_s() - own_start_s))
        report["meta"]["other_processes_cpu"] = {"cpu_s": round(other_s, 1),
                                                 "share_of_machine": round(other_s / (duration_s * (os.cpu_count() or 1)), 3)}
    report["meta"].update(loadavg_at_end=harness.loadavg(), duration_s=round(duration_s, 1),
                          finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return report
