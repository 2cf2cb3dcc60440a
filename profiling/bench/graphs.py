"""CUDA graphs against eager forwards (workers/cuda_graphs.py) on one GPU, for MiniLM and a Qwen3-0.6B-shaped
model: two engines sharing the weights, interleaved calls per batch size, wall and host CPU ms, vectors compared."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from tokq.profiling import harness
from tokq.profiling.results_md import block, command_line, publish, table

BLOCK = "tokq bench graphs"
SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def workload_batch(num_tokens: int, max_length: int, vocab: int, seed: int = 0):
    """Queries of the workload's lengths, the last cut, holding exactly ``num_tokens`` tokens."""
    from tokq.batch import PackedBatch
    from tokq.profiling.workload import query_lengths

    rng, lens, total = np.random.default_rng(seed), [], 0
    for n in query_lengths(num_tokens, seed):
        lens.append(min(int(n), max_length, num_tokens - total))
        total += lens[-1]
        if total == num_tokens:
            break
    return PackedBatch.pack([rng.integers(1, vocab, size=n) for n in lens])


def measure(graphed, eager, sizes, repeats: int) -> list[dict]:
    """Per size: median wall ms and CPU ms per call of each engine, and their vectors' agreement."""
    vocab, rows = int(graphed.info.config.get("vocab_size") or 1000), []
    for size in sizes:
        batch = workload_batch(size, graphed.info.max_length, vocab)
        engines = {"graphs": graphed, "eager": eager}
        for engine in engines.values():  # warm-up: the capture, allocator pools
            for _ in range(3):
                engine.embed(batch)
        wall, cpu = {name: [] for name in engines}, {name: 0.0 for name in engines}
        for i in range(repeats):
            for name in ("graphs", "eager") if i % 2 == 0 else ("eager", "graphs"):
                cpu_start, start = time.process_time(), time.perf_counter()
                engines[name].embed(batch)
                wall[name].append(time.perf_counter() - start)
                cpu[name] += time.process_time() - cpu_start
        got, want = graphed.embed(batch), eager.embed(batch)
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        graphs_ms, eager_ms = (statistics.median(wall[n]) * 1000 for n in ("graphs", "eager"))
        rows.append({"tokens": size, "sequences": batch.num_seqs,
                     "graphed": graphed.graphs is not None and graphed.graphs.covers(size),
                     "graphs_ms": graphs_ms, "eager_ms": eager_ms, "graphs_cpu_ms": cpu["graphs"] / repeats * 1000,
                     "eager_cpu_ms": cpu["eager"] / repeats * 1000, "min_cos": float(cos.min())})
        click.echo(f"{graphed.info.name}: {size} tokens, {batch.num_seqs} sequences: graphs {graphs_ms:.2f} ms, "
                   f"eager {eager_ms:.2f} ms ({eager_ms / graphs_ms:.2f}x)", err=True)
    return rows


def markdown(gpu: str, torch_version: str, results: list[dict], repeats: int, command: str) -> str:
    lines = [f"## CUDA graphs against eager forwards (`workers/cuda_graphs.py`), {gpu}", "",
             f"Command: `{command}`. {gpu}, torch {torch_version}. Each size: the workload's query lengths packed to "
             f"exactly that many tokens; {repeats} timed `Engine.embed` calls per engine (host batch to host vectors), "
             "the two engines interleaved, after warm-up runs that hold the capture. ms: medians. CPU ms: this "
             "process's CPU time per call. Past the graph limit (`--cuda-graph-tokens`, default 4096) both engines "
             "run eagerly.", ""]
    for r in results:
        graphs = r["graphs"]
        lines += [f"### {r['name']} ({r['dtype']}, attention {r['attention']}, {r['layers']} layers)", "",
                  *table("tokens | sequences | graphs ms | eager ms | eager / graphs | graphs CPU ms | eager CPU ms | "
                         "vectors, min cos", ([f"{row['tokens']:,}{'' if row['graphed'] else ' (both eager)'}",
                                               row["sequences"], f"{row['graphs_ms']:.2f}", f"{row['eager_ms']:.2f}",
                                               f"**{row['eager_ms'] / row['graphs_ms']:.2f}x**",
                                               f"{row['graphs_cpu_ms']:.2f}", f"{row['eager_cpu_ms']:.2f}",
                                               f"{row['min_cos']:.5f}"] for row in r["rows"]), "r" * 8),
                  "", f"{graphs['count']} graphs captured in {graphs['capture_s']:.1f} s all told"
                  + (f"; capture failed: {graphs['failed']}" if graphs["failed"] else "") + ".", ""]
    return block(BLOCK, lines)


@click.command("graphs")
@click.option("--repeats", default=20, show_default=True, type=click.IntRange(min=1))
@harness.results_md_option("gpu.md")
def graphs_command(repeats, results_md) -> None:
    """CUDA graphs against eager forwards, MiniLM and a Qwen3-0.6B-shaped model, on a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        click.echo("tokq bench graphs: no CUDA GPU here, nothing measured")
        return
    from tokq.profiling.bench.gpu import QWEN3_NAME, build_qwen3_shaped
    from tokq.workers.engine import Engine

    results = []
    with tempfile.TemporaryDirectory(prefix="tokq-bench-graphs-") as tmp:
        qwen3 = build_qwen3_shaped(Path(tmp) / QWEN3_NAME, vocab_size=8192)
        for name, path in (("all-MiniLM-L6-v2", None), (QWEN3_NAME, qwen3)):
            graphed = Engine.load(path, device="cuda", name=name if path else None)
            eager = Engine(graphed.info, graphed.model, graphed.device, graphed.dtype, graphed.attn_backend)
            rows, graphs = measure(graphed, eager, SIZES, repeats), graphed.graphs
            results.append({"name": name, "dtype": str(graphed.dtype).removeprefix("torch."),
                            "attention": graphed.attn_backend, "layers": len(graphed.model.layers), "rows": rows,
                            "graphs": {"count": graphs.num_graphs if graphs else 0,
                                       "capture_s": graphs.capture_s if graphs else 0.0,
                                       "failed": graphs.failed if graphs else "no graphs"}})
            del graphed, eager
            torch.cuda.empty_cache()
    publish(markdown(torch.cuda.get_device_name(0), torch.__version__, results, repeats, command_line()),
            results_md, BLOCK)
