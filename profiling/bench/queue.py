"""The queue's speed (enqueue, claim, Redis time per script, fill ratio) against the raw ceiling of the
same Redis (RPUSH/LPOP of the same entries), measured in the same round; medians over rounds."""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import click
import numpy as np

from tokq.config import QueueConfig
from tokq.profiling import harness
from tokq.profiling.bench.loadgen import closed_loop
from tokq.profiling.harness import ratio
from tokq.profiling.results_md import block, command_line, machine_cores, publish, table

BLOCK = "tokq bench queue"
ITEMS_PER_ENQUEUE = 32
NUM_CALLERS = 8
PIPELINE_DEPTH = 64
NOTICE_CHANNEL = "tokq:{bench}:notice:bench"


async def timed_callers(num_calls: int, call, callers: int = NUM_CALLERS) -> float:
    """Seconds for ``callers`` tasks to make ``num_calls`` calls between them."""
    start = time.perf_counter()
    await closed_loop(call, range(num_calls), callers)
    return time.perf_counter() - start


async def pipelined(client, num_calls: int, add) -> float:
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
    from tokq.queue.wire import format_entry

    return [format_entry(n, 1_700_000_000_000, "req-0123456789", j, 1_700_000_600_000, 0, body)
            for j, (n, body) in enumerate(items)]


async def usec_per_call(client, command: str = "evalsha") -> float:
    return float((await client.info("commandstats")).get(f"cmdstat_{command}", {}).get("usec_per_call", 0.0))


async def bench_enqueue(client, queue, items, num_calls: int) -> dict:
    num_windows = len(items) - ITEMS_PER_ENQUEUE
    requests = [items[(i * ITEMS_PER_ENQUEUE) % num_windows:][:ITEMS_PER_ENQUEUE] for i in range(num_calls)]
    raw, raw_key, num_items = [raw_entries(r) for r in requests], "bench:{raw}:rpush", num_calls * ITEMS_PER_ENQUEUE
    await client.config_resetstat()
    seconds = await timed_callers(num_calls, lambda i: queue.enqueue(f"e{i}", requests[i], timeout_ms=600_000,
                                                                    notice_channel=NOTICE_CHANNEL))
    usec = await usec_per_call(client)
    same_callers = await timed_callers(num_calls, lambda i: client.rpush(raw_key, *raw[i]))
    await client.delete(raw_key)
    pipe_s = await pipelined(client, num_calls, lambda p, i: p.rpush(raw_key, *raw[i]))
    await client.delete(raw_key)
    return {"items_per_s": num_items / seconds, "redis_usec_per_call": usec,
            "rpush_same_callers_items_per_s": num_items / same_callers,
            "rpush_pipelined_items_per_s": num_items / pipe_s}


async def bench_claim(client, queue, items, budget: int, num_claims: int) -> dict:
    """Needs enough items queued for 2 * num_claims batches."""
    latencies_ms, sizes = [], []
    await client.config_resetstat()
    for _ in range(num_claims):
        start = time.perf_counter()
        claim = await queue.claim(budget)
        latencies_ms.append((time.perf_counter() - start) * 1e3)
        sizes.append(len(claim.entries))
    usec = await usec_per_call(client)
    concurrent_s = await timed_callers(num_claims, lambda i: queue.claim(budget))
    # The raw ceiling: LPOP of as many entries as a claim takes: one caller, NUM_CALLERS, pipelined.
    per_claim, raw_key, entries = max(1, round(statistics.mean(sizes))), "bench:{raw}:lpop", raw_entries(items)

    async def refill(count: int) -> None:
        await client.delete(raw_key)
        for first in range(0, count, 1000):
            await client.rpush(raw_key, *(entries[i % len(entries)] for i in range(first, min(first + 1000, count))))
    await refill(num_claims * per_claim)
    raw_ms = []
    for _ in range(num_claims // 2):
        start = time.perf_counter()
        await client.lpop(raw_key, per_claim)
        raw_ms.append((time.perf_counter() - start) * 1e3)
    lpop_same = await timed_callers(num_claims // 2, lambda i: client.lpop(raw_key, per_claim))
    await refill(num_claims * per_claim)
    lpop_pipe = await pipelined(client, num_claims, lambda p, i: p.lpop(raw_key, per_claim))
    await client.delete(raw_key)
    return {"items_per_claim": statistics.mean(sizes), "claim_p50_ms": float(np.percentile(latencies_ms, 50)),
            "claim_p99_ms": float(np.percentile(latencies_ms, 99)), "redis_usec_per_claim": usec,
            "claims_per_s": num_claims / concurrent_s, "lpop_p50_ms": float(np.percentile(raw_ms, 50)),
            "lpop_p99_ms": float(np.percentile(raw_ms, 99)), "lpop_same_callers_per_s": (num_claims // 2) / lpop_same,
            "lpop_pipelined_per_s": num_claims / lpop_pipe}


async def fill_ratio(client, items, budget: int, lookahead: int) -> float:
    """Mean claimed tokens / budget draining the workload in order, every item young (a queue under
    steady load); the last batch, short because the queue ran dry, left out."""
    from tokq.queue.shard import Queue

    await client.flushall()
    queue = Queue(client, "fill", QueueConfig(max_queued_tokens=10**9), clock=lambda: 1_700_000_000_000)
    for first in range(0, len(items), ITEMS_PER_ENQUEUE):
        await queue.enqueue(f"f{first}", items[first:first + ITEMS_PER_ENQUEUE], timeout_ms=600_000, notice_channel=NOTICE_CHANNEL)
    fills = []
    while (claim := await queue.claim(budget, lookahead=lookahead)) is not None:
        fills.append(min(claim.num_tokens, budget) / budget)
    return statistics.mean(fills[:-1])


async def one_round(url: str, items, budget: int, num_claims: int) -> dict:
    from tokq.queue.shard import Queue
    from tokq.redis.connection import connect

    client = connect(url)
    try:
        await client.flushall()
        queue = Queue(client, "bench", QueueConfig(max_queued_tokens=10**9))
        per_claim = max(1, budget // max(1, round(statistics.mean(n for n, _ in items))))
        num_enqueues = (3 * num_claims * per_claim) // ITEMS_PER_ENQUEUE + 1  # 2 x needed
        result = {"enqueue": await bench_enqueue(client, queue, items, num_enqueues),
                  "claim": await bench_claim(client, queue, items, budget, num_claims)}
        result["fill"] = {f"lookahead_{k}": await fill_ratio(client, items, budget, k)
                          for k in (0, QueueConfig().lookahead, 8)}
        return result
    finally:
        await client.aclose()


def markdown(result: dict, command: str) -> str:
    """The Queue section: the figures against the same Redis's raw ceiling."""
    rounds, look, load = result["rounds"], QueueConfig().lookahead, os.getloadavg()
    e, c, f = result["enqueue"], result["claim"], result["fill"]
    x = lambda part, a, b: f"{ratio(rounds, (part, a), (part, b)):.2f} x"  # noqa: E731
    return block(BLOCK, [
        "## Queue", "",
        f"Command: `{command}` (starts its own embedded Valkey on loopback; {len(rounds)} rounds, medians; "
        "ratios are taken within a round).", "",
        f"Machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end: "
        f"**{machine_cores()}**, other processes compete with Redis and the callers (all in this one Python "
        "process), so client-side throughput and tails are noisy; the Redis-side microseconds (`INFO "
        f"commandstats`) are the steadier figure. Workload: item lengths from {result['workload']}; budget "
        f"{result['budget']} tokens ({c['items_per_claim']:.1f} items per claim on average).", "",
        *table("figure | tokq | raw ceiling, same Redis, same round | ratio | target", [
            [f"enqueue, {ITEMS_PER_ENQUEUE} items/call, {NUM_CALLERS} callers", f"{e['items_per_s']:,.0f} items/s",
             f"RPUSH of the same entries, same callers: {e['rpush_same_callers_items_per_s']:,.0f} items/s; "
             f"pipelined {PIPELINE_DEPTH} deep: {e['rpush_pipelined_items_per_s']:,.0f} items/s",
             f"{x('enqueue', 'items_per_s', 'rpush_same_callers_items_per_s')} / "
             f"{x('enqueue', 'items_per_s', 'rpush_pipelined_items_per_s')}", ">= 100,000 items/s"],
            ["enqueue, Redis time", f"{e['redis_usec_per_call']:.1f} us per {ITEMS_PER_ENQUEUE}-item call "
             f"(= ~{ITEMS_PER_ENQUEUE * 1e6 / e['redis_usec_per_call']:,.0f} items/s of server time)", "", "", ""],
            ["claim latency, one caller", f"p50 {c['claim_p50_ms']:.3f} ms, p99 {c['claim_p99_ms']:.3f} ms",
             f"LPOP of as many entries: p50 {c['lpop_p50_ms']:.3f} ms, p99 {c['lpop_p99_ms']:.3f} ms",
             f"{x('claim', 'claim_p50_ms', 'lpop_p50_ms')} / {x('claim', 'claim_p99_ms', 'lpop_p99_ms')}",
             "p50 < 0.4 ms"],
            [f"claims/s, {NUM_CALLERS} callers in one Python process", f"{c['claims_per_s']:,.0f}",
             f"LPOP of as many entries, same callers: {c['lpop_same_callers_per_s']:,.0f}/s; pipelined: "
             f"{c['lpop_pipelined_per_s']:,.0f}/s", f"{x('claim', 'claims_per_s', 'lpop_same_callers_per_s')} / "
             f"{x('claim', 'claims_per_s', 'lpop_pipelined_per_s')}", ""],
            ["claim, Redis time", f"{c['redis_usec_per_claim']:.1f} us per claim "
             f"(= {1e6 / c['redis_usec_per_claim']:,.0f} claims/s of server time)", "", "", ">= 10,000 claims/s"],
            ["fill ratio (claimed tokens / budget)", ", ".join(
                f"look-ahead {k.removeprefix('lookahead_')}: {v:.3f}" for k, v in f.items() if k != "lookahead_0"),
             f"strict FIFO (look-ahead 0): {f['lookahead_0']:.3f}",
             f"look-ahead {look} / FIFO = {ratio(rounds, ('fill', f'lookahead_{look}'), ('fill', 'lookahead_0')):.3f}",
             ""]], "lllll"), ""])


@click.command("queue")
@click.option("--token-budget", default=600, show_default=True)
@click.option("--num-claims", default=2000, show_default=True)
@harness.bench_options("queue.md", json_out=True)
def queue_command(token_budget, num_claims, rounds, json_path, results_md) -> None:
    """The queue's speed against the raw ceiling of the same Redis, measured in the same run."""
    from tokq.profiling.workload import load_or_generate
    from tokq.queue.wire import encode_body
    from tokq.redis.embedded import EmbeddedRedis

    queries, source = load_or_generate(None, 4000, seed=1)
    items = [(q.num_tokens, encode_body(np.arange(1000, 1000 + q.num_tokens))) for q in queries]
    with EmbeddedRedis() as server:
        measured = [asyncio.run(one_round(server.url, items, token_budget, num_claims)) for _ in range(rounds)]
    result = {"budget": token_budget, "workload": source, **harness.medians(measured), "rounds": measured}
    harness.save_json(json_path, result)
    publish(markdown(result, command_line()), results_md, BLOCK)
