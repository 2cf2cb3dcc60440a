"""Sharded queues on a local Redis Cluster: throughput and Redis time per operation against the shard
count, and from those costs, the shards and nodes a 1,000-GPU fleet needs."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import platform
import random
import time
from types import SimpleNamespace

import click
import numpy as np

from tokq.profiling.bench.loadgen import closed_loop
from tokq.profiling import harness
from tokq.profiling.harness import median, ratio
from tokq.profiling.results_md import block, command_line, machine_cores, publish, table

QUEUE = "bench-shards"
ITEMS_PER_REQUEST = 8
RESULT_DIMS = 384  # all-MiniLM-L6-v2
PHASES = ("enqueue", "claim", "ack", "collect")
BLOCK = "tokq bench shards"


async def _client(url: str, num_shards: int, seconds: float, callers: int, budget: int, seed: int, barrier, out):
    """A client process: each phase starts and ends at the barrier, its counts and CPU sent to ``out``."""
    from tokq.config import QueueConfig
    from tokq.profiling.workload import query_lengths
    from tokq.queue.sharded import ShardedQueue
    from tokq.queue.wire import encode_body, encode_ok
    from tokq.redis.connection import connect

    client = connect(url, max_connections=callers)
    q = ShardedQueue(client, QUEUE, QueueConfig(queue_shards=num_shards, max_queued_tokens=10**9, lease_ms=600_000),
                     rng=random.Random(seed))
    items = [(n, encode_body(np.arange(1000, 1000 + n))) for n in query_lengths(4000, seed=seed).tolist()]
    result = encode_ok(np.zeros(RESULT_DIMS, np.float32), 1.0, 1.0)
    ids, claims = [], []

    def until(deadline: float):
        return itertools.takewhile(lambda _: time.perf_counter() < deadline, itertools.count())

    async def enqueue(i: int) -> None:
        start = (i * ITEMS_PER_REQUEST) % (len(items) - ITEMS_PER_REQUEST)
        await q.producer.enqueue(f"p{seed}-{i}", items[start:start + ITEMS_PER_REQUEST], timeout_ms=600_000, gateway_id="bench")
        ids.append(f"p{seed}-{i}")

    drained = asyncio.Event()

    async def claim(_) -> None:
        if not drained.is_set() and (c := await q.consumer.claim(budget)) is not None:
            claims.append(c)
        else:
            drained.set()

    async def ack(c) -> None:
        await q.consumer.ack(c.batch_id, [(e, result) for e in c.entries])

    phases = {"enqueue": lambda: closed_loop(enqueue, until(time.perf_counter() + seconds), callers),
              "claim": lambda: closed_loop(claim, itertools.takewhile(lambda _: not drained.is_set(),
                                                                      until(time.perf_counter() + seconds)), callers),
              "ack": lambda: closed_loop(ack, claims, callers), "collect": lambda: closed_loop(q.producer.collect, ids, callers)}
    try:
        for phase in PHASES:
            await asyncio.to_thread(barrier.wait)
            cpu0, t0 = time.process_time(), time.perf_counter()
            await phases[phase]()
            elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
            count = {"enqueue": len(ids) * ITEMS_PER_REQUEST, "collect": len(ids)}.get(phase, len(claims))
            out.put((phase, count, elapsed, cpu_s, sum(len(c.entries) for c in claims) if phase == "claim" else 0))
            await asyncio.to_thread(barrier.wait)
    finally:
        await q.close()
        await client.aclose()


def _client_main(*args) -> None:
    asyncio.run(_client(*args))


def _evalsha(nodes) -> tuple[int, float, float]:
    """(calls, usec) of EVALSHA summed over the primaries, and their CPU seconds."""
    calls = usec = cpu = 0.0
    for n in nodes:
        stat = n.info("commandstats").get("cmdstat_evalsha", {})
        calls, usec = calls + stat.get("calls", 0), usec + stat.get("usec", 0)
        info = n.info("cpu")
        cpu += info["used_cpu_user"] + info["used_cpu_sys"]
    return int(calls), usec, cpu


def run_point(cluster, num_shards: int, args, seed: int) -> dict:
    import redis

    cluster.flushall()
    nodes = [redis.Redis(port=p, decode_responses=True) for p in cluster.primary_ports()]
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(args.procs + 1), ctx.Queue()
    procs = [ctx.Process(target=_client_main, args=(cluster.url, num_shards, args.seconds, args.callers,
                                                    args.token_budget, 1000 * seed + i + 1, barrier, out))
             for i in range(args.procs)]
    for p in procs:
        p.start()
    point: dict = {"shards": num_shards}
    try:
        for phase in PHASES:
            for n in nodes:
                n.config_resetstat()
            _, _, cpu0 = _evalsha(nodes)
            barrier.wait(timeout=300)  # all clients start the phase
            barrier.wait(timeout=600)  # all clients finished it
            calls, usec, cpu1 = _evalsha(nodes)
            rows = [out.get(timeout=60) for _ in procs]
            count, elapsed = sum(r[1] for r in rows), max(r[2] for r in rows)
            point[phase] = {"count": count, "per_s": count / elapsed, "calls": calls, "items": sum(r[4] for r in rows),
                            "usec_per_call": usec / max(calls, 1), "client_cpu_s": sum(r[3] for r in rows),
                            "redis_cpu_s": cpu1 - cpu0, "seconds": elapsed}
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        for n in nodes:
            n.close()
    point["items_per_claim"] = point["claim"]["items"] / max(point["claim"]["count"], 1)
    return point


def estimate(by_s: dict[int, list[dict]], args) -> list[str]:
    """Nodes and shards for ``args.gpus`` GPUs, from the per-operation Redis costs measured."""
    pts = [p for ps in by_s.values() for p in ps]
    u = {ph: median(pts, ph, "usec_per_call") for ph in PHASES}
    items_per_batch = median(pts, "items_per_claim")
    batches_per_s = args.gpus * 1000.0 / args.forward_ms
    items_per_s = batches_per_s * items_per_batch
    requests_per_s = items_per_s / ITEMS_PER_REQUEST
    usec_per_s = batches_per_s * (u["claim"] + u["ack"]) + requests_per_s * (u["enqueue"] + u["collect"])
    nodes = max(1, int(np.ceil(usec_per_s / 1e6 / args.node_utilization)))
    result_bytes = RESULT_DIMS * 4 + 16
    # Each item's result crosses a node's NIC twice (worker -> Redis, Redis -> gateway); bodies too.
    nic_gbit = items_per_s * (2 * result_bytes + 2 * (4 * args.token_budget / items_per_batch + 40)) * 8 / 1e9
    requests_us = (u["enqueue"] + u["collect"]) * items_per_batch / ITEMS_PER_REQUEST
    return [
        f"Per-operation Redis time (medians over every S and round): enqueue of {ITEMS_PER_REQUEST} items "
        f"{u['enqueue']:.1f} us, claim {u['claim']:.1f} us ({items_per_batch:.1f} items/batch at "
        f"{args.token_budget} tokens), ack {u['ack']:.1f} us, collect {u['collect']:.1f} us.",
        f"One batch's full cycle costs Redis {u['claim'] + u['ack']:.1f} us (claim + ack) + {requests_us:.1f} us for "
        "its requests (enqueue + collect) = one shard (one slot, one node thread) carries at most "
        f"~{1e6 / (u['claim'] + u['ack'] + requests_us):,.0f} batches/s.",
        f"Fleet: {args.gpus:,} GPUs x one {args.token_budget}-token batch per {args.forward_ms} ms = "
        f"{batches_per_s:,.0f} batches/s, {items_per_s:,.0f} items/s, {requests_per_s:,.0f} requests/s.",
        f"Redis time needed: {usec_per_s / 1e6:.2f} core-seconds per second -> at {args.node_utilization:.0%} of a "
        f"node's command thread, **{nodes} primaries** (plus a replica each), and **at least {nodes} shards** (one "
        f"per primary; {2 * nodes} leaves headroom and evens out the slot spread).",
        f"Network: ~{nic_gbit:.1f} Gbit/s summed over the nodes (results {result_bytes} B/item, in and out), "
        f"{nic_gbit / nodes:.2f} Gbit/s per primary: well under a 10 Gbit/s NIC, so the resource that saturates "
        "first is each node's single command thread (Redis time), then client-side CPU in the gateways (~40 "
        "us/claim to parse entries, see Queue)."]


def report(by_s: dict[int, list[dict]]) -> list[str]:
    base = by_s[min(by_s)]
    both = lambda pts, part: median([{"x": p["enqueue"][part] + p["claim"][part]} for p in pts], "x")  # noqa: E731
    return table("shards | enqueued items/s | vs 1 shard | claims/s | vs 1 shard | Redis us/enqueue | Redis us/claim | "
                 "Redis us/ack | Redis us/collect | items/claim | client CPU s (enq+claim) | Redis CPU s (enq+claim)", (
        [s, f"{median(pts, 'enqueue', 'per_s'):,.0f}",
         f"{ratio(list(zip(pts, base)), (0, 'enqueue', 'per_s'), (1, 'enqueue', 'per_s')):.2f} x",
         f"{median(pts, 'claim', 'per_s'):,.0f}",
         f"{ratio(list(zip(pts, base)), (0, 'claim', 'per_s'), (1, 'claim', 'per_s')):.2f} x",
         *(f"{median(pts, ph, 'usec_per_call'):.1f}" for ph in PHASES), f"{median(pts, 'items_per_claim'):.1f}",
         f"{both(pts, 'client_cpu_s'):.1f}", f"{both(pts, 'redis_cpu_s'):.1f}"] for s, pts in sorted(by_s.items())),
        "l" * 12)


@click.command("shards")
@click.option("--shards", default="1,2,4,8", show_default=True, help="Shard counts, comma-separated.")
@click.option("--procs", default=2, show_default=True, help="Client processes.")
@click.option("--callers", default=8, show_default=True, help="Concurrent calls per process.")
@click.option("--seconds", default=3.0, show_default=True)
@click.option("--token-budget", default=45, show_default=True,
              help="Tokens per batch (default: the budget tokq profile recommended on a CPU).")
@click.option("--forward-ms", default=13.8, show_default=True,
              help="Time of one batch at --token-budget (default: the profiled figure).")
@click.option("--gpus", default=1000, show_default=True)
@click.option("--node-utilization", default=0.5, show_default=True)
@harness.bench_options("queue.md")
def shards_command(**options) -> None:
    """Sharded queues on a local Redis Cluster: throughput and Redis time per operation against shards."""
    from tokq.testing.cluster import LocalCluster

    args, seeds = SimpleNamespace(**options), itertools.count()
    load0 = os.getloadavg()

    def point(num_shards: int) -> dict:
        p = run_point(cluster, num_shards, args, next(seeds))
        print(f"S={num_shards}: {p['enqueue']['per_s']:,.0f} items/s enqueued, {p['claim']['per_s']:,.0f} claims/s, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        return p
    # No failover wanted here: a node starved of CPU for seconds must not be taken for dead.
    with LocalCluster(node_timeout_ms=30_000) as cluster:
        by_s = harness.interleaved(args.rounds, [int(s) for s in args.shards.split(",")], point)
    load1 = os.getloadavg()
    publish(block(BLOCK, [
        "## Sharded queues on Redis Cluster", "", "Command:", "", f"    {command_line()}", "",
        f"Local cluster: 3 primaries + 3 replicas (Valkey, loopback), {args.procs} client processes x {args.callers} "
        f"concurrent calls, {ITEMS_PER_REQUEST}-item requests of generated short queries, budget {args.token_budget} "
        f"tokens, {args.rounds} rounds (medians; ratios within a round). Machine: {platform.machine()} "
        f"(**{machine_cores()}: other engineers' tests ran meanwhile**), load average {load0[0]:.1f} at start, "
        f"{load1[0]:.1f} at end.", "", *report(by_s), "",
        f"Reading: every process here (6 Redis nodes, the client processes) shares {os.cpu_count()} CPUs, so the "
        "client-observed rates are bounded by the client processes' CPU, not by Redis: shards add server threads "
        "that this machine has no cores to run. The Redis time per operation does not depend on S (each shard is "
        "an independent queue in its own slot), which is what lets throughput grow with the nodes a real fleet "
        "gives the shards (the spread across S in the columns above is this machine's load, not the shard count). "
        "Redis time per call (commandstats) counts wall time inside a command, so on a machine this loaded it also "
        "holds time the Redis thread waited for a core: the per-operation costs and the estimate below are upper "
        "bounds (the Queue section measures one shard's claim on its own).", "",
        "### Estimate: 1,000 GPUs", "", *[f"- {line}" for line in estimate(by_s, args)], "",
        "Assumption: one worker per GPU, the GPU always busy (the claim prefetch hides Redis), batches of the "
        "profiled budget and latency (`--token-budget`, `--forward-ms`; rerun with a GPU's profile to size that "
        "fleet)."]), args.results_md, BLOCK)
