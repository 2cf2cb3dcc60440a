"""`tokq profile`: measure a model's latency knee on this device and publish the token budget.

Parses flags and delegates: the sweep in ``sweep.py``, the fit in ``knee.py``, both run by ``run.py``, the figure in ``plot.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from tokq.config import DTYPES

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SLO_P99_MS = 500.0  # tokq.profiling.profile.knee.DEFAULT_SLO_P99_MS (not imported: keeps --help fast)


def publish_budget(redis_url: str, queue_name: str, token_budget: int) -> str:
    """Publish the queue's budget with the queue's own writer (tokq.queue.Queue.set_budget);
    running workers poll it. Returns the key."""
    import asyncio

    from tokq.connection import connect
    from tokq.queue import Queue

    async def publish() -> str:
        client = connect(redis_url, max_connections=1)
        try:
            queue = Queue(client, queue_name)
            await queue.set_budget(token_budget)
            return queue.keys.budget
        finally:
            await client.aclose()

    return asyncio.run(publish())


@click.command("profile")
@click.option("--model", "model_path", default=None, envvar="TOKQ_MODEL",
              help="Local model directory or Hugging Face repo id (ORG/NAME, from the HF cache) "
                   "[default: the bundled all-MiniLM-L6-v2].")
@click.option("--revision", default=None, envvar="TOKQ_REVISION", help="Hugging Face revision of a repo id.")
@click.option("--served-model-name", "served_model_name", default=None, envvar="TOKQ_SERVED_MODEL_NAME",
              help="Model name served (names the queue) [default: the repo id or directory name].")
@click.option("--device", default="auto", envvar="TOKQ_DEVICE", show_default=True,
              help="auto | cpu | cuda | cuda:N.")
@click.option("--dtype", default="auto", envvar="TOKQ_DTYPE", show_default=True,
              type=click.Choice(DTYPES), help="auto: bf16 where the device runs it natively "
              "(sm80+ GPUs, CPUs with AVX512_BF16/AMX), fp16 on sm70-75 GPUs, else fp32.")
@click.option("--attn-backend", default="auto", envvar="TOKQ_ATTN_BACKEND", show_default=True)
@click.option("--workload", "workload_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help='JSONL workload ({"id","text","tokens","t"} per line) for the length mix '
                   "[default: generated short queries].")
@click.option("--num-queries", default=4000, show_default=True, help="Size of the generated workload.")
@click.option("--seed", default=1, show_default=True)
@click.option("--min-tokens", default=16, show_default=True, help="Smallest batch on the grid.")
@click.option("--max-tokens", default=16384, show_default=True, help="Largest batch on the grid.")
@click.option("--points-per-doubling", default=2, show_default=True, help="Grid density.")
@click.option("--time-per-point-s", default=1.0, show_default=True,
              help="Keep timing a batch size until this much time is spent.")
@click.option("--min-repeats", default=3, show_default=True)
@click.option("--max-repeats", default=50, show_default=True)
@click.option("--stop-ms", default=2000.0, show_default=True,
              help="Stop the sweep once a batch takes longer than this.")
@click.option("--slo-p99-ms", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_SLO_P99_MS,
              show_default=True,
              help="The service's p99 latency goal. The budget is the largest batch whose forward takes at "
                   "most half of it (a request waits for the batch in progress, then its own), and no "
                   "larger than where throughput reaches 95% of its peak.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default="profile.json", show_default=True)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="PNG to write.")
@click.option("--apply", "apply_budget", is_flag=True, help="Publish the recommended budget to Redis.")
@click.option("--redis-url", default=lambda: os.environ.get("TOKQ_REDIS_URL", DEFAULT_REDIS_URL),
              show_default=DEFAULT_REDIS_URL, help="Where --apply publishes (env TOKQ_REDIS_URL).")
@click.option("--threads", "threads", type=click.IntRange(min=1), default=None, envvar="TOKQ_THREADS",
              help="CPU threads for torch [default: torch's own choice]. Fewer than the cores "
                   "helps on a shared machine: busy cores make multi-threaded ops wait on each other.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def profile_command(model_path, revision, served_model_name, device, dtype, attn_backend, workload_path, num_queries, seed,
                    min_tokens, max_tokens, points_per_doubling, time_per_point_s, min_repeats, max_repeats,
                    stop_ms, slo_p99_ms, out_path, plot_path, apply_budget, redis_url, threads,
                    quiet) -> None:
    """Find the token count where forward latency stops being flat, and the budget to serve at."""
    from rich.console import Console

    from tokq.profiling import workload
    from tokq.profiling.profile.sweep import SweepConfig
    from tokq.profiling.profile.run import run_profile

    try:
        config = SweepConfig(min_tokens=min_tokens, max_tokens=max_tokens,
                             points_per_doubling=points_per_doubling, min_repeats=min_repeats,
                             max_repeats=max_repeats, target_s_per_point=time_per_point_s, stop_ms=stop_ms)
        queries = (workload.load_jsonl(workload_path) if workload_path
                   else workload.generate(num_queries, seed=seed))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None

    from tokq.workers.device import use_threads
    from tokq.workers.engine import Engine

    console = Console(stderr=True, quiet=quiet)
    with use_threads(threads):  # process-wide: put back before the report is drawn
        with console.status("loading model"):
            try:
                engine = Engine.load(model_path, device=device, dtype=dtype, attn_backend=attn_backend,
                                     name=served_model_name, revision=revision)
            except (ValueError, FileNotFoundError) as exc:  # unsupported or missing model, device, dtype, backend
                raise click.ClickException(str(exc)) from None
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

    if apply_budget:
        budget = report["recommended_budget"]
        if budget is None:
            raise click.ClickException("no budget to apply: " + report["summary"])
        key = publish_budget(redis_url, engine.info.queue_name, budget)
        click.echo(f"published token budget {budget} to {key} at {redis_url}")


def budget_table(report: dict):
    """The goal, both caps and the budget, as a rich table."""
    from rich.table import Table

    rec = report["recommendation"]
    table = Table(title="token budget", show_header=False)
    table.add_row("latency goal (p99)", f"{rec['slo_p99_ms']:,.4g} ms")
    table.add_row("forward time it allows", f"{rec['max_batch_ms']:,.4g} ms")
    table.add_row("largest batch within it", f"{rec['latency_cap_tokens']} tokens" if rec["latency_cap_tokens"]
                  else "none measured")
    table.add_row(f"{rec['saturation_fraction']:.0%} of peak throughput at",
                  f"{rec['throughput_cap_tokens']} tokens ({rec['peak_tokens_per_s']:,.0f} tokens/s peak)")
    table.add_row("recommended budget", f"[bold]{rec['token_budget']}[/bold] tokens" if rec["token_budget"]
                  else "[bold red]none[/bold red]")
    table.add_row("limited by", rec["limited_by"] or "nothing fits the goal")
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
