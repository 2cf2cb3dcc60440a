"""How far each dtype's embeddings are from fp32's on the workload's queries (cosine, 10 nearest neighbours
kept), and each one's tokens/s, timed right after fp32 in interleaved rounds."""

from __future__ import annotations

import os
import statistics

import click
import numpy as np
import torch

from tokq.profiling import harness
from tokq.profiling.bench.runtime import load_engines, pack_in_order, timed
from tokq.profiling.results_md import block, command_line, machine_cores, markers, publish, table

BLOCK = "tokq bench dtypes"
SECTION_START, SECTION_END = markers(BLOCK)
NEIGHBOURS = 10
BUDGET = 1024


def neighbours(vectors: np.ndarray, k: int = NEIGHBOURS) -> np.ndarray:
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    sims = unit @ unit.T
    np.fill_diagonal(sims, -np.inf)
    return np.argpartition(-sims, k, axis=1)[:, :k]


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    cos = (ref * got).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)
    overlap = np.array([len(set(a) & set(b)) / NEIGHBOURS for a, b in zip(neighbours(ref), neighbours(got))])
    return {"cos_min": float(cos.min()), "cos_p1": float(np.percentile(cos, 1)), "cos_median": float(np.median(cos)),
            "nn_mean": float(overlap.mean()), "nn_min": float(overlap.min()), "finite": bool(np.isfinite(got).all())}


def run(*, num_queries: int, seed: int, rounds: int, dtypes: list[str], model: str | None, threads: int,
        command: str) -> str:
    from tokq.profiling.profile.batches import token_ids_for
    from tokq.profiling.workload import generate
    from tokq.workers import device as device_mod

    if threads:
        torch.set_num_threads(threads)
    engines, skipped = load_engines(model, {"float32": {"dtype": "float32"}, **{d: {"dtype": d} for d in dtypes}})
    ref = engines["float32"]
    make = token_ids_for(ref.info, seed=seed)
    ids = [make(q, ref.info.max_length) for q in generate(num_queries, seed=seed)]
    batches, num_tokens = pack_in_order(ids, BUDGET), sum(len(s) for s in ids)
    embed_all = lambda e: np.concatenate([e.embed(b) for b in batches])  # noqa: E731
    vectors = {name: embed_all(e) for name, e in engines.items()}  # also warms up
    rates = harness.interleaved(rounds, engines, lambda name: num_tokens / timed(lambda: embed_all(engines[name])))
    rows = []
    for name, engine in engines.items():
        c = compare(vectors["float32"], vectors[name])
        rows.append([name, engine.linear_backend, *(f"{c[k]:.6f}" for k in ("cos_min", "cos_p1", "cos_median")),
                     f"{100 * c['nn_mean']:.1f}%", f"{100 * c['nn_min']:.0f}%", f"{statistics.median(rates[name]):,.0f}",
                     f"{statistics.median(r / f for r, f in zip(rates[name], rates['float32'])):.2f}"
                     + ("" if c["finite"] else " (non-finite values!)")])
    rows += [[name, "-", f"skipped: {why}", "", "", "", "", "", ""] for name, why in skipped.items()]
    auto = device_mod.resolve_dtype("auto", torch.device("cpu"))
    return block(BLOCK, [
        "## Accuracy and speed per dtype (`--dtype`), CPU", "",
        f"Command: `{command}`. Model {ref.info.name}; {num_queries} queries of the project's workload generator "
        f"(seed {seed}: {num_tokens:,} tokens, token ids as `tokq profile` draws them), packed in {BUDGET}-token "
        f"batches. torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f} at the end; {machine_cores()}, so tokens/s move with other work, the ratios (each "
        f"dtype timed right after fp32, median of {rounds} per-round ratios) much less. `auto` on this CPU: "
        f"{str(auto).removeprefix('torch.')} (native bf16 dot products: {device_mod.cpu_has_native_bf16()}).", "",
        *table("dtype | linear kernel | cos vs fp32 min | p1 | median | 10-NN overlap mean | min | tokens/s | x fp32",
               rows, "llrrrrrrr"), ""])


@click.command("dtypes")
@click.option("--num-queries", default=1000, show_default=True)
@click.option("--seed", default=1, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--dtype", "dtypes", multiple=True, default=["bfloat16", "float16"], show_default=True,
              help="Compared with float32 (repeatable).")
@harness.model_option
@harness.threads_option
@harness.bench_options("model.md", rounds=None)
def dtypes_command(num_queries, seed, rounds, dtypes, model, threads, results_md) -> None:
    """How far each dtype's embeddings are from fp32's, and what each costs."""
    publish(run(num_queries=num_queries, seed=seed, rounds=rounds, dtypes=list(dtypes), model=model, threads=threads,
                command=command_line()), results_md, BLOCK)
