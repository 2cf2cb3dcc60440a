"""The fp32 linear kernels on CPU, side by side: the C kernel (workers/kernels/cpu_linear.py) against
oneDNN, at the row counts a forward meets (a lone short query up to a full batch).

    tokq bench linear [--rows 1,8,16,32,64,256,1024] [--rounds 5] [--threads 1,2]
        [--model DIR] [--results-md profiling/results/model.md]

Per thread count and row count: the model's own linear calls in a forward
(forward_linear_calls: its shapes, with the epilogues it fuses), timed through each kernel, then
the whole forward of one batch of that many tokens (sequences of at most 32 tokens). Kernels
alternate within each round; ratios are medians of per-round ratios (oneDNN time / C time:
above 1, the C kernel is faster).
"""

from __future__ import annotations

import statistics

import click
import numpy as np
import torch

from tokq.batch import PackedBatch
from tokq.host import cpu_name, vector_extension
from tokq.profiling.bench.runtime import forward_linear_calls, load_engines, timed
from tokq.profiling.results_md import (command_line, cpu_block_name, cpu_heading, markers, shared_machine_note,
                                      write_block)

BLOCK = "tokq bench linear"
KERNELS = ("onednn", "c")


def linear_flops(calls) -> int:
    return sum(2 * args[0].shape[0] * args[1].shape[0] * args[1].shape[1] for _, args in calls)


def batch_of(num_tokens: int) -> PackedBatch:
    lengths = [32] * (num_tokens // 32) + ([num_tokens % 32] if num_tokens % 32 else [])
    return PackedBatch.pack([np.arange(1000, 1000 + n) for n in lengths])


def table(engines: dict, rows: list[int], rounds: int) -> list[str]:
    lines = ["| rows (tokens) | linears: oneDNN | C | GFLOP/s oneDNN | C | x | forward: oneDNN | C | x |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for num_rows in rows:
        calls = {k: forward_linear_calls(e, num_rows) for k, e in engines.items()}
        batch = batch_of(num_rows)
        linear_s = {k: [] for k in engines}
        forward_s = {k: [] for k in engines}
        for e in engines.values():  # warm-up
            e.embed(batch)
        for _ in range(rounds):
            for k, e in engines.items():
                with torch.inference_mode():
                    linear_s[k].append(timed(lambda c=calls[k]: [fn(*args) for fn, args in c]))
                forward_s[k].append(timed(lambda e=e: e.embed(batch)))
        flops = linear_flops(calls["c"])
        lin = {k: statistics.median(v) for k, v in linear_s.items()}
        fwd = {k: statistics.median(v) for k, v in forward_s.items()}
        lin_x = statistics.median(o / c for o, c in zip(linear_s["onednn"], linear_s["c"]))
        fwd_x = statistics.median(o / c for o, c in zip(forward_s["onednn"], forward_s["c"]))
        lines.append(f"| {num_rows:,} | {lin['onednn'] * 1e3:.2f} ms | {lin['c'] * 1e3:.2f} ms | "
                     f"{flops / lin['onednn'] / 1e9:.1f} | {flops / lin['c'] / 1e9:.1f} | {lin_x:.2f} | "
                     f"{fwd['onednn'] * 1e3:.2f} ms | {fwd['c'] * 1e3:.2f} ms | {fwd_x:.2f} |")
    return lines


def run(*, rows: list[int], rounds: int, threads: list[int], model: str | None, command: str) -> tuple[str, str]:
    engines, skipped = load_engines(model, {k: {"dtype": "float32", "linear": k} for k in KERNELS})
    if len(engines) < 2:
        raise click.ClickException(f"both kernels are needed: {skipped}")
    machine = {"cpu": cpu_name(), "vector_extension": vector_extension()}
    name = cpu_block_name(BLOCK, machine)
    start, end = markers(name, BLOCK)
    lines = [start, cpu_heading("fp32 linear kernels: the C kernel against oneDNN", machine), "",
             f"Command: `{command}`. Model {engines['c'].info.name}; torch {torch.__version__}, "
             f"{machine['cpu']}; {rounds} rounds, kernels alternating; medians. `auto` picks the C "
             "kernel for fp32 on one thread of an AVX2 CPU without AVX-512 (workers/kernels/cpu_linear.py)."]
    before = torch.get_num_threads()
    try:
        for count in threads:
            torch.set_num_threads(count)
            lines += ["", f"{count} thread{'s' if count > 1 else ''}:", "", *table(engines, rows, rounds)]
    finally:
        torch.set_num_threads(before)
    lines += ["", shared_machine_note(), "", end]
    return name, "\n".join(lines)


@click.command("linear")
@click.option("--rows", default="1,8,16,32,64,256,1024", show_default=True,
              help="Row counts (tokens in the batch), comma-separated.")
@click.option("--rounds", default=5, show_default=True)
@click.option("--threads", default="1", show_default=True, help="torch thread counts, comma-separated.")
@click.option("--model", default=None, help="Model directory [default: bundled all-MiniLM-L6-v2].")
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this file's block (e.g. profiling/results/model.md).")
def linear_command(rows, rounds, threads, model, results_md) -> None:
    """The C fp32 linear kernel against oneDNN, per row count."""
    name, section = run(rows=[int(r) for r in rows.split(",")], rounds=rounds,
                        threads=[int(t) for t in threads.split(",")],
                        model=model, command=command_line())
    click.echo(section)
    if results_md:
        write_block(results_md, name, section)
