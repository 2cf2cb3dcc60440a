"""`tokq bench bulk`: `tokq embed-file` through a local stack against SentenceTransformer.encode and the
engine's own packed forward on the same documents; then live queries beside an embed-file job of each class."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from tokq.profiling import harness
from tokq.profiling.bench.loadgen import GeneratorProcs, closed_loop, load_queries, poisson_schedule, summarize
from tokq.profiling.bench.loadgen import texts_for_lengths
from tokq.profiling.results_md import block, command_line, machine_cores, publish, table
from tokq.profiling.workload import Query

BLOCK = "tokq bench bulk"
DOC_TOKENS = (10, 250)  # each document's tokens, [CLS] and [SEP] included, drawn uniformly
ST_BATCH = 32
SYSTEMS = ("service", "st", "forward")
PARTS = ("bulk", "mixed")  # embed-file against the baselines; live queries beside a job
# Beside the live queries: no job, an embed-file job of each class; last, the batch job with no queries.
PHASES = {"none": "none", "batch": "batch class", "interactive": "interactive class (no classes)",
          "alone": "batch class, no queries"}
PRESSURE_S = 3.0  # the job's forwards running this long before a window opens
FORWARD = ("tokq_worker_forward_tokens_total", "tokq_worker_forward_duration_seconds_sum")
NESTED = ("tokq_worker_batches_total", "tokq_worker_preemptions_total")  # forwards; of them, nested in a heavy one


def make_docs(n: int, seed: int = 1) -> list[str]:
    """``n`` seeded documents of whole vocabulary words, DOC_TOKENS long."""
    lens = np.random.default_rng([seed, 7]).integers(DOC_TOKENS[0], DOC_TOKENS[1] + 1, n)
    queries = [Query(i, int(k), 0.0) for i, k in enumerate(lens)]
    return [q.text for q in texts_for_lengths(queries, harness.vocab_words(lowercase=True), seed)]


def write_docs(path: Path, docs) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(docs)))
    return path


def start_worker(stack: harness.Stack, threads: int) -> str:
    """`tokq worker` as `tokq up` runs it here (its own budget fit), ``threads`` torch threads; its metrics URL."""
    from tokq.model.info import bundled_model_path
    from tokq.redis.embedded import free_port

    port = free_port()
    stack.workers["bulk"] = harness.tokq("worker", "--model", str(bundled_model_path()), "--worker-id", "bulk",
                                         "--threads", str(threads), "--metrics-port", str(port),
                                         redis_url=stack.redis.url, log=stack.log)
    return f"http://127.0.0.1:{port}/metrics"


def embed_file(src: Path, out: Path, target: str, priority: str = "batch") -> subprocess.Popen:
    return harness.python("-m", "tokq.cli", "embed-file", str(src), "--out", str(out), "--target", target,
                          "--priority", priority, "--overwrite", stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def run_job(src: Path, out: Path, target: str, pids: dict[str, int], worker_url: str) -> dict:
    """One whole `tokq embed-file` run: its own seconds, cores per process, the worker's forward figures."""
    before, proc = harness.metrics(worker_url, *FORWARD), embed_file(src, out, target)
    with harness.CpuWindow({**pids, "embed-file": proc.pid}) as cpu:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # not reaped: its /proc/PID/stat is read
    said, err = (s.decode() for s in proc.communicate())
    if proc.returncode != 0:
        raise RuntimeError(f"embed-file exited {proc.returncode}: {err[-2000:]}")
    after = harness.metrics(worker_url, *FORWARD)
    return {"s": max(float(re.search(r" in ([\d.]+) s", said).group(1)), 0.05), "cores": cpu.cores(),
            "forward_s": after[FORWARD[1]] - before[FORWARD[1]]}


def bulk_rounds(docs: list[str], tmp: Path, target: str, pids: dict, worker_url: str, budget: int,
                rounds: int) -> tuple[list[dict], dict]:
    """Every system on every document, each round in turn (order flipped every other round)."""
    from sentence_transformers import SentenceTransformer

    from tokq.profiling.bench.runtime import pack_in_order
    from tokq.workers.engine import Engine

    src = write_docs(tmp / "docs.jsonl", docs)
    engine = Engine.load(None, device="cpu")
    st = SentenceTransformer(str(engine.info.path), device="cpu")
    ids = st.tokenizer(docs, truncation=True, max_length=engine.info.max_length)["input_ids"]
    batches = pack_in_order(ids, budget)
    engine.warmup(budget)
    st.encode(docs[:ST_BATCH], batch_size=ST_BATCH)
    vectors = {}

    def measure(system: str) -> dict:
        if system == "service":
            return run_job(src, tmp / "out.npy", target, pids, worker_url)
        start = time.perf_counter()
        vectors[system] = st.encode(docs, batch_size=ST_BATCH) if system == "st" else [engine.embed(b) for b in batches]
        return {"s": time.perf_counter() - start}
    by = harness.interleaved(rounds, SYSTEMS, measure, flip=True)
    got, want = np.load(tmp / "out.npy"), vectors["st"]
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    return [{k: v[r] for k, v in by.items()} for r in range(rounds)], {
        "tokens": sum(map(len, ids)), "min_cos": float(cos.min()),
        "engine": f"{str(engine.dtype).removeprefix('torch.')}, attention {engine.attn_backend}"}


async def capacity(target: str, texts: list[str], seconds: float, concurrency: int = 32) -> float:
    """Single-query calls/s answered, closed loop with ``concurrency`` in flight, after a second's warm-up."""
    from tokq import AsyncClient

    async with AsyncClient(target) as client:
        ok, end = [0], time.monotonic() + 1 + seconds

        async def one(text: str) -> None:
            await client.embed([text], truncate=True, timeout=30)
            ok[0] += time.monotonic() > end - seconds
        await closed_loop(one, itertools.takewhile(lambda _: time.monotonic() < end, itertools.cycle(texts)), concurrency)
    return ok[0] / seconds


def mixed_rounds(src: Path, tmp: Path, target: str, pids: dict, worker_url: str, queries, rate: float,
                 duration_s: float, rounds: int) -> list[dict]:
    """Per round and phase: the live queries' figures (open loop at ``rate``), the job's tokens/s (the worker's
    forwarded tokens less the queries'), cores per process."""
    from tokq.profiling.bench.service.systems import GrpcSender

    gens = GeneratorProcs(functools.partial(GrpcSender, target, 30.0), 1)

    def measure(phase: str) -> dict:
        job = None if phase == "none" else embed_file(src, tmp / f"{phase}.npy", target, phase.replace("alone", "batch"))
        try:
            if job:
                first = harness.metric(worker_url, FORWARD[0])
                harness.wait_until(lambda: harness.metric(worker_url, FORWARD[0]) > first, "the job's forwards", [job])
                time.sleep(PRESSURE_S)
            before, samples = harness.metrics(worker_url, *FORWARD, *NESTED), []
            with harness.CpuWindow({**pids, "load generator": gens.pids[0], **({"embed-file": job.pid} if job else {})}) as cpu:
                if phase == "alone":
                    time.sleep(duration_s)
                else:
                    samples = asyncio.run(gens.run(poisson_schedule(queries, rate, duration_s)))
            fwd = {k: v - before[k] for k, v in harness.metrics(worker_url, *FORWARD, *NESTED).items()}
            live_tokens = sum(s.num_tokens for s in samples if s.status == "OK")
            if job and job.poll() is not None:
                raise RuntimeError(f"the embed-file job ended within the window: {job.communicate()[1][-2000:]}")
        finally:
            if job:
                job.terminate()
                job.communicate()
        return {"live": summarize(samples, rate, duration_s) if samples else None, "cores": cpu.cores(),
                "job_tps": (fwd[FORWARD[0]] - live_tokens) / cpu.wall_s if job else 0.0, "live_tps": live_tokens / cpu.wall_s,
                "forwards": fwd[NESTED[0]] / cpu.wall_s, "nested": fwd[NESTED[1]] / cpu.wall_s}
    try:
        by = harness.interleaved(rounds, PHASES, measure)
    finally:
        gens.close()
    return [{k: v[r] for k, v in by.items()} for r in range(rounds)]


def cores_text(rows: list[dict], *path) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in harness.medians([harness.dig(r, path) for r in rows]).items())


def met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def bulk_section(rows: list[dict], meta: dict) -> str:
    n, tokens, budget, threads = meta["n"], meta["tokens"], meta["budget"], meta["threads"]
    docs_s = {s: statistics.median(n / r[s]["s"] for r in rows) for s in SYSTEMS}
    vs_st = harness.ratio(rows, ("st", "s"), ("service", "s"))
    overhead = statistics.median(1 - r["forward"]["s"] / r["service"]["s"] for r in rows)
    busy = statistics.median(r["service"]["forward_s"] / r["service"]["s"] for r in rows)
    names = {"service": f"`tokq embed-file`: gateway + 1 worker ({threads} torch thread{'s' * (threads > 1)}, budget "
                        f"{budget}) + Redis", "st": f"`SentenceTransformer.encode(batch_size={ST_BATCH})`, fp32",
             "forward": f"the worker's engine alone: packed forward at {budget} tokens, {meta['engine']}"}
    cells = [[names[s], f"{docs_s[s]:,.1f}", f"{docs_s[s] * tokens / n:,.0f}",
              f"**{harness.ratio(rows, ('st', 's'), (s, 's')):.2f}x**",
              cores_text(rows, s, "cores") if s == "service" else "this process"] for s in SYSTEMS]
    small = (f" N is below the default 50,000 (`--docs`): the whole bench took {meta['minutes']:.1f} minutes here."
             if n < 50_000 else "")
    return section("bulk", "Bulk embedding: `tokq embed-file` against SentenceTransformer.encode", [
        f"N = {n:,} seeded documents of {DOC_TOKENS[0]}-{DOC_TOKENS[1]} tokens (vocabulary words; {tokens:,} tokens, "
        f"{tokens / n:.0f} a document) in a JSONL file.{small} Each system embeds all of them on {threads} torch "
        f"thread{'s' * (threads > 1)}, {len(rows)} round(s), the systems back to back in an order flipped every round. "
        "Rates: medians over rounds; ratios: medians of per-round ratios. The service is Redis, one `tokq worker` "
        "(its own budget fit, as `tokq up` runs it here) and a `tokq gateway`; `embed-file`'s time is its own summary's. "
        "SentenceTransformer sorts by length. The engine packs the file's order at the worker's budget, in this process. "
        "Cores: CPU-seconds per wall second of each process while `embed-file` ran.", "",
        *table("system | docs/s | tokens/s | x SentenceTransformer | cores", cells, "lrrrl"), "",
        "Reading (generated from the figures above):",
        f"- `embed-file`: {vs_st:.2f}x SentenceTransformer's docs/s (target >= 1.3x: {met(vs_st >= 1.3)}). The worker "
        "runs its own dtype, SentenceTransformer fp32.",
        f"- The service around the forward costs {overhead:.1%} of its tokens/s (1 - service / forward; target <= 15%: "
        f"{met(overhead <= 0.15)}). The worker was in forwards {busy:.0%} of the job's time. On 2 cores, the gateway, "
        "Redis and `embed-file` use CPU the worker's thread competes for.",
        f"- Vectors: cosine to SentenceTransformer's >= {meta['min_cos']:.5f} on every document."])


def mixed_section(rows: list[dict], meta: dict) -> str:
    live_tps, figures, cells = harness.median(rows, "none", "live_tps"), {}, []
    left = harness.median(rows, "alone", "job_tps") - live_tps
    for phase, name in PHASES.items():
        live = [r[phase]["live"] for r in rows if r[phase]["live"]]
        p99 = live and harness.ratio(rows, (phase, "live", "latency_ms", "p99"), ("none", "live", "latency_ms", "p99"))
        figures[phase] = p99, statistics.median(r[phase]["job_tps"] / (r["alone"]["job_tps"] - r[phase]["live_tps"])
                                                for r in rows)
        cells.append([name, *([" / ".join(f"{harness.median(live, 'latency_ms', q):,.0f}" for q in ("p50", "p99")),
                               f"**{p99:.2f}x**"] if live else ["–", "–"]),
                      f"{harness.median(rows, phase, 'job_tps'):,.0f}" if phase != "none" else "–",
                      f"**{figures[phase][1]:.0%}**" if phase in ("batch", "interactive") else "–",
                      f"{harness.median(rows, phase, 'forwards'):,.1f} / {harness.median(rows, phase, 'nested'):,.1f}",
                      *([sum(x["num_requests"] - x["num_ok"] for x in live),
                         f"{sum(x['generator_kept_up'] for x in live)}/{len(live)}"] if live else ["–", "–"]),
                      cores_text(rows, phase, "cores")])
    (b99, bshare), (i99, ishare) = figures["batch"], figures["interactive"]
    return section("mixed", "Live queries beside an embed-file job: batch class against no classes", [
        f"Live queries: single short queries ({meta['source']}), open loop (Poisson) at {meta['rate']:,.0f}/s: half "
        f"the {meta['capacity']:,.0f} calls/s the service answered closed loop (32 in flight) just before. "
        f"{meta['duration']:g} s a phase, {len(rows)} round(s), phases in the table's order. The job: `tokq "
        f"embed-file` on the same documents (repeated), its forwards running {PRESSURE_S:g} s before the window; its tokens/s: "
        "the worker's forwarded tokens less the queries'. Capacity the queries leave: the job's tokens/s with no "
        f"queries less the queries' tokens/s ({live_tps:,.0f}): {left:,.0f} tokens/s; shares are per round. Medians over rounds; ratios per round. "
        "Cores: CPU-seconds per wall second per process. On 2 cores the service competes with itself: the load "
        "generator and `embed-file` use the cores the gateway, Redis and the worker need.", "",
        *table("job beside the queries | queries p50 / p99 ms | p99 vs no job (target <= 2x) | job tokens/s | share "
               "of capacity left (target >= 70%) | worker forwards/s / nested in a heavy one | failed queries | rounds "
               "the generator kept up | cores", cells, "lrrrrrrll"), "",
        "Reading (generated from the figures above):",
        f"- Batch class: the queries' p99 was {b99:.2f}x their p99 with no job (target <= 2x: {met(b99 <= 2)}); the "
        f"job took {bshare:.0%} of the capacity left (target >= 70%: {met(bshare >= 0.7)}).",
        f"- The same job sent as interactive (no classes): p99 {i99:.2f}x; the job took {ishare:.0%}.",
        f"- The ratios are against the queries' p99 with no job, {harness.median(rows, 'none', 'live', 'latency_ms', 'p99'):,.0f} "
        f"ms; the batch class's p99 was {b99 / i99:.2f}x that with no classes."])


def section(part: str, title: str, body: list[str]) -> str:
    m = harness.machine()
    return block(f"{BLOCK} ({part})", [
        f"## {title}", "", f"Command: `{command_line()}`. {m['cpu']} ({m['vector_extension']}), {machine_cores()}; "
        f"load average {' / '.join(harness.loadavg())} at the end.", "", *body, ""], generated_by=BLOCK)


@click.command("bulk")
@click.option("--docs", "num_docs", default=50_000, show_default=True, help="Documents each system embeds.")
@click.option("--threads", default=0, show_default=True, help="torch threads of the worker, SentenceTransformer "
              "and the engine (0: what `tokq up` gives one worker here).")
@click.option("--duration-s", default=20.0, show_default=True, help="Each phase of the live-query part.")
@click.option("--capacity-s", default=5.0, show_default=True, help="The live queries' capacity measurement.")
@click.option("--parts", default=",".join(PARTS), show_default=True, help="The sections to run and rewrite.")
@harness.bench_options("bulk.md", rounds=2, json_out=True)
def bulk_command(num_docs, threads, duration_s, capacity_s, parts, rounds, json_path, results_md) -> None:
    """`tokq embed-file` against SentenceTransformer.encode and the bare forward; live queries beside a bulk job."""
    import torch

    from tokq.up import threads_per_worker

    parts = [p for p in parts.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        raise click.BadParameter(f"choose among {', '.join(PARTS)}", param_hint="--parts")
    threads, started = threads or threads_per_worker(1), time.monotonic()
    torch.set_num_threads(threads)
    docs, (queries, source) = make_docs(num_docs), load_queries(None, 4000, seed=1)
    with tempfile.TemporaryDirectory() as tmp, harness.Stack(Path(tmp) / "stack.log") as stack:
        tmp, worker_url = Path(tmp), start_worker(stack, threads)
        target = stack.gateway().target
        stack.wait()
        pids = stack.pids()
        run_job(write_docs(tmp / "warm.jsonl", docs[:64]), tmp / "warm.npy", target, pids, worker_url)
        budget = int(harness.metric(worker_url, "tokq_worker_budget_tokens"))
        meta, raw = dict(n=num_docs, budget=budget, threads=threads, duration=duration_s, source=source), {}
        if "bulk" in parts:
            raw["bulk"], more = bulk_rounds(docs, tmp, target, pids, worker_url, budget, rounds)
            meta.update(more)
            docs_s = statistics.median(num_docs / r["service"]["s"] for r in raw["bulk"])
        if "mixed" in parts:
            if "bulk" not in parts:  # the job's rate, from a short run of its own
                sample = docs[:512]
                docs_s = len(sample) / run_job(write_docs(tmp / "rate.jsonl", sample), tmp / "rate.npy", target, pids,
                                               worker_url)["s"]
            cap = asyncio.run(capacity(target, [q.text for q in queries], capacity_s))
            meta.update(capacity=cap, rate=cap / 2)
            # the job's input outlasts a phase at twice the measured rate
            need = int(2 * docs_s * (duration_s + PRESSURE_S + 30))
            src = write_docs(tmp / "job.jsonl", itertools.islice(itertools.cycle(docs), need))
            raw["mixed"] = mixed_rounds(src, tmp, target, pids, worker_url, queries, cap / 2, duration_s, rounds)
    meta["minutes"] = (time.monotonic() - started) / 60
    harness.save_json(json_path, {"meta": meta, **raw})
    render = {"bulk": bulk_section, "mixed": mixed_section}
    for part in PARTS:
        if part in raw:
            publish(render[part](raw[part], meta), results_md, f"{BLOCK} ({part})")
