"""What an idle fleet costs Redis (commands/s per idle worker), and how fast an idle worker wakes up for
a new item (the claim's Redis time minus the enqueue's), against a PING round trip in the same run."""

from __future__ import annotations

import asyncio
import statistics
import time

import click

from tokq.profiling import harness
from tokq.profiling.harness import pct
from tokq.profiling.results_md import command_line, shared_machine_note, table, write_section

POLL_PER_S = 1 / 0.002  # one claim every 2 ms
SETTLE_S = 2.0  # every worker past its first claims before the idle window


def command_calls(client) -> int:
    return sum(v["calls"] for k, v in client.info("commandstats").items() if k != "cmdstat_info")


async def wake_ups(url: str, num_items: int, gap_s: float) -> tuple[list[float], list[float]]:
    from tokq.queue.shard import REPLY_META_FIELDS, Queue
    from tokq.queue.wire import decode_result, encode_body
    from tokq.redis.connection import connect

    client = connect(url, cluster="no")
    queue = Queue(client, harness.bundled_queue())
    wake_ms, ping_ms = [], []
    try:
        for n in range(num_items):
            t = time.perf_counter()
            await client.ping()
            ping_ms.append((time.perf_counter() - t) * 1000)
            await queue.enqueue(f"wake{n}", [(3, encode_body([101, 2000 + n % 500, 102]))], timeout_ms=30_000,
                                notice_channel=queue.keys.notice_channel("bench"))
            while await client.hlen(queue.keys.reply(f"wake{n}")) < len(REPLY_META_FIELDS) + 1:
                await asyncio.sleep(0.001)
            wake_ms.append(decode_result((await queue.collect(f"wake{n}"))[0]).queue_ms)
            await asyncio.sleep(gap_s)  # the fleet goes idle again
    finally:
        await client.aclose()
    return wake_ms, ping_ms


@click.command("idle-workers")
@click.option("--workers", default=16, show_default=True)
@click.option("--idle-s", default=10.0, show_default=True)
@click.option("--items", default=200, show_default=True)
@click.option("--gap-s", default=0.05, show_default=True, help="Pause between wake-up items.")
@harness.results_md_option("service.md")
def idle_workers_command(workers, idle_s, items, gap_s, results_md) -> None:
    """What an idle fleet costs Redis, and how fast an idle worker wakes up for a new item."""
    with harness.Stack() as stack:
        for i in range(workers):
            stack.worker(f"idle{i}")
        stack.wait(timeout_s=600)
        time.sleep(SETTLE_S)
        before, t0 = command_calls(stack.client), time.monotonic()
        time.sleep(idle_s)
        per_worker = (command_calls(stack.client) - before) / (time.monotonic() - t0) / workers
        wake_ms, ping_ms = asyncio.run(wake_ups(stack.redis.url, items, gap_s))
    wake = "wake-up of a new item, {} (Redis clock, ms)"
    lines = [f"{workers} idle `tokq worker` processes (one torch thread each), {idle_s:.0f} s with nothing queued; "
             f"then {items} single-item requests, each to an empty queue.", "",
             *table("measure | value | against", [
                 ["Redis commands/s per idle worker", f"{per_worker:.1f}",
                  f"a 2 ms claim poll: {POLL_PER_S:.0f}/s ({POLL_PER_S / per_worker:.0f}x more)"],
                 [wake.format("p50"), f"{statistics.median(wake_ms):.1f}",
                  f"PING round trip p50 {statistics.median(ping_ms):.2f} ms"],
                 [wake.format("p99"), f"{pct(wake_ms, 0.99):.1f}", f"PING round trip p99 {pct(ping_ms, 0.99):.2f} ms"],
                 ["wake-up, max (ms)", f"{max(wake_ms):.1f}", ""]], "lrl"), "",
             "Commands are what INFO commandstats counts: the commands a script runs inside Redis (TIME, LRANGE, "
             "...) count besides its EVALSHA. Wake-up = the claim's Redis time minus the enqueue's (1 ms "
             "resolution). " + shared_machine_note()]
    click.echo("\n".join(lines))
    if results_md:
        write_section(results_md, "tokq bench idle-workers", "Idle fleet: waiting on Redis, not polling",
                      command_line(), lines)
