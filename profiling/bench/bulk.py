"""`tokq bench bulk`: `tokq embed-file` through a local stack against SentenceTransformer.encode and the
engine's own packed forward on the same documents; then live queries' latency beside a bulk job of each class."""

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
# Beside the live queries: no job, a job of each class; last, the batch job without the queries.
PHASES = ("none", "batch", "interactive", "job alone")
PRESSURE_S = 3.0  # the job at full pressure before a window opens
JOB_IN_FLIGHT = 6  # requests of half a budget: three budgets in flight, embed-file's start
FORWARD = ("tokq_worker_forward_tokens_total", "tokq_worker_forward_duration_seconds_sum")


def make_docs(n: int, seed: int = 1) -> list[str]:
    """``n`` seeded documents of whole vocabulary words, DOC_TOKENS long."""
    lens = np.random.default_rng([seed, 7]).integers(DOC_TOKENS[0], DOC_TOKENS[1] + 1, n)
    queries = [Query(i, int(k), 0.0) for i, k in enumerate(lens)]
    return [q.text for q in texts_for_lengths(queries, harness.vocab_words(lowercase=True), seed)]


def start_worker(stack: harness.Stack, threads: int) -> str:
    """`tokq worker` as `tokq up` runs it here (its own budget fit), ``threads`` torch threads; its metrics URL."""
    from tokq.model.info import bundled_model_path
    from tokq.redis.embedded import free_port

    port = free_port()
    stack.workers["bulk"] = harness.tokq("worker", "--model", str(bundled_model_path()), "--worker-id", "bulk",
                                         "--threads", str(threads), "--metrics-port", str(port),
                                         redis_url=stack.redis.url, log=stack.log)
    return f"http://127.0.0.1:{port}/metrics"


def embed_file(src: Path, out: Path, target: str, pids: dict[str, int], worker_url: str) -> dict:
    """One `tokq embed-file` run: its own seconds, cores per process, the worker's forward figures."""
    before = harness.metrics(worker_url, *FORWARD)
    proc = harness.python("-m", "tokq.cli", "embed-file", str(src), "--out", str(out), "--target", target,
                          "--overwrite", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with harness.CpuWindow({**pids, "bulk client": proc.pid}) as cpu:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # not reaped: its /proc/PID/stat is read
    said, err = (s.decode() for s in proc.communicate())
    if proc.returncode != 0:
        raise RuntimeError(f"embed-file exited {proc.returncode}: {err[-2000:]}")
    after = harness.metrics(worker_url, *FORWARD)
    seconds = max(float(re.search(r" in ([\d.]+) s", said).group(1)), 0.05)
    return {"s": seconds, "cores": cpu.cores(), "forward_tokens": after[FORWARD[0]] - before[FORWARD[0]],
            "forward_s": after[FORWARD[1]] - before[FORWARD[1]]}


def bulk_rounds(docs: list[str], tmp: Path, target: str, pids: dict, worker_url: str, budget: int,
                rounds: int) -> tuple[list[dict], dict]:
    """Every system on every document, each round in turn (order flipped every other round)."""
    import torch
    from sentence_transformers import SentenceTransformer

    from tokq.profiling.bench.runtime import pack_in_order
    from tokq.workers.engine import Engine

    src = tmp / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(docs)))
    engine = Engine.load(None, device="cpu")
    st = SentenceTransformer(str(engine.info.path), device="cpu")
    ids = st.tokenizer(docs, truncation=True, max_length=engine.info.max_length)["input_ids"]
    batches = pack_in_order(ids, budget)
    engine.warmup(budget)
    st.encode(docs[:ST_BATCH], batch_size=ST_BATCH)
    vectors: dict[str, np.ndarray] = {}

    def measure(system: str) -> dict:
        if system == "service":
            return embed_file(src, tmp / "out.npy", target, pids, worker_url)
        start = time.perf_counter()
        if system == "st":
            vectors["st"] = st.encode(docs, batch_size=ST_BATCH)
        else:
            [engine.embed(b) for b in batches]
        return {"s": time.perf_counter() - start}
    by = harness.interleaved(rounds, SYSTEMS, measure, flip=True)
    got, want = np.load(tmp / "out.npy"), vectors["st"]
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    return [{k: v[r] for k, v in by.items()} for r in range(rounds)], {
        "tokens": sum(map(len, ids)), "min_cos": float(cos.min()), "engine": f"{str(engine.dtype)[6:]}, "
        f"attention {engine.attn_backend}", "threads": torch.get_num_threads()}


async def capacity(target: str, texts: list[str], seconds: float, concurrency: int = 32) -> float:
    """Single-query calls/s answered, closed loop with ``concurrency`` in flight (after a second's warm-up)."""
    from tokq import AsyncClient

    async with AsyncClient(target) as client:
        ok, end = [0], time.monotonic() + 1 + seconds

        async def one(text: str) -> None:
            await client.embed([text], truncate=True, timeout=30)
            ok[0] += time.monotonic() > end - seconds
        await closed_loop(one, itertools.takewhile(lambda _: time.monotonic() < end, itertools.cycle(texts)), concurrency)
    return ok[0] / seconds


def mixed_rounds(src: Path, target: str, pids: dict, budget: int, rate: float, duration_s: float,
                 rounds: int) -> list[dict]:
    """Per round and phase: the live queries' figures (open loop at ``rate``), the job's tokens/s, cores."""
    from tokq.profiling.bench.service.systems import GrpcSender

    queries, _ = load_queries(None, 4000, seed=1)
    gens = GeneratorProcs(functools.partial(GrpcSender, target, 30.0), 1)
    try:
        def measure(phase: str) -> dict:
            job = None if phase == "none" else harness.Child(
                __name__, "job", "--target", target, "--docs", str(src), "--budget", str(budget),
                "--priority", "interactive" if phase == "interactive" else "batch").ready()
            try:
                time.sleep(PRESSURE_S if job else 0)
                if job:
                    job.say("count")
                    first = job.answer()
                procs = {**pids, "load generator": gens.pids[0], **({"bulk client": job.pid} if job else {})}
                with harness.CpuWindow(procs) as cpu:
                    if phase == "job alone":
                        time.sleep(duration_s)
                    else:
                        live = summarize(asyncio.run(gens.run(poisson_schedule(queries, rate, duration_s))),
                                         rate, duration_s)
                if job:
                    job.say("count")
                    last = job.answer()
            finally:
                if job:
                    job.close()
            return {"live": None if phase == "job alone" else live, "cores": cpu.cores(),
                    "job_tps": (last["tokens"] - first["tokens"]) / (last["t"] - first["t"]) if job else 0.0}
        by = harness.interleaved(rounds, PHASES, measure)
    finally:
        gens.close()
    return [{k: v[r] for k, v in by.items()} for r in range(rounds)]


def cores_text(rows: list[dict], path: tuple) -> str:
    cores = harness.medians([harness.dig(r, path) for r in rows])
    return ", ".join(f"{k} {v:.2f}" for k, v in cores.items())


def bulk_section(rows: list[dict], meta: dict) -> str:
    n, tokens, budget, threads = meta["n"], meta["tokens"], meta["budget"], meta["threads"]
    docs_s = {s: statistics.median(n / r[s]["s"] for r in rows) for s in SYSTEMS}
    vs_st = harness.ratio(rows, ("st", "s"), ("service", "s"))
    overhead = statistics.median(1 - r["forward"]["s"] / r["service"]["s"] for r in rows)
    busy = statistics.median(r["service"]["forward_s"] / r["service"]["s"] for r in rows)
    cells = [[f"`tokq embed-file` (gateway + 1 worker, {threads} thread{'s' * (threads > 1)}, budget {budget})",
              f"{docs_s['service']:,.1f}", f"{docs_s['service'] * tokens / n:,.0f}", f"**{vs_st:.2f}x**",
              cores_text(rows, ("service", "cores"))],
             [f"`SentenceTransformer.encode(batch_size={ST_BATCH})`, fp32", f"{docs_s['st']:,.1f}",
              f"{docs_s['st'] * tokens / n:,.0f}", "1.00x", "this process only"],
             [f"the worker's engine alone: packed forward at {budget} tokens, {meta['engine']}",
              f"{docs_s['forward']:,.1f}", f"{docs_s['forward'] * tokens / n:,.0f}",
              f"{harness.ratio(rows, ('st', 's'), ('forward', 's')):.2f}x", "this process only"]]
    small = (f" N is below the 50,000 documents asked for, so that the whole bench finishes in ~12 minutes on "
             f"{machine_cores(capital=False)}." if n < 50_000 else "")
    return section("bulk", "Bulk embedding: `tokq embed-file` against SentenceTransformer.encode", [
        f"N = {n:,} seeded documents of {DOC_TOKENS[0]}-{DOC_TOKENS[1]} tokens (vocabulary words; {tokens:,} tokens, "
        f"{tokens / n:.0f} a document), written to a JSONL file.{small} Every system embeds all of them, {threads} "
        f"torch thread{'s' * (threads > 1)} each, in {len(rows)} round(s), the systems back to back in each round in "
        "an order flipped every round. Rates: medians over rounds; ratios: medians of per-round ratios. The "
        "service runs Redis, one `tokq worker` (its own budget fit, as `tokq up` runs it here) and a `tokq "
        "gateway`; `embed-file`'s time is its own summary's (from its start to the output written). "
        "SentenceTransformer sorts by length; the engine packs the file's order at the worker's budget, in this "
        "process. Cores: CPU-seconds per wall second of each process during `embed-file`.", "",
        *table("system | docs/s | tokens/s | x SentenceTransformer | cores", cells, "lrrrl"), "",
        "Reading (generated from the figures above):",
        f"- docs/s: {vs_st:.2f}x SentenceTransformer's (target >= 1.3x: {'met' if vs_st >= 1.3 else 'not met'}). "
        "The worker runs its own dtype, SentenceTransformer fp32.",
        f"- The service around the forward costs {overhead:.0%} of its tokens/s (1 - service / forward; target <= "
        f"15%: {'met' if overhead <= 0.15 else 'not met'}). The worker spent {busy:.0%} of the job's time in "
        "forwards. On 2 cores the gateway, Redis and `embed-file` take CPU the worker's thread competes for.",
        f"- Vectors: cosine to SentenceTransformer's >= {meta['min_cos']:.5f} on every document."])


def mixed_section(rows: list[dict], meta: dict) -> str:
    p99 = {p: statistics.median(r[p]["live"]["latency_ms"]["p99"] for r in rows) for p in PHASES[:3]}
    alone = statistics.median(r["job alone"]["job_tps"] for r in rows)
    left = 1 - meta["rate"] / meta["capacity"]
    cells = []
    for phase, name in zip(PHASES, ("none", "batch class", "interactive class (no classes)", "batch class, no queries")):
        live = None if phase == "job alone" else [r[phase]["live"] for r in rows]
        ratio = None if live is None else statistics.median(r[phase]["live"]["latency_ms"]["p99"] /
                                                            r["none"]["live"]["latency_ms"]["p99"] for r in rows)
        tps = statistics.median(r[phase]["job_tps"] for r in rows)
        cells.append([name, "–" if live is None else " / ".join(f"{statistics.median(x['latency_ms'][q] for x in live):,.0f}"
                                                             for q in ("p50", "p99")),
                      "–" if ratio is None else f"**{ratio:.2f}x**", f"{tps:,.0f}" if tps else "–",
                      f"**{tps / (alone * left):.0%}**" if tps and phase != "job alone" else "–",
                      "–" if live is None else sum(x["errors"] != {} for x in live),
                      "–" if live is None else all(x["generator_kept_up"] for x in live), cores_text(rows, (phase, "cores"))])
    batch, plain = cells[1], cells[2]
    return section("mixed", "Live queries beside a bulk job: batch class against no classes", [
        f"Live queries: single short queries (the generated workload, median 10 tokens), open loop (Poisson) at "
        f"{meta['rate']:,.0f}/s, half the {meta['capacity']:,.0f} calls/s the service answered closed loop (32 in "
        f"flight) just before, for {meta['duration']:g} s a phase. The bulk job: one client process sending the same "
        f"documents in requests of about half the budget ({meta['budget']} tokens), {JOB_IN_FLIGHT} in flight, at full "
        f"pressure {PRESSURE_S:g} s before the window. {len(rows)} round(s), phases in the order of the table; "
        "medians over rounds, ratios per round. The capacity the queries leave: the job's tokens/s with no queries "
        f"x (1 - query rate / query capacity) = {alone * left:,.0f} tokens/s. Cores: CPU-seconds per wall second "
        "per process. On 2 cores the service competes with itself: the load generator and the job's client run "
        "on the cores the gateway, Redis and the worker use.", "",
        *table("bulk job | queries p50 / p99 ms | p99 vs no job (target <= 2x) | job tokens/s | share of capacity "
               "left (target >= 70%) | rounds with errors | generator kept up | cores", cells, "lllrrrll"), "",
        "Reading (generated from the figures above):",
        f"- Batch class: queries' p99 {batch[2]} their p99 with no job; the job took {batch[4]} of the capacity left.",
        f"- Without classes (the job sent as interactive): p99 {plain[2]}; the job took {plain[4]}."])


def section(part: str, title: str, body: list[str]) -> str:
    m = harness.machine()
    return block(f"{BLOCK} ({part})", [
        f"## {title}", "", f"Command: `{command_line()}`. {m['cpu']} ({m['vector_extension']}), "
        f"{machine_cores()}; load average {' / '.join(harness.loadavg())} at the end.", "", *body, ""],
        generated_by=BLOCK)


@click.command("bulk")
@click.option("--docs", "num_docs", default=50_000, show_default=True, help="Documents embedded by each system.")
@click.option("--threads", default=0, show_default=True, help="torch threads of the worker, SentenceTransformer "
              "and the engine (0: what `tokq up` gives one worker here).")
@click.option("--duration-s", default=20.0, show_default=True, help="Each phase of the mixed part.")
@click.option("--capacity-s", default=5.0, show_default=True, help="The live queries' capacity measurement.")
@harness.bench_options("bulk.md", rounds=2)
def bulk_command(num_docs, threads, duration_s, capacity_s, rounds, results_md) -> None:
    """`tokq embed-file` against SentenceTransformer.encode and the bare forward; live queries beside a bulk job."""
    import torch

    from tokq.up import threads_per_worker

    threads = threads or threads_per_worker(1)
    torch.set_num_threads(threads)
    docs = make_docs(num_docs)
    with tempfile.TemporaryDirectory() as tmp, harness.Stack(Path(tmp) / "stack.log") as stack:
        tmp, worker_url = Path(tmp), start_worker(stack, threads)
        gateway = stack.gateway()
        stack.wait()
        pids = stack.pids()
        (tmp / "warm.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:64]))
        embed_file(tmp / "warm.jsonl", tmp / "warm.npy", gateway.target, pids, worker_url)
        budget = int(harness.metric(worker_url, "tokq_worker_budget_tokens"))
        rows, meta = bulk_rounds(docs, tmp, gateway.target, pids, worker_url, budget, rounds)
        meta.update(n=num_docs, budget=budget)
        click.echo(f"bulk: {[{k: round(v['s'], 2) for k, v in r.items()} for r in rows]}", err=True)
        texts = [q.text for q in load_queries(None, 4000, seed=1)[0]]
        cap = asyncio.run(capacity(gateway.target, texts, capacity_s))
        meta.update(capacity=cap, rate=cap / 2, duration=duration_s)
        mixed = mixed_rounds(tmp / "docs.jsonl", gateway.target, pids, budget, cap / 2, duration_s, rounds)
    for text in (bulk_section(rows, meta), mixed_section(mixed, meta)):
        publish(text, results_md, text.split(": start", 1)[0].removeprefix("<!-- "))


async def job(target: str, docs: str, budget: int, priority: str) -> None:
    """A bulk job: says "ready" after its first answer, then its tokens so far at each line; ends at EOF."""
    from tokq import AsyncClient

    texts, requests, cur, size = [json.loads(line)["text"] for line in open(docs)], [], [], 0
    for t in texts:  # about half a budget of tokens a request, as embed-file sends them
        cur, size = cur + [t], size + len(t.split()) + 2
        if size >= budget // 2:
            requests, cur, size = requests + [cur], [], 0
    counts, stop, ready = {"tokens": 0, "errors": 0}, asyncio.Event(), []
    async with AsyncClient(target) as client:
        async def one(texts: list[str]) -> None:
            try:
                done = await client.embed_full(texts, priority=priority, timeout=120)
                counts["tokens"] += done.prompt_tokens  # after the await: lanes interleave there
            except Exception:  # counted: a refused or late request is the job's loss
                counts["errors"] += 1
            if not ready:
                ready.append(True)
                harness.reply("ready")

        async def commands() -> None:
            while await harness.read_line():
                harness.reply({**counts, "t": time.monotonic()})
            stop.set()
        told = asyncio.create_task(commands())
        await closed_loop(one, itertools.takewhile(lambda _: not stop.is_set(), itertools.cycle(requests or [cur])),
                          JOB_IN_FLIGHT)
        await told


@click.group()
def main() -> None:
    """The bulk job process `tokq bench bulk` starts."""


@main.command("job")
@click.option("--target", required=True)
@click.option("--docs", required=True)
@click.option("--budget", type=int, required=True)
@click.option("--priority", type=click.Choice(["interactive", "batch"]), required=True)
def job_command(target, docs, budget, priority) -> None:
    asyncio.run(job(target, docs, budget, priority))


if __name__ == "__main__":
    main()
