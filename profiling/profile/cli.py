"""`tokq profile`: measure a model's latency knee on this device and publish the token budget (the sweep:
sweep.py, the fit: knee.py, both run by run.py, the figure: plot.py)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import click

from tokq.config import ATTN_BACKENDS, DTYPES, ConfigError, WorkerConfig, env_var, load
from tokq.latency_goal import DEFAULT_SLO_P99_MS
from tokq.profiling.profile.knee import plain

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def check_reachable(redis_url: str, cluster: str = "auto") -> None:
    """``--apply``: Redis answers at ``redis_url`` and passes the workers' setup checks (check_redis), else
    a one-line error naming it (password masked)."""
    import redis

    from tokq.redis.connection import RedisSetupError, check_redis, connect_sync
    from tokq.redis.embedded import redact_url

    try:
        check_redis(redis_url, cluster)
        # yes/no skip a server that is not up or does not let INFO run: the PING finds the former.
        client = connect_sync(redis_url, cluster)
        try:
            client.ping()
        finally:
            client.close()
    except RedisSetupError as exc:
        raise click.ClickException(f"--apply: {exc}; nothing profiled") from None
    except (redis.RedisError, OSError, ValueError) as exc:
        raise click.ClickException(f"--apply: no Redis answers at {redact_url(redis_url)} "
                                   f"({type(exc).__name__}: {exc}); nothing profiled") from None


def publish_budget(redis_url: str, queue_name: str, token_budget: int, cluster: str = "auto") -> str:
    """Publish the queue's budget (Queue.set_budget), which running workers poll; returns the key."""
    import asyncio

    from tokq.redis.connection import connect
    from tokq.queue.shard import Queue

    async def publish() -> str:
        client = connect(redis_url, max_connections=1, cluster=cluster)
        try:
            queue = Queue(client, queue_name)
            await queue.set_budget(token_budget)
            return queue.keys.budget
        finally:
            await client.aclose()

    return asyncio.run(publish())


def worker_settings(device: str | None, threads: str | None, redis_cluster: str | None) -> WorkerConfig:
    """The settings profile shares with the workers, read and checked as a worker does (flag, env var,
    default): a bad one is the worker's one-line usage error, before the model loads."""
    names = ("device", "threads", "redis_cluster")
    # Only these env vars: profile does not refuse a fleet env's other worker settings.
    env = {env_var(n): os.environ[env_var(n)] for n in names if env_var(n) in os.environ}
    try:
        return load(WorkerConfig, {"device": device, "threads": threads, "redis_cluster": redis_cluster},
                    env=env)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def fleet_slo_p99_ms() -> float:
    """--slo-p99-ms's default: the workers' TOKQ_LATENCY_GOAL_MS where set and not 0 (workers: no goal),
    else DEFAULT_SLO_P99_MS: a budget needs some goal."""
    name = env_var("latency_goal_ms")
    raw = os.environ.get(name)
    if raw is None:
        return DEFAULT_SLO_P99_MS
    try:
        goal = load(WorkerConfig, env={name: raw}).latency_goal_ms
    except ConfigError:  # its message names the workers' --latency-goal-ms, not a profile flag
        meta = {f.name: f.metadata for f in dataclasses.fields(WorkerConfig)}["latency_goal_ms"]
        raise click.UsageError(f"{name}={raw!r} is not a latency goal workers take (whole ms, "
                               f"{meta['min']}..{meta['max']}); it is --slo-p99-ms's default: fix it, "
                               "or give --slo-p99-ms") from None
    return float(goal or DEFAULT_SLO_P99_MS)


@click.command("profile")
@click.option("--model", "model_path", default=None, envvar="TOKQ_MODEL",
              help="Local model directory or Hugging Face repo id (ORG/NAME, from the HF cache) "
                   "[default: the bundled all-MiniLM-L6-v2].")
@click.option("--revision", default=None, envvar="TOKQ_REVISION", help="Hugging Face revision of a repo id.")
@click.option("--served-model-name", "served_model_name", default=None, envvar="TOKQ_SERVED_MODEL_NAME",
              help="Model name served (names the queue) [default: the repo id or directory name].")
@click.option("--device", default=None, metavar="DEVICE", help="auto | cpu | cuda | cuda:N [env TOKQ_DEVICE; default: auto].")
@click.option("--dtype", default="auto", envvar="TOKQ_DTYPE", show_default=True, type=click.Choice(DTYPES),
              help="auto: bf16 where the device runs it natively, fp16 on sm70-75 GPUs, else fp32.")
@click.option("--attn-backend", default="auto", envvar="TOKQ_ATTN_BACKEND", show_default=True,
              type=click.Choice(ATTN_BACKENDS))
@click.option("--cuda-graph-tokens", type=click.IntRange(min=0), default=WorkerConfig.cuda_graph_tokens,
              envvar="TOKQ_CUDA_GRAPH_TOKENS", show_default=True,
              help="CUDA: batches of at most this many tokens replay CUDA graphs, as the worker's (0: none).")
@click.option("--workload", "workload_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help='JSONL workload ({"id","text","tokens","t"} lines) [default: generated short queries].')
@click.option("--num-queries", default=4000, show_default=True, type=click.IntRange(min=1),
              help="Size of the generated workload.")
@click.option("--seed", default=1, show_default=True)
@click.option("--min-tokens", default=16, show_default=True, help="Smallest batch on the grid.")
@click.option("--max-tokens", default=16384, show_default=True, help="Largest batch on the grid.")
@click.option("--points-per-doubling", default=2, show_default=True, help="Grid density.")
@click.option("--time-per-point-s", default=1.0, show_default=True, help="Time each batch size at least this long.")
@click.option("--min-repeats", default=3, show_default=True)
@click.option("--max-repeats", default=50, show_default=True)
@click.option("--stop-ms", default=2000.0, show_default=True, help="Stop once a batch takes longer than this.")
@click.option("--slo-p99-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="p99 latency goal: the budget is the largest batch whose forward takes at most half of it, "
                   "up to 95% of peak throughput [default: TOKQ_LATENCY_GOAL_MS where set and not 0, else "
                   f"{plain(DEFAULT_SLO_P99_MS)} ms].")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default="profile.json", show_default=True)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="PNG to write.")
@click.option("--apply", "apply_budget", is_flag=True, help="Publish the recommended budget to Redis.")
@click.option("--redis-url", default=lambda: os.environ.get("TOKQ_REDIS_URL", DEFAULT_REDIS_URL),
              show_default=DEFAULT_REDIS_URL, help="Where --apply publishes (env TOKQ_REDIS_URL).")
@click.option("--threads", "threads", default=None, metavar="N",
              help="torch CPU threads, as the worker's --threads [env TOKQ_THREADS; default: 0 = torch's default "
                   "capped by the usable CPUs]. Fewer than the cores helps on a shared machine.")
@click.option("--redis-cluster", default=None, metavar="[auto|yes|no]",
              help="--apply's Redis Cluster mode: auto asks the server (INFO) [env TOKQ_REDIS_CLUSTER; default: auto].")
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this model and device's block of this file (profiling/results/model.md).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def profile_command(model_path, revision, served_model_name, device, dtype, attn_backend, cuda_graph_tokens,
                    workload_path, num_queries, seed, min_tokens, max_tokens, points_per_doubling, time_per_point_s,
                    min_repeats, max_repeats, stop_ms, slo_p99_ms, out_path, plot_path, apply_budget, redis_url,
                    threads, redis_cluster, results_md, quiet) -> None:
    """Find the token count where forward latency stops being flat, and the budget to serve at."""
    from rich.console import Console

    from tokq.profiling import workload
    from tokq.profiling.profile.sweep import SweepConfig
    from tokq.profiling.profile.run import run_profile

    settings = worker_settings(device, threads, redis_cluster)
    if slo_p99_ms is None:  # the fleet's goal, read only where no flag overrides it
        slo_p99_ms = fleet_slo_p99_ms()
    try:
        config = SweepConfig(min_tokens=min_tokens, max_tokens=max_tokens, points_per_doubling=points_per_doubling,
                             min_repeats=min_repeats, max_repeats=max_repeats, target_s_per_point=time_per_point_s,
                             stop_ms=stop_ms)
        queries = workload.load_jsonl(workload_path) if workload_path else workload.generate(num_queries, seed=seed)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    for path in (out_path, plot_path, results_md):  # now, not after a sweep of minutes
        if path and not Path(path).resolve().parent.is_dir():
            raise click.UsageError(f"{path}: its folder does not exist")
    if apply_budget:
        check_reachable(redis_url, settings.redis_cluster)

    from tokq.model.source import model_errors_as_one_line
    from tokq.workers.device import use_threads, worker_threads
    from tokq.workers.engine import Engine

    console = Console(stderr=True, quiet=quiet)
    with use_threads(worker_threads(settings.threads)):  # process-wide: put back before the report is drawn
        with console.status("loading model"):
            with model_errors_as_one_line():  # unsupported or missing model, device, dtype, backend
                engine = Engine.load(model_path, device=settings.device, dtype=dtype, attn_backend=attn_backend,
                                     name=served_model_name, revision=revision, cuda_graph_tokens=cuda_graph_tokens)
        report = _run_with_progress(console, lambda on_progress: run_profile(
            engine, queries, config, slo_p99_ms=slo_p99_ms, seed=seed, on_progress=on_progress,
            workload_source=str(workload_path) if workload_path else f"generated (n={num_queries}, seed={seed})"))

    Path(out_path).write_text(json.dumps(report, indent=2) + "\n")
    if plot_path and report["points"]:
        from tokq.profiling.profile.plot import plot_profile

        plot_profile(report, plot_path)
    click.echo(report["summary"])
    if report["recommendation"]:
        Console().print(budget_table(report))
    click.echo(f"wrote {out_path}" + (f" and {plot_path}" if plot_path and report["points"] else ""))
    if results_md:
        from tokq.profiling.results_md import command_line, write_block

        name = block_name(report)
        plot = os.path.relpath(plot_path, Path(results_md).parent) if plot_path and report["points"] else None
        write_block(results_md, name, markdown_block(report, command_line(group="tokq"), plot))
        click.echo(f"rewrote its block of {results_md}")

    if apply_budget:
        budget = report["recommended_budget"]
        if budget is None:
            raise click.ClickException("no budget to apply: " + report["summary"])
        import redis

        from tokq.redis.embedded import redact_url

        try:
            key = publish_budget(redis_url, engine.info.queue_name, budget, settings.redis_cluster)
        except (redis.RedisError, OSError) as exc:  # Redis gone during the sweep: the report stays
            why = " ".join(f"{type(exc).__name__}: {exc}".split())
            raise click.ClickException(f"token budget {budget} not published: Redis at {redact_url(redis_url)} "
                                       f"failed ({why}); the profile is in {out_path}") from None
        click.echo(f"published token budget {budget} to {key} at {redact_url(redis_url)}")


def block_name(report: dict) -> str:
    """One results file block per model and device type."""
    return f"tokq profile ({report['model']}, {report['device'].split(':')[0]})"


def markdown_block(report: dict, command: str, plot: str | None = None) -> str:
    from tokq.profiling.results_md import block, machine_cores, table

    sweep, w, rec = report["sweep"], report["workload"], report["recommendation"] or {}
    points = report["points"]
    peak = max(points, key=lambda p: p["tokens_per_s"]) if points else None
    fmt = lambda v, unit="": "–" if v is None else f"{plain(v)}{unit}"  # noqa: E731
    lines = [
        f"## Profile (`tokq profile`): {report['model']} on {report['device_name']}", "",
        f"Command: `{command}`  ",
        f"Date: {report['started_at']} ({report['duration_s']:.0f} s); {report['dtype']}, attention "
        f"{report['attn_backend']}, torch {report['torch_version']}, {report['threads']} thread(s); load average "
        f"{' / '.join(fmt(x) for x in report['load_average'])} before / after. **{machine_cores(capital=True)}: "
        "other processes' load moves every latency; repeats are interleaved across batch sizes so it lands "
        "on every size alike.**  ",
        f"Workload: {w['source']}: {w['num_queries']} queries, tokens p50 {w['p50_tokens']:.0f} / p90 "
        f"{w['p90_tokens']:.0f} / max {w['max_tokens']}; token ids {w['token_ids']}.  ",
        f"Grid: {sweep['min_tokens']}-{sweep['max_tokens']} tokens, {len(points)} sizes measured"
        + (f" (stopped: {report['stopped_reason']})" if report.get("stopped_reason") else "") + ".", "",
        report["summary"], "",
        *table("knee (fit) | flat latency (fit) | slope | goal p99 | forward time it allows | largest batch within it "
               "| saturation | recommended budget | limited by | peak", [[
                   fmt(report["knee_tokens"], " tokens"), fmt(report["flat_ms"], " ms"),
                   fmt(report["slope_ms_per_token"], " ms/token"), fmt(rec.get("slo_p99_ms"), " ms"),
                   fmt(rec.get("max_batch_ms"), " ms"), fmt(rec.get("latency_cap_tokens"), " tokens"),
                   fmt(rec.get("throughput_cap_tokens"), " tokens"), f"**{fmt(rec.get('token_budget'), ' tokens')}**",
                   rec.get("limited_by") or "–",
                   f"{fmt(peak and peak['tokens_per_s'], ' tokens/s')} at {fmt(peak and peak['num_tokens'])}"]],
               "l" * 10), "", *([f"![profile]({plot})", ""] if plot else [])]
    return block(block_name(report), lines, generated_by="tokq profile")


def budget_table(report: dict):
    """The goal, both caps and the budget, as a rich table."""
    from rich.table import Table

    rec, table = report["recommendation"], Table(title="token budget", show_header=False)
    for row in [("latency goal (p99)", f"{plain(rec['slo_p99_ms'])} ms"),
                ("forward time it allows", f"{plain(rec['max_batch_ms'])} ms"),
                ("largest batch within it", f"{rec['latency_cap_tokens']} tokens" if rec["latency_cap_tokens"]
                 else "none measured"),
                (f"{rec['saturation_fraction']:.0%} of peak throughput at",
                 f"{rec['throughput_cap_tokens']} tokens ({rec['peak_tokens_per_s']:,.0f} tokens/s peak)"),
                ("recommended budget", f"[bold]{rec['token_budget']}[/bold] tokens" if rec["token_budget"]
                 else "[bold red]none[/bold red]"),
                ("limited by", rec["limited_by"] or "nothing fits the goal")]:
        table.add_row(*row)
    return table


def _run_with_progress(console, run):
    """Run ``run(on_progress)`` under a rich progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("profiling", total=None)

        def on_progress(text: str, completed: int, total: int) -> None:
            progress.update(task, description=text, completed=completed, total=total)

        return run(on_progress)
