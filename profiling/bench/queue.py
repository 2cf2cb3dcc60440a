"""The queue's speed against the raw ceiling of the same Redis, measured in the same run.

    tokq bench queue [--token-budget 600] [--num-claims 2000] [--json out.json] [--results-md profiling/results/queue.md]

Starts its own embedded Valkey. Item lengths come from ../shared/workloads/short_queries.jsonl
when it exists, else from tokq.profiling.workload's seeded generator (lognormal, median 10,
p90 ~30, 0.5% tail of 100-512 tokens). Prints:
  * enqueue: items/s, 32 items per call from 8 concurrent callers, against RPUSH of the same
    entries (same callers, and pipelined 64 deep: the server's raw ceiling);
  * claim at the budget: latency p50/p99 (one caller) and batches/s (8 concurrent callers),
    against LPOP of the same number of entries (same callers, and pipelined 64 deep);
  * Redis-side microseconds per script call (INFO commandstats), the part the client cannot hide;
  * fill ratio (claimed tokens / budget) of strict FIFO (lookahead 0) vs look-ahead.
Figures are medians of --rounds rounds; ratios compare figures of the same round.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import click
import numpy as np
import redis.asyncio as aioredis

from tokq.config import QueueConfig
from tokq.redis.connection import connect
from tokq.queue.wire import encode_body, format_entry
from tokq.profiling.results_md import block, command_line, machine_cores, markers, write_block
from tokq.profiling.workload import load_or_generate
from tokq.queue.shard import Queue
from tokq.redis.embedded import EmbeddedRedis

BLOCK = "tokq bench queue"
SECTION_START, _ = markers(BLOCK)
ITEMS_PER_ENQUEUE = 32
NUM_CALLERS = 8
PIPELINE_DEPTH = 64
CHANNEL = "tokq:{bench}:done:bench"


def workload_lengths(num_queries: int = 4000) -> tuple[list[int], str]:
    queries, source = load_or_generate(None, num_queries, seed=1)
    return [q.num_tokens for q in queries], source


def make_items(lengths: list[int]) -> list[tuple[int, bytes]]:
    return [(n, encode_body(np.arange(1000, 1000 + n))) for n in lengths]


async def run_callers(num_callers: int, num_calls: int, call: Callable[[int], Awaitable]) -> float:
    """Seconds for ``num_callers`` tasks to make ``num_calls`` calls between them, each task
    awaiting one call at a time (what a gateway or worker process does)."""
    counter = iter(range(num_calls))

    async def caller() -> None:
        for i in counter:
            await call(i)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(num_callers)))
    return time.perf_counter() - start


async def pipelined(client: aioredis.Redis, num_calls: int, add: Callable) -> float:
    """Seconds for ``num_calls`` commands sent PIPELINE_DEPTH at a time on one connection."""
    start = time.perf_counter()
    for first in range(0, num_calls, PIPELINE_DEPTH):
        pipe = client.pipeline(transaction=False)
        for i in range(first, min(first + PIPELINE_DEPTH, num_calls)):
            add(pipe, i)
        await pipe.execute()
    return time.perf_counter() - start


def raw_entries(items) -> list[bytes]:
    """Entries of the size enqueue.lua makes, for the raw RPUSH/LPOP ceilings."""
    return [format_entry(n, 1_700_000_000_000, "req-0123456789", j, 1_700_000_600_000, 0, body)
            for j, (n, body) in enumerate(items)]


async def refill(client: aioredis.Redis, key: str, entries: list[bytes], count: int) -> None:
    await client.delete(key)
    for first in range(0, count, 1000):
        await client.rpush(key, *(entries[i % len(entries)] for i in range(first, min(first + 1000, count))))


async def redis_usec_per_call(client: aioredis.Redis, command: str) -> float:
    stats = await client.info("commandstats")
    return float(stats.get(f"cmdstat_{command}", {}).get("usec_per_call", 0.0))


async def bench_enqueue(client, queue: Queue, items, num_calls: int) -> dict:
    num_windows = len(items) - ITEMS_PER_ENQUEUE
    requests = [items[(i * ITEMS_PER_ENQUEUE) % num_windows:][:ITEMS_PER_ENQUEUE]
                for i in range(num_calls)]
    raw = [raw_entries(r) for r in requests]
    raw_key = "bench:{raw}:rpush"
    num_items = num_calls * ITEMS_PER_ENQUEUE

    await client.config_resetstat()
    seconds = await run_callers(NUM_CALLERS, num_calls, lambda i: queue.enqueue(
        f"e{i}", requests[i], timeout_ms=600_000, channel=CHANNEL))
    usec = await redis_usec_per_call(client, "evalsha")
    same_callers = await run_callers(NUM_CALLERS, num_calls, lambda i: client.rpush(raw_key, *raw[i]))
    await client.delete(raw_key)
    pipe_s = await pipelined(client, num_calls, lambda p, i: p.rpush(raw_key, *raw[i]))
    await client.delete(raw_key)
    return {"items_per_s": num_items / seconds, "redis_usec_per_call": usec,
            "rpush_same_callers_items_per_s": num_items / same_callers,
            "rpush_pipelined_items_per_s": num_items / pipe_s}


async def bench_claim(client, queue: Queue, items, budget: int, num_claims: int) -> dict:
    """Needs enough items queued for 2 * num_claims batches."""
    latencies_ms = []
    sizes = []
    await client.config_resetstat()
    for _ in range(num_claims):
        start = time.perf_counter()
        claim = await queue.claim(budget)
        latencies_ms.append((time.perf_counter() - start) * 1e3)
        sizes.append(len(claim.entries))
    usec = await redis_usec_per_call(client, "evalsha")
    concurrent_s = await run_callers(NUM_CALLERS, num_claims, lambda i: queue.claim(budget))

    # The raw ceiling: LPOP of as many entries as a claim takes, one caller, then
    # NUM_CALLERS callers, then pipelined.
    per_claim = max(1, round(statistics.mean(sizes)))
    raw_key, entries = "bench:{raw}:lpop", raw_entries(items)
    await refill(client, raw_key, entries, num_claims * per_claim)
    raw_ms = []
    for _ in range(num_claims // 2):
        start = time.perf_counter()
        await client.lpop(raw_key, per_claim)
        raw_ms.append((time.perf_counter() - start) * 1e3)
    lpop_same = await run_callers(NUM_CALLERS, num_claims // 2, lambda i: client.lpop(raw_key, per_claim))
    await refill(client, raw_key, entries, num_claims * per_claim)
    lpop_pipe = await pipelined(client, num_claims, lambda p, i: p.lpop(raw_key, per_claim))
    await client.delete(raw_key)
    return {
        "items_per_claim": statistics.mean(sizes),
        "claim_p50_ms": float(np.percentile(latencies_ms, 50)),
        "claim_p99_ms": float(np.percentile(latencies_ms, 99)),
        "redis_usec_per_claim": usec,
        "claims_per_s": num_claims / concurrent_s,
        "lpop_p50_ms": float(np.percentile(raw_ms, 50)),
        "lpop_p99_ms": float(np.percentile(raw_ms, 99)),
        "lpop_same_callers_per_s": (num_claims // 2) / lpop_same,
        "lpop_pipelined_per_s": num_claims / lpop_pipe,
    }


async def fill_ratio(client, items, budget: int, lookahead: int) -> float:
    """Mean claimed tokens / budget while draining the workload in arrival order, with every
    item younger than max_skip_age_ms (a queue under steady load); the last batch is left
    out, being short only because the queue ran dry."""
    await client.flushall()
    clock_ms = 1_700_000_000_000
    queue = Queue(client, "fill", QueueConfig(max_queued_tokens=10**9), clock=lambda: clock_ms)
    for first in range(0, len(items), ITEMS_PER_ENQUEUE):
        await queue.enqueue(f"f{first}", items[first:first + ITEMS_PER_ENQUEUE],
                            timeout_ms=600_000, channel=CHANNEL)
    fills = []
    while (claim := await queue.claim(budget, lookahead=lookahead)) is not None:
        fills.append(min(claim.num_tokens, budget) / budget)
    return statistics.mean(fills[:-1])


async def one_round(url: str, items, budget: int, num_claims: int) -> dict:
    client = connect(url)
    try:
        await client.flushall()
        queue = Queue(client, "bench", QueueConfig(max_queued_tokens=10**9))
        per_claim = max(1, budget // max(1, round(statistics.mean(n for n, _ in items))))
        num_enqueues = (3 * num_claims * per_claim) // ITEMS_PER_ENQUEUE + 1  # 2 x needed
        result = {"enqueue": await bench_enqueue(client, queue, items, num_enqueues)}
        result["claim"] = await bench_claim(client, queue, items, budget, num_claims)
        result["fill"] = {f"lookahead_{k}": await fill_ratio(client, items, budget, k)
                          for k in (0, QueueConfig().lookahead, 8)}
        return result
    finally:
        await client.aclose()


def median_of(rounds: list[dict], section: str, key: str) -> float:
    return statistics.median(r[section][key] for r in rounds)


def report(rounds: list[dict], budget: int, source: str) -> dict:
    e = {k: median_of(rounds, "enqueue", k) for k in rounds[0]["enqueue"]}
    c = {k: median_of(rounds, "claim", k) for k in rounds[0]["claim"]}
    f = {k: median_of(rounds, "fill", k) for k in rounds[0]["fill"]}
    ratio = lambda section, a, b: statistics.median(r[section][a] / r[section][b] for r in rounds)  # noqa: E731
    lines = [
        f"workload: {source}; budget {budget} tokens; {len(rounds)} rounds, medians",
        f"enqueue ({ITEMS_PER_ENQUEUE} items/call, {NUM_CALLERS} callers): {e['items_per_s']:,.0f} items/s"
        f" = {ratio('enqueue', 'items_per_s', 'rpush_same_callers_items_per_s'):.2f} x RPUSH same callers"
        f" ({e['rpush_same_callers_items_per_s']:,.0f}),"
        f" {ratio('enqueue', 'items_per_s', 'rpush_pipelined_items_per_s'):.2f} x RPUSH pipelined"
        f" ({e['rpush_pipelined_items_per_s']:,.0f}); Redis {e['redis_usec_per_call']:.1f} us/call",
        f"claim ({c['items_per_claim']:.1f} items/claim): p50 {c['claim_p50_ms']:.3f} ms,"
        f" p99 {c['claim_p99_ms']:.3f} ms = {ratio('claim', 'claim_p50_ms', 'lpop_p50_ms'):.2f} x /"
        f" {ratio('claim', 'claim_p99_ms', 'lpop_p99_ms'):.2f} x LPOP of as many entries"
        f" (p50 {c['lpop_p50_ms']:.3f} ms, p99 {c['lpop_p99_ms']:.3f} ms)",
        f"claims/s ({NUM_CALLERS} callers): {c['claims_per_s']:,.0f}"
        f" = {ratio('claim', 'claims_per_s', 'lpop_same_callers_per_s'):.2f} x LPOP same callers"
        f" ({c['lpop_same_callers_per_s']:,.0f}),"
        f" {ratio('claim', 'claims_per_s', 'lpop_pipelined_per_s'):.2f} x LPOP pipelined"
        f" ({c['lpop_pipelined_per_s']:,.0f});"
        f" Redis {c['redis_usec_per_claim']:.1f} us/claim (= {1e6 / c['redis_usec_per_claim']:,.0f} claims/s"
        f" of server time)",
        "fill ratio (claimed tokens / budget): " + ", ".join(
            f"{k.replace('_', ' ')}: {v:.3f}" for k, v in f.items())
        + f"; look-ahead {QueueConfig().lookahead} / strict FIFO ="
          f" {ratio('fill', f'lookahead_{QueueConfig().lookahead}', 'lookahead_0'):.3f}",
    ]
    print("\n".join(lines))
    return {"budget": budget, "workload": source, "enqueue": e, "claim": c, "fill": f,
            "rounds": rounds}


def markdown(result: dict, command: str) -> str:
    """The "Queue" block of a results file: the figures of ``report``'s result against the same
    Redis's raw ceiling."""
    e, c, f, rounds = result["enqueue"], result["claim"], result["fill"], result["rounds"]
    ratio = lambda section, a, b: statistics.median(r[section][a] / r[section][b] for r in rounds)  # noqa: E731
    look = QueueConfig().lookahead
    load = os.getloadavg()
    return block(BLOCK, [
        "## Queue", "",
        f"Command: `{command}` (starts its own embedded Valkey on loopback; {len(rounds)} rounds, medians; "
        "ratios are taken within a round).", "",
        f"Machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end: "
        f"**{machine_cores()}**, other processes compete with Redis and the callers (all in this one Python "
        "process), so client-side throughput and tails are noisy; the Redis-side microseconds (`INFO "
        f"commandstats`) are the steadier figure. Workload: item lengths from {result['workload']}; budget "
        f"{result['budget']} tokens ({c['items_per_claim']:.1f} items per claim on average).", "",
        "| figure | tokq | raw ceiling, same Redis, same round | ratio | target |",
        "|---|---|---|---|---|",
        f"| enqueue, {ITEMS_PER_ENQUEUE} items/call, {NUM_CALLERS} callers | {e['items_per_s']:,.0f} items/s "
        f"| RPUSH of the same entries, same callers: {e['rpush_same_callers_items_per_s']:,.0f} items/s; "
        f"pipelined {PIPELINE_DEPTH} deep: {e['rpush_pipelined_items_per_s']:,.0f} items/s "
        f"| {ratio('enqueue', 'items_per_s', 'rpush_same_callers_items_per_s'):.2f} x / "
        f"{ratio('enqueue', 'items_per_s', 'rpush_pipelined_items_per_s'):.2f} x | >= 100,000 items/s |",
        f"| enqueue, Redis time | {e['redis_usec_per_call']:.1f} us per {ITEMS_PER_ENQUEUE}-item call "
        f"(= ~{ITEMS_PER_ENQUEUE * 1e6 / e['redis_usec_per_call']:,.0f} items/s of server time) | | | |",
        f"| claim latency, one caller | p50 {c['claim_p50_ms']:.3f} ms, p99 {c['claim_p99_ms']:.3f} ms "
        f"| LPOP of as many entries: p50 {c['lpop_p50_ms']:.3f} ms, p99 {c['lpop_p99_ms']:.3f} ms "
        f"| {ratio('claim', 'claim_p50_ms', 'lpop_p50_ms'):.2f} x / "
        f"{ratio('claim', 'claim_p99_ms', 'lpop_p99_ms'):.2f} x "
        "| p50 < 0.4 ms |",
        f"| claims/s, {NUM_CALLERS} callers in one Python process | {c['claims_per_s']:,.0f} "
        f"| LPOP of as many entries, same callers: {c['lpop_same_callers_per_s']:,.0f}/s; pipelined: "
        f"{c['lpop_pipelined_per_s']:,.0f}/s | {ratio('claim', 'claims_per_s', 'lpop_same_callers_per_s'):.2f} x / "
        f"{ratio('claim', 'claims_per_s', 'lpop_pipelined_per_s'):.2f} x | |",
        f"| claim, Redis time | {c['redis_usec_per_claim']:.1f} us per claim "
        f"(= {1e6 / c['redis_usec_per_claim']:,.0f} claims/s of server time) | | | >= 10,000 claims/s |",
        "| fill ratio (claimed tokens / budget) | "
        + ", ".join(f"look-ahead {k.removeprefix('lookahead_')}: {v:.3f}" for k, v in f.items() if k != "lookahead_0")
        + f" | strict FIFO (look-ahead 0): {f['lookahead_0']:.3f} "
        f"| look-ahead {look} / FIFO = {ratio('fill', f'lookahead_{look}', 'lookahead_0'):.3f} | |",
        ""])


@click.command("queue")
@click.option("--token-budget", default=600, show_default=True)
@click.option("--num-claims", default=2000, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the figures here.")
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this file's Queue block (e.g. profiling/results/queue.md).")
def queue_command(token_budget, num_claims, rounds, json_path, results_md) -> None:
    """The queue's speed against the raw ceiling of the same Redis, measured in the same run."""
    lengths, source = workload_lengths()
    items = make_items(lengths)
    with EmbeddedRedis() as server:
        measured = [asyncio.run(one_round(server.url, items, token_budget, num_claims)) for _ in range(rounds)]
    result = report(measured, token_budget, source)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    if results_md:
        write_block(results_md, BLOCK, markdown(result, command_line()))
