"""What an idle fleet costs Redis, and how fast an idle worker wakes up for a new item.

    tokq bench idle-workers [--workers 16] [--idle-s 10] [--items 200]
        [--results-md profiling/results/service.md]

Starts its own embedded Valkey and ``--workers`` real ``tokq worker`` processes (the bundled
model, one torch thread each), waits until all have beaten their heartbeat, then:
  * idle: Redis commands per second per worker over ``--idle-s`` seconds with nothing queued
    (INFO commandstats, this script's own INFO calls left out), against the 500/s one claim
    every 2 ms (an idle poll) would cost;
  * wake-up: ``--items`` single-item requests, each sent to an empty queue after the fleet went
    idle; wake-up = the claim's Redis-clock time minus the enqueue's (the result's queue_ms),
    p50/p99, against a PING round trip measured in the same run.
Prints the figures and the load average (this is a shared 2-core machine: the workers compete
with each other and with whatever else runs).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import click
import redis

from tokq.redis.connection import connect
from tokq.queue.wire import decode_result, encode_body
from tokq.processes import stop_all
from tokq.profiling.bench.workers import QUEUE, start_worker, wait_heartbeats
from tokq.profiling.results_md import command_line, shared_machine_note, write_section
from tokq.queue.shard import REPLY_META_FIELDS, Queue
from tokq.redis.embedded import EmbeddedRedis

OLD_POLL_PER_S = 1 / 0.002  # one claim every 2 ms


def command_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def wake_ups(url: str, queue_name: str, num_items: int, gap_s: float) -> tuple[list[float], list[float]]:
    client = connect(url, cluster="no")
    queue = Queue(client, queue_name)
    keys = queue.keys
    wake_ms, ping_ms = [], []
    try:
        for n in range(num_items):
            t = time.perf_counter()
            await client.ping()
            ping_ms.append((time.perf_counter() - t) * 1000)
            rid = f"wake{n}"
            await queue.enqueue(rid, [(3, encode_body([101, 2000 + n % 500, 102]))],
                                timeout_ms=30_000, channel=keys.done_channel("bench"))
            while await client.hlen(keys.reply(rid)) < len(REPLY_META_FIELDS) + 1:
                await asyncio.sleep(0.001)
            result = decode_result((await queue.collect(rid))[0])
            wake_ms.append(result.queue_ms)
            await asyncio.sleep(gap_s)  # the fleet goes idle again
    finally:
        await client.aclose()
    return wake_ms, ping_ms


@click.command("idle-workers")
@click.option("--workers", default=16, show_default=True)
@click.option("--idle-s", default=10.0, show_default=True)
@click.option("--items", default=200, show_default=True)
@click.option("--gap-s", default=0.05, show_default=True, help="Pause between wake-up items.")
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this file's idle-fleet block (e.g. profiling/results/service.md).")
def idle_workers_command(workers, idle_s, items, gap_s, results_md) -> None:
    """What an idle fleet costs Redis, and how fast an idle worker wakes up for a new item."""
    server = EmbeddedRedis().start()
    client = redis.Redis.from_url(server.url)
    procs = {f"idle{i}": start_worker(server.url, f"idle{i}") for i in range(workers)}
    try:
        wait_heartbeats(client, procs, timeout_s=600)
        time.sleep(2.0)  # every worker past its first claims
        before, t0 = command_calls(client), time.monotonic()
        time.sleep(idle_s)
        calls, elapsed = command_calls(client) - before, time.monotonic() - t0
        per_worker = calls / elapsed / workers
        wake_ms, ping_ms = asyncio.run(wake_ups(server.url, QUEUE, items, gap_s))
    finally:
        stop_all(procs.values(), timeout_s=30)
        client.close()
        server.close()

    lines = [
        f"{workers} idle `tokq worker` processes (one torch thread each), {idle_s:.0f} s "
        f"with nothing queued; then {items} single-item requests, each to an empty queue.",
        "",
        "| measure | value | against |",
        "|---|---:|---|",
        f"| Redis commands/s per idle worker | {per_worker:.1f} | a 2 ms claim poll: "
        f"{OLD_POLL_PER_S:.0f}/s ({OLD_POLL_PER_S / per_worker:.0f}x more) |",
        f"| wake-up of a new item, p50 (Redis clock, ms) | {statistics.median(wake_ms):.1f} | "
        f"PING round trip p50 {statistics.median(ping_ms):.2f} ms |",
        f"| wake-up of a new item, p99 (Redis clock, ms) | {percentile(wake_ms, 0.99):.1f} | "
        f"PING round trip p99 {percentile(ping_ms, 0.99):.2f} ms |",
        f"| wake-up, max (ms) | {max(wake_ms):.1f} | |",
        "",
        "Commands are what INFO commandstats counts: the commands a script runs inside Redis "
        "(TIME, LRANGE, ...) count besides its EVALSHA. "
        "Wake-up = the claim's Redis time minus the enqueue's (1 ms resolution). "
        + shared_machine_note(),
    ]
    print("\n".join(lines))
    if results_md:
        write_section(results_md, "tokq bench idle-workers", "Idle fleet: waiting on Redis, not polling",
                      command_line(), lines)
