"""Does `tokq gateway --procs 2` raise what one caller gets? Single-input Embed calls/s against `--procs 1`
and `--procs 2`, from one and two client processes, over gRPC (tokq.AsyncClient) and HTTP (httpx)."""

from __future__ import annotations

import asyncio
import itertools
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import click

from tokq.profiling import harness
from tokq.profiling.bench.loadgen import closed_loop
from tokq.profiling.harness import gateway_children  # noqa: F401 - where tests find the gateway's processes
from tokq.profiling.results_md import block, command_line, machine_cores, publish, table

BLOCK = "tokq bench spread"
MODEL = "all-MiniLM-L6-v2"
RPC_OF = {"grpc": "Embed", "http": "http.Embeddings"}
# (transport, gateway processes, client processes), in the order each round runs them.
CONFIGS = [("grpc", 1, 1), ("grpc", 2, 1), ("grpc", 1, 2), ("grpc", 2, 2), ("http", 1, 1), ("http", 2, 1)]


def ok_calls(gateway: harness.Gateway, rpc: str) -> list[float]:
    return [gateway.metric("tokq_gateway_requests_total", i, rpc=rpc, code="OK") for i in range(gateway.procs)]


def measure(gateway: harness.Gateway, transport: str, num_clients: int, *, seconds: float, concurrency: int,
            fixed_pids: dict[str, int]) -> dict:
    """One window of ``num_clients`` client processes against ``gateway``, from when all have warmed up."""
    target = gateway.target if transport == "grpc" else gateway.http_url
    clients = [harness.Child(__name__, "client", "--transport", transport, "--target", target,
                             "--concurrency", str(concurrency)) for _ in range(num_clients)]
    try:
        for c in clients:
            c.ready()
        pids = {**fixed_pids, **{f"gateway process {i + 1}": pid for i, pid in enumerate(gateway.pids())},
                **{f"client {i + 1}": c.pid for i, c in enumerate(clients)}}
        before = ok_calls(gateway, RPC_OF[transport])
        with harness.CpuWindow(pids) as cpu:
            time.sleep(seconds)
        split = [a - b for a, b in zip(ok_calls(gateway, RPC_OF[transport]), before)]
        for c in clients:
            c.say("stop")
        outs = [c.answer() for c in clients]
    finally:
        for c in clients:
            c.close()
    return {"transport": transport, "gateway_procs": gateway.procs, "client_procs": num_clients,
            "calls_per_s": sum(split) / cpu.wall_s, "split": split, "cores": cpu.cores(),
            "machine_cores_busy": cpu.machine_cores, "client_errors": sum(o["errors"] for o in outs)}


def run(*, seconds: float, concurrency: int, rounds: int, configs=CONFIGS) -> dict:
    results = []
    with harness.Stack(Path(os.environ.get("TMPDIR", "/tmp")) / "tokq-bench-spread.log") as stack:
        stack.worker("spread")
        gateways = {n: stack.gateway(procs=n, http=True, metrics=True) for n in sorted({p for _, p, _ in configs})}
        stack.wait()
        fixed = {"worker": stack.workers["spread"].pid, "redis": stack.redis.pid}
        for r in range(rounds):
            for transport, procs, num_clients in configs:
                result = measure(gateways[procs], transport, num_clients, seconds=seconds, concurrency=concurrency,
                                 fixed_pids=fixed)
                click.echo(f"round {r + 1}: {transport} --procs {procs}, {num_clients} client(s): "
                           f"{result['calls_per_s']:.0f} calls/s, split {result['split']}", err=True)
                results.append({"round": r, **result})
    return {"seconds": seconds, "concurrency": concurrency, "rounds": rounds, "results": results,
            "loadavg": harness.loadavg(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


async def client(transport: str, target: str, concurrency: int) -> None:
    """Closed loop; says "ready" once warmed up, and its totals once told to stop."""
    import httpx

    from tokq import AsyncClient

    if transport == "grpc":
        session = AsyncClient(target)
        call, close = lambda i: session.embed([f"red running shoes {i % 97}"], timeout=30), session.close
    else:
        session = httpx.AsyncClient(base_url=target, timeout=30, limits=httpx.Limits(max_connections=concurrency))

        async def call(i: int) -> None:
            (await session.post("/v1/embeddings", json={"model": MODEL, "input": f"red running shoes {i % 97}"}
                                )).raise_for_status()
        close = session.aclose
    stop = asyncio.Event()
    counts = {"calls": 0, "errors": 0}
    warm = 4 * concurrency  # every connection used, the client's pool has found the processes

    async def one(i: int) -> None:
        try:
            await call(i)
            counts["calls"] += 1
        except Exception:
            counts["errors"] += 1
        if counts["calls"] == warm:
            harness.reply("ready")

    async def stopping() -> None:
        await harness.read_line()
        stop.set()
    stopper, cpu0 = asyncio.create_task(stopping()), time.process_time()
    await closed_loop(one, itertools.takewhile(lambda _: not stop.is_set(), itertools.count()), concurrency)
    await close()
    await stopper
    harness.reply({**counts, "cpu_s": time.process_time() - cpu0})


def medians(report: dict) -> list[dict]:
    """Per configuration: medians over rounds; the --procs 2 / --procs 1 ratio taken within each round."""
    by: dict[tuple, list[dict]] = {}
    for r in report["results"]:
        by.setdefault((r["transport"], r["gateway_procs"], r["client_procs"]), []).append(r)
    rows = []
    for (transport, procs, clients), runs in by.items():
        base = {x["round"]: x for x in by.get((transport, 1, clients), [])}
        ratios = [x["calls_per_s"] / base[x["round"]]["calls_per_s"] for x in runs
                  if x["round"] in base and base[x["round"]]["calls_per_s"] > 0]
        shares = [max(x["split"]) / sum(x["split"]) for x in runs if sum(x["split"]) > 0]
        rows.append({"transport": transport, "gateway_procs": procs, "client_procs": clients,
                     "calls_per_s": harness.median(runs, "calls_per_s"),
                     "vs_procs_1": statistics.median(ratios) if ratios else None,
                     "busiest_share": statistics.median(shares) if shares else None,
                     "cores": {k: harness.median(runs, "cores", k) for k in runs[0]["cores"]},
                     "machine_cores_busy": statistics.median(x.get("machine_cores_busy") or 0.0 for x in runs),
                     "errors": sum(x["client_errors"] for x in runs)})
    return rows


def markdown_section(report: dict, command: str) -> str:
    rows, cells = medians(report), []
    for row in rows:
        cores = row["cores"]
        vs = "1.00x (base)" if row["gateway_procs"] == 1 else (f"{row['vs_procs_1']:.2f}x" if row["vs_procs_1"] else "–")
        cells.append([row["transport"], row["gateway_procs"], row["client_procs"], f"{row['calls_per_s']:,.0f}", vs,
                      f"{row['busiest_share']:.0%}" if row["gateway_procs"] > 1 and row["busiest_share"] else "–",
                      " + ".join(f"{v:.2f}" for k, v in cores.items() if k.startswith("gateway")),
                      f"{cores['worker']:.2f}", f"{cores['redis']:.2f}",
                      f"{sum(v for k, v in cores.items() if k.startswith('client')):.2f}",
                      f"{max(0.0, row['machine_cores_busy'] - sum(cores.values())):.2f}", row["errors"]])
    busy = {(r["transport"], r["gateway_procs"], r["client_procs"]): r for r in rows}
    one, two = busy.get(("grpc", 2, 1)), busy.get(("grpc", 2, 2))
    total = [r["machine_cores_busy"] for r in rows]
    lines = [
        "## One caller against `--procs N`: do calls spread over the gateway's processes?", "",
        f"`{command}` — {report['date']}, **{machine_cores(report['cpus'])}**: the load generator(s), every gateway "
        f"process, the worker (1 torch thread) and Redis compete for the same cores, beside other work (load "
        f"average at the end {' '.join(report['loadavg'])}). Python {report['python']}.",
        f"Single-input Embed calls, closed loop, {report['concurrency']} in flight per client process, a "
        f"{report['seconds']:g} s window per measurement, configurations interleaved, {report['rounds']} rounds; "
        "calls/s and the split between processes from the gateways' own metrics over the window; CPU (cores busy: "
        "CPU-seconds / wall seconds) from /proc per process. Medians over rounds; the ratio to `--procs 1` is taken "
        "within each round. gRPC client: `tokq.AsyncClient` (4 connections, calls spread over the processes they "
        "reach); HTTP client: one `httpx.AsyncClient` (keep-alive pool, one connection per call in flight).", "",
        *table("transport | gateway procs | client procs | calls/s | vs `--procs 1` | busiest process's share | "
               "cores: gateway processes | worker | Redis | clients | other processes | errors", cells, "lrrrrrlrrrrr"),
        "", "Reading (generated from the figures above):"]
    if one and one["vs_procs_1"]:
        lines.append(f"- One client against `--procs 2`: {one['vs_procs_1']:.2f}x the calls/s of `--procs 1`, its "
                     f"busiest process taking {one['busiest_share']:.0%} of the calls (50% is an even split).")
    if two and two["vs_procs_1"]:
        lines.append(f"- Two client processes: {two['vs_procs_1']:.2f}x.")
    lines += [f"- The machine's {report['cpus']} cores were {min(total):.2f}-{max(total):.2f} busy during the windows "
              "(all processes, other work included): near the core count, the ceiling is the machine, not one "
              "gateway process, and a second gateway process moves it only as far as it takes CPU that clients, "
              "worker and Redis were not using.", ""]
    return block(BLOCK, lines) + "\n"


@click.command("spread")
@click.option("--seconds", default=8.0, show_default=True, help="Measured window per configuration.")
@click.option("--concurrency", default=32, show_default=True, help="Calls in flight per client process.")
@click.option("--config", "configs", multiple=True,
              help="transport:gateway-procs:client-procs, e.g. grpc:2:1 (repeatable) [default: grpc 1/2 "
                   "procs x 1/2 clients, http 1/2 procs x 1 client].")
@harness.bench_options("gateway.md", json_out=True)
def spread_command(seconds, concurrency, configs, rounds, json_path, results_md) -> None:
    """Calls/s from one caller against `tokq gateway --procs 1` and `--procs 2`."""
    try:
        chosen = [(t, int(p), int(c)) for t, p, c in (x.split(":") for x in configs)] or CONFIGS
        if any(t not in RPC_OF or p < 1 or c < 1 for t, p, c in chosen):
            raise ValueError
    except ValueError:
        raise click.UsageError(f"--config takes grpc|http:procs:clients, got {configs}") from None
    report = run(seconds=seconds, concurrency=concurrency, rounds=rounds, configs=chosen)
    harness.save_json(json_path, report)
    publish(markdown_section(report, command_line()), results_md, BLOCK)


@click.group()
def main() -> None:
    """The client process `tokq bench spread` starts."""


@main.command("client")
@click.option("--transport", type=click.Choice(["grpc", "http"]), required=True)
@click.option("--target", required=True)
@click.option("--concurrency", type=int, required=True)
def client_command(transport, target, concurrency) -> None:
    asyncio.run(client(transport, target, concurrency))


if __name__ == "__main__":
    main()
