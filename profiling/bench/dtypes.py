"""How far each dtype's embeddings are from fp32's, on the project's workload generator's queries
(profiling/workload.py lengths, the token ids `tokq profile` draws), and what each costs.

    tokq bench dtypes [--num-queries 1000] [--model DIR] [--dtype bfloat16 --dtype float16]
        [--threads 1] [--results-md profiling/results/model.md]

Per dtype: cosine of each query's vector with its fp32 vector (min, p1, median), and how many of
each query's 10 nearest neighbours (cosine, among all the queries) are the same as in fp32
(mean and min over queries). Speed: tokens/s of the packed forward over the whole workload in
1,024-token batches, each dtype timed right after fp32, rounds interleaved; ratios are medians
of per-round ratios. With --results-md, its block of a results file is rewritten.
"""

from __future__ import annotations

import os
import statistics

import click
import numpy as np
import torch

from tokq.batch import PackedBatch
from tokq.profiling.bench.runtime import load_engines, pack_in_order, timed
from tokq.profiling.profile.batches import token_ids_for
from tokq.profiling.results_md import command_line, machine_cores, markers, write_block
from tokq.profiling.workload import generate
from tokq.workers import device as device_mod
from tokq.workers.engine import Engine

BLOCK = "tokq bench dtypes"
SECTION_START, SECTION_END = markers(BLOCK)
NEIGHBOURS = 10
BUDGET = 1024


def workload_ids(engine: Engine, num_queries: int, seed: int) -> list[np.ndarray]:
    make = token_ids_for(engine.info, seed=seed)
    return [make(q, engine.info.max_length) for q in generate(num_queries, seed=seed)]


def embed_all(engine: Engine, batches: list[PackedBatch]) -> np.ndarray:
    return np.concatenate([engine.embed(b) for b in batches])


def neighbours(vectors: np.ndarray, k: int = NEIGHBOURS) -> np.ndarray:
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    sims = unit @ unit.T
    np.fill_diagonal(sims, -np.inf)
    return np.argpartition(-sims, k, axis=1)[:, :k]


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    cos = (ref * got).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
    ref_nn, got_nn = neighbours(ref), neighbours(got)
    overlap = np.array([len(set(a) & set(b)) / NEIGHBOURS for a, b in zip(ref_nn, got_nn)])
    return {"cos_min": float(cos.min()), "cos_p1": float(np.percentile(cos, 1)),
            "cos_median": float(np.median(cos)), "nn_mean": float(overlap.mean()),
            "nn_min": float(overlap.min()), "finite": bool(np.isfinite(got).all())}


def run(*, num_queries: int, seed: int, rounds: int, dtypes: list[str], model: str | None,
        threads: int, command: str) -> str:
    if threads:
        torch.set_num_threads(threads)
    engines = {"float32": Engine.load(model, device="cpu", dtype="float32")}
    others, skipped = load_engines(model, {dtype: {"dtype": dtype} for dtype in dtypes})
    engines.update(others)
    ref_engine = engines["float32"]
    ids = workload_ids(ref_engine, num_queries, seed)
    batches = pack_in_order(ids, BUDGET)
    num_tokens = sum(len(s) for s in ids)
    vectors = {name: embed_all(e, batches) for name, e in engines.items()}  # also warms up
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            rates[name].append(num_tokens / timed(lambda e=engine: embed_all(e, batches)))
    auto = device_mod.resolve_dtype("auto", torch.device("cpu"))
    lines = [
        SECTION_START,
        "## Accuracy and speed per dtype (`--dtype`), CPU",
        "",
        f"Command: `{command}`. Model "
        f"{ref_engine.info.name}; {num_queries} queries of the project's workload generator "
        f"(seed {seed}: {num_tokens:,} tokens, token ids as `tokq profile` draws them), packed "
        f"in {BUDGET}-token batches. torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.1f} at the end; {machine_cores()}, so tokens/s "
        f"move with other work, the ratios (each dtype timed right after fp32, median of "
        f"{rounds} per-round ratios) much less. `auto` on this CPU: "
        f"{str(auto).removeprefix('torch.')} (native bf16 dot products: "
        f"{device_mod.cpu_has_native_bf16()}).",
        "",
        "| dtype | linear kernel | cos vs fp32 min | p1 | median | 10-NN overlap mean | min | tokens/s | x fp32 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fp32_rates = rates["float32"]
    for name, engine in engines.items():
        c = compare(vectors["float32"], vectors[name])
        ratio = statistics.median(r / f for r, f in zip(rates[name], fp32_rates))
        lines.append(f"| {name} | {engine.linear_backend} | {c['cos_min']:.6f} | {c['cos_p1']:.6f} | "
                     f"{c['cos_median']:.6f} | {100 * c['nn_mean']:.1f}% | {100 * c['nn_min']:.0f}% | "
                     f"{statistics.median(rates[name]):,.0f} | {ratio:.2f} |"
                     + ("" if c["finite"] else " (non-finite values!)"))
    for name, why in skipped.items():
        lines.append(f"| {name} | - | skipped: {why} | | | | | | |")
    lines += ["", SECTION_END]
    return "\n".join(lines)


@click.command("dtypes")
@click.option("--num-queries", default=1000, show_default=True)
@click.option("--seed", default=1, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--dtype", "dtypes", multiple=True, default=["bfloat16", "float16"], show_default=True,
              help="Compared with float32 (repeatable).")
@click.option("--model", default=None, help="Model directory [default: bundled all-MiniLM-L6-v2].")
@click.option("--threads", default=0, show_default=True, help="torch threads (0: torch's default).")
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this file's block (e.g. profiling/results/model.md).")
def dtypes_command(num_queries, seed, rounds, dtypes, model, threads, results_md) -> None:
    """How far each dtype's embeddings are from fp32's, and what each costs."""
    section = run(num_queries=num_queries, seed=seed, rounds=rounds, dtypes=list(dtypes), model=model,
                  threads=threads, command=command_line())
    click.echo(section)
    if results_md:
        write_block(results_md, BLOCK, section)
