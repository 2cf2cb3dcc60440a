"""The fp32 linear kernels on CPU side by side: the C kernel (workers/kernels/cpu_linear.py) against oneDNN,
on the model's own linear calls and whole forwards, per row count; ratios are medians of per-round ratios."""

from __future__ import annotations

import statistics

import click
import numpy as np
import torch

from tokq.batch import PackedBatch
from tokq.profiling import harness
from tokq.profiling.bench.runtime import forward_linear_calls, load_engines, timed
from tokq.profiling.harness import ratio
from tokq.profiling.results_md import (block, command_line, cpu_block_name, cpu_heading, publish, shared_machine_note,
                                       table)

BLOCK = "tokq bench linear"
KERNELS = ("onednn", "c")


def rows_table(engines: dict, rows: list[int], rounds: int) -> list[str]:
    cells = []
    for num_rows in rows:
        calls = {k: forward_linear_calls(e, num_rows) for k, e in engines.items()}
        lengths = [32] * (num_rows // 32) + ([num_rows % 32] if num_rows % 32 else [])
        batch = PackedBatch.pack([np.arange(1000, 1000 + n) for n in lengths])
        for e in engines.values():  # warm-up
            e.embed(batch)
        times = []  # per round: {"linear": {kernel: s}, "forward": {kernel: s}}
        for _ in range(rounds):
            t = {"linear": {}, "forward": {}}
            for k, e in engines.items():
                with torch.inference_mode():
                    t["linear"][k] = timed(lambda c=calls[k]: [fn(*args) for fn, args in c])
                t["forward"][k] = timed(lambda e=e: e.embed(batch))
            times.append(t)
        flops = sum(2 * args[0].shape[0] * args[1].shape[0] * args[1].shape[1] for _, args in calls["c"])
        lin, fwd = ({k: statistics.median(t[part][k] for t in times) for k in KERNELS} for part in ("linear", "forward"))
        x = {part: ratio(times, (part, "onednn"), (part, "c")) for part in ("linear", "forward")}
        cells.append([f"{num_rows:,}", f"{lin['onednn'] * 1e3:.2f} ms", f"{lin['c'] * 1e3:.2f} ms",
                      f"{flops / lin['onednn'] / 1e9:.1f}", f"{flops / lin['c'] / 1e9:.1f}", f"{x['linear']:.2f}",
                      f"{fwd['onednn'] * 1e3:.2f} ms", f"{fwd['c'] * 1e3:.2f} ms", f"{x['forward']:.2f}"])
    return table("rows (tokens) | linears: oneDNN | C | GFLOP/s oneDNN | C | x | forward: oneDNN | C | x", cells,
                 "r" * 9)


@click.command("linear")
@click.option("--rows", default="1,8,16,32,64,256,1024", show_default=True,
              help="Row counts (tokens in the batch), comma-separated.")
@click.option("--threads", default="1", show_default=True, help="torch thread counts, comma-separated.")
@harness.model_option
@harness.bench_options("model.md", rounds=5)
def linear_command(rows, threads, model, rounds, results_md) -> None:
    """The C fp32 linear kernel against oneDNN, per row count."""
    from tokq.host import cpu_name, vector_extension

    engines, skipped = load_engines(model, {k: {"dtype": "float32", "linear": k} for k in KERNELS})
    if len(engines) < 2:
        raise click.ClickException(f"both kernels are needed: {skipped}")
    machine = {"cpu": cpu_name(), "vector_extension": vector_extension()}
    lines = [cpu_heading("fp32 linear kernels: the C kernel against oneDNN", machine), "",
             f"Command: `{command_line()}`. Model {engines['c'].info.name}; torch {torch.__version__}, "
             f"{machine['cpu']}; {rounds} rounds, kernels alternating; medians. `auto` picks the C kernel for fp32 on "
             "one thread of an AVX2 CPU without AVX-512 (workers/kernels/cpu_linear.py)."]
    before = torch.get_num_threads()
    try:
        for count in (int(t) for t in threads.split(",")):
            torch.set_num_threads(count)
            lines += ["", f"{count} thread{'s' if count > 1 else ''}:", "",
                      *rows_table(engines, [int(r) for r in rows.split(",")], rounds)]
    finally:
        torch.set_num_threads(before)
    name = cpu_block_name(BLOCK, machine)
    publish(block(name, [*lines, "", shared_machine_note(), ""], generated_by=BLOCK), results_md, name)
