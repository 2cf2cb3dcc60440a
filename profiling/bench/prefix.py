"""Shared-prompt benchmark: queries behind Qwen3-Embedding's instruction, the prompt computed once
(workers/prompt_attention.py) against the full forward, on random weights of its shapes, in the same run."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import torch

from tokq.batch import PackedBatch
from tokq.profiling import harness
from tokq.profiling.results_md import block, command_line, machine_cores, publish, table

VOCAB = 8192
FULL = "full forward"


def block_name(device_type: str) -> str:
    """One block per device type: a GPU run does not overwrite the CPU one."""
    return f"tokq bench prefix ({device_type})"


def build_model(path: Path, layers: int) -> None:
    import transformers

    torch.manual_seed(0)
    transformers.Qwen3Model(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, rope_theta=1_000_000.0, max_position_embeddings=1024,
        architectures=["Qwen3Model"])).save_pretrained(path)


def batches(seqs: list[np.ndarray], prompt_lens: list[int], budget: int, shared: bool) -> list[PackedBatch]:
    """Consecutive queries packed up to ``budget`` queued tokens (a longer query goes alone)."""
    out, current, cost = [], [], 0
    for i, seq in enumerate(seqs):
        tokens = len(seq) - (prompt_lens[i] if shared else 0)
        if current and cost + tokens > budget:
            out.append(current)
            current, cost = [], 0
        current.append(i)
        cost += tokens
    return [PackedBatch.pack([seqs[i] for i in b], prompt_lens=[prompt_lens[i] for i in b] if shared else 0)
            for b in out + ([current] if current else [])]


def time_system(engine, packed: list[PackedBatch]) -> float:
    from tokq.workers.device import synchronize

    synchronize(engine.device)
    start = time.perf_counter()
    for batch in packed:
        engine.embed(batch)
    synchronize(engine.device)
    return time.perf_counter() - start


def scenario(rng, num_queries: int, prompt: np.ndarray | None, fixed_len: int | None):
    from tokq.profiling.workload import query_lengths

    lens = np.full(num_queries, fixed_len) if fixed_len else query_lengths(num_queries, seed=1)
    queries = [rng.integers(1, VOCAB, size=int(n)) for n in lens]
    if prompt is None:
        return queries, [0] * num_queries
    return [np.concatenate([prompt, q]) for q in queries], [len(prompt)] * num_queries


@click.command("prefix")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--layers", default=2, show_default=True, help="Of the model's 28 (time scales with layers for both paths).")
@click.option("--token-budget", default=1024, show_default=True, help="Queued tokens per batch.")
@click.option("--queries", default=96, show_default=True, help="Queries per scenario.")
@click.option("--prompt-tokens", default=20, show_default=True)
@harness.threads_option
@harness.bench_options("model.md or gpu.md, by device type", rounds=7)
def prefix_command(device, dtype, layers, token_budget, queries, prompt_tokens, threads, rounds, results_md) -> None:
    """The shared prompt computed once against the full forward, in the same run."""
    from tokq.workers.engine import Engine

    if device.startswith("cuda") and not torch.cuda.is_available():
        click.echo("tokq bench prefix: no CUDA GPU here, nothing measured")  # `make bench-gpu` on a CPU host
        return
    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), layers)
        engine = Engine.load(tmp, device=device, dtype=dtype)
        plain = Engine(engine.info, engine.model, engine.device, engine.dtype, engine.attn_backend)
        plain.prompt_cache = None  # the same model with no prefix path at all
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, VOCAB, size=prompt_tokens)
    scenarios = {f"instruction ({prompt_tokens} tok) + 10-token queries": scenario(rng, queries, prompt, 10),
                 f"instruction ({prompt_tokens} tok) + workload queries": scenario(rng, queries, prompt, None),
                 "no prompt, workload queries": scenario(rng, queries, None, None)}
    load_before, cpu_before, wall_before = os.getloadavg()[0], time.process_time(), time.perf_counter()
    rows = []
    for name, (seqs, prompt_lens) in scenarios.items():
        systems = {FULL: (plain, batches(seqs, prompt_lens, token_budget, False))}
        if any(prompt_lens):
            systems["prompt computed once"] = (engine, batches(seqs, prompt_lens, token_budget, True))
        else:  # the engine with the prefix path, given no prompt: must cost what the full forward does
            systems["prefix-capable engine"] = (engine, batches(seqs, prompt_lens, token_budget, False))
        computed = {}
        for label, (eng, packed) in systems.items():
            eng.embed(packed[0])  # warm-up; fills the prompt's cache entry
            before = eng.tokens_computed
            for batch in packed:
                eng.embed(batch)
            computed[label] = eng.tokens_computed - before
        def measure(label: str) -> float:
            click.echo(f"{name}: {label} {(t := time_system(*systems[label])):.2f} s")
            return t
        # back to back, the order flipped every round: each round's ratio compares like with like
        times = harness.interleaved(rounds, systems, measure, flip=True)
        input_tokens = sum(len(s) for s in seqs)
        for label, (_, packed) in systems.items():
            t, ratios = statistics.median(times[label]), [b / x for b, x in zip(times[FULL], times[label])]
            rows.append([name, label, len(packed), f"{input_tokens:,}", f"{computed[label]:,}",
                         f"{input_tokens / t:,.0f}", f"{computed[label] / t:,.0f}", f"{len(seqs) / t:,.1f}",
                         f"**{statistics.median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f})"])
    wall, cpu_s = time.perf_counter() - wall_before, time.process_time() - cpu_before
    device_name = (torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda"
                   else f"CPU, {torch.get_num_threads()} threads of {os.cpu_count()}")
    name = block_name(engine.device.type)
    publish(block(name, [
        f"## Shared prompt computed once (`workers/prompt_attention.py`), {engine.device.type.upper()}", "",
        f"Command: `{command_line()}`. {device_name}, {str(engine.dtype).removeprefix('torch.')}, attention "
        f"{engine.attn_backend}, torch {torch.__version__}. Model: random weights with Qwen3-Embedding-0.6B's shapes, "
        f"{layers} of its 28 layers (both paths scale with layers alike), vocabulary {VOCAB}. {queries} queries per "
        f"scenario (lengths: profiling/workload.py, seed 1, or fixed), batches of at most {token_budget} queued tokens "
        "as the queue counts them (the prompt's tokens are not counted on the prefix path: its K/V come from the "
        f"worker's cache, filled by the warm-up). Rates: medians over {rounds} rounds; ratio: the median of per-round "
        "ratios, the systems run back to back in each round, their order flipped every round. tokens/s counts every "
        "input token (prompt included) served per second; computed tokens/s the tokens run through the model. Load "
        f"average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; this process used {cpu_s:.0f} s CPU in "
        f"{wall:.0f} s wall ({cpu_s / wall:.1f} cores). {machine_cores(capital=True)}: the ratios are measured in the "
        "same run, the absolute rates vary between runs.", "",
        *table("scenario | system | batches | input tokens | tokens computed | input tokens/s | computed tokens/s | "
               "queries/s | x full forward (median, range over rounds)", rows, "llrrrrrrr"), ""],
        generated_by="tokq bench prefix"), results_md, name)
