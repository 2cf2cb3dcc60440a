"""`tokq profile`: measure a model's latency knee on this device and publish the token budget.

Parses flags and delegates: the sweep and fit live in ``profile.py``, the figure in ``plot.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def publish_budget(redis_url: str, queue_name: str, budget_tokens: int) -> str:
    """SET the queue's budget key (an integer string); running workers poll it. Returns the key."""
    from tokq.connection import connect_sync
    from tokq.keys import QueueKeys

    key = QueueKeys(queue_name).budget
    client = connect_sync(redis_url)
    try:
        client.set(key, str(int(budget_tokens)))
    finally:
        client.close()
    return key


@click.command("profile")
@click.option("--model", "model_path", default=None, envvar="TOKQ_MODEL",
              help="Local model directory or Hugging Face repo id (ORG/NAME, from the HF cache) "
                   "[default: the bundled all-MiniLM-L6-v2].")
@click.option("--revision", default=None, envvar="TOKQ_REVISION", help="Hugging Face revision of a repo id.")
@click.option("--served-model-name", "--name", "model_name", default=None, envvar="TOKQ_SERVED_MODEL_NAME",
              help="Model name served (names the queue) [default: the repo id or directory name].")
@click.option("--device", default="auto", envvar="TOKQ_DEVICE", show_default=True,
              help="auto | cpu | cuda | cuda:N.")
@click.option("--dtype", default="auto", envvar="TOKQ_DTYPE", show_default=True,
              help="auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16.")
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
@click.option("--max-batch-ms", type=float, default=None,
              help="Latency ceiling for the recommended budget [default: 2x the flat latency].")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default="profile.json", show_default=True)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="PNG to write.")
@click.option("--apply", "apply_budget", is_flag=True, help="Publish the recommended budget to Redis.")
@click.option("--redis-url", default=lambda: os.environ.get("TOKQ_REDIS_URL", DEFAULT_REDIS_URL),
              show_default=DEFAULT_REDIS_URL, help="Where --apply publishes (env TOKQ_REDIS_URL).")
@click.option("--threads", "num_threads", type=click.IntRange(min=1), default=None, envvar="TOKQ_THREADS",
              help="CPU threads for torch [default: torch's own choice]. Fewer than the cores "
                   "helps on a shared machine: busy cores make multi-threaded ops wait on each other.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def profile_command(model_path, revision, model_name, device, dtype, attn_backend, workload_path, num_queries, seed,
                    min_tokens, max_tokens, points_per_doubling, time_per_point_s, min_repeats, max_repeats,
                    stop_ms, max_batch_ms, out_path, plot_path, apply_budget, redis_url, num_threads,
                    quiet) -> None:
    """Find the token count where forward latency stops being flat, and the budget to serve at."""
    from rich.console import Console

    from tokq.profiling import workload
    from tokq.profiling.profile import SweepConfig
    from tokq.profiling.profile_report import run_profile

    try:
        config = SweepConfig(min_tokens=min_tokens, max_tokens=max_tokens,
                             points_per_doubling=points_per_doubling, min_repeats=min_repeats,
                             max_repeats=max_repeats, target_s_per_point=time_per_point_s, stop_ms=stop_ms)
        queries = (workload.load_jsonl(workload_path) if workload_path
                   else workload.generate(num_queries, seed=seed))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None

    import torch

    from tokq.workers.engine import Engine

    console = Console(stderr=True, quiet=quiet)
    threads_before = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        with console.status("loading model"):
            try:
                engine = Engine.load(model_path, device=device, dtype=dtype, attn_backend=attn_backend,
                                     name=model_name, revision=revision)
            except (ValueError, FileNotFoundError) as exc:  # unsupported or missing model, device, dtype, backend
                raise click.ClickException(str(exc)) from None
        report = _run_with_progress(console, lambda on_progress: run_profile(
            engine, queries, config, max_batch_ms=max_batch_ms, seed=seed, on_progress=on_progress,
            workload_source=str(workload_path) if workload_path else f"generated (n={num_queries}, seed={seed})"))
    finally:
        torch.set_num_threads(threads_before)  # the setting is process-wide

    Path(out_path).write_text(json.dumps(report, indent=2) + "\n")
    if plot_path and report["points"]:
        from tokq.profiling.plot import plot_profile

        plot_profile(report, plot_path)
    click.echo(report["summary"])
    click.echo(f"wrote {out_path}" + (f" and {plot_path}" if plot_path and report["points"] else ""))

    if apply_budget:
        budget = report["recommended_budget"]
        if budget is None:
            raise click.ClickException("no budget to apply: " + report["summary"])
        key = publish_budget(redis_url, engine.info.queue_name, budget)
        click.echo(f"published token budget {budget} to {key} at {redis_url}")


def _run_with_progress(console, run):
    """Run ``run(on_progress)`` under a rich progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("profiling", total=None)

        def on_progress(text: str, completed: int, total: int) -> None:
            progress.update(task, description=text, completed=completed, total=total)

        return run(on_progress)
