"""Does `tokq gateway --procs 2` raise what one caller gets? Single-input Embed calls/s against
`--procs 1` and `--procs 2`, from one client process and from two, over gRPC (tokq.AsyncClient,
which spreads its calls over the processes it reaches) and over HTTP (httpx, keep-alive pool).

    tokq bench spread [--seconds 8] [--concurrency 32]
        [--rounds 3] [--json spread.json] [--results-md profiling/results/gateway.md]

Starts an embedded Redis, one `tokq worker --threads 1`, and two gateways on their own ports:
`--procs 1` and `--procs 2` (each process with its metrics port). Each measurement starts the
client processes (`python -m tokq.profiling.bench.spread client`: a closed loop, ``--concurrency`` calls in flight each)
and, once all have warmed up, measures a window of ``--seconds`` while they run; calls/s and
the split between processes come from the gateways' own metrics over that window, CPU from
/proc per process over it. Configurations are interleaved within each round; figures are
medians over rounds, ratios taken within a round.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import click

from tokq.profiling.bench.gateway_cpu import loadavg
from tokq.profiling.bench.proc_cpu import children, cmdline, proc_cpu_s
from tokq.profiling.bench.service.run import cpu_busy_s

from tokq.profiling.results_md import command_line, machine_cores, markers, write_block

BLOCK = "tokq bench spread"
SECTION_START, SECTION_END = markers(BLOCK)
MODEL = "all-MiniLM-L6-v2"
START_TIMEOUT_S = 180
RPC_OF = {"grpc": "Embed", "http": "http.Embeddings"}
# (transport, gateway processes, client processes), in the order each round runs them.
CONFIGS = [("grpc", 1, 1), ("grpc", 2, 1), ("grpc", 1, 2), ("grpc", 2, 2), ("http", 1, 1), ("http", 2, 1)]


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def ok_calls(metrics_port: int, rpc: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "tokq_gateway_requests_total" and s.labels.get("rpc") == rpc
               and s.labels.get("code") == "OK")


def gateway_children(pid: int) -> list[int]:
    """The gateway processes `--procs N` started (multiprocessing's spawned workers, not its
    resource tracker)."""
    return [c for c in children(pid) if any("spawn_main" in arg for arg in cmdline(c))]


class Gateway:
    """`tokq gateway --procs N` with gRPC, HTTP and one metrics port per process."""

    def __init__(self, procs: int, redis_url: str, log) -> None:
        from tokq.redis.embedded import free_port

        self.procs = procs
        self.port, self.http_port = free_port(), free_port()
        base = free_port(offsets=tuple(range(procs)))  # process i serves metrics on base + i
        self.metrics_ports = [base + i for i in range(procs)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokq.cli", "gateway", "--host", "127.0.0.1", "--port", str(self.port),
             "--http-port", str(self.http_port), "--procs", str(procs),
             "--metrics-port", str(self.metrics_ports[0])],
            env={**_env(), "TOKQ_REDIS_URL": redis_url}, stdout=log, stderr=log)

    def wait(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                for port in self.metrics_ports:
                    ok_calls(port, "Embed")
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gateway --procs {self.procs} did not start")
                time.sleep(0.3)
        # One process runs in the launcher itself; several are its children.
        self.pids = gateway_children(self.proc.pid) if self.procs > 1 else [self.proc.pid]
        assert len(self.pids) == self.procs, self.pids

    def ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/ready", timeout=2).status == 200
        except OSError:
            return False

    def counts(self, rpc: str) -> list[float]:
        return [ok_calls(port, rpc) for port in self.metrics_ports]


def measure(gateway: Gateway, transport: str, num_clients: int, *, seconds: float, concurrency: int,
            fixed_pids: dict[str, int]) -> dict:
    """One window: ``num_clients`` client processes against ``gateway``, opened once every client
    has connected and warmed up, closed before any of them stops."""
    target = (f"127.0.0.1:{gateway.port}" if transport == "grpc" else f"http://127.0.0.1:{gateway.http_port}")
    clients = [subprocess.Popen([sys.executable, "-m", "tokq.profiling.bench.spread", "client",
                                 "--transport", transport, "--target", target, "--concurrency", str(concurrency)],
                                env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for _ in range(num_clients)]
    try:
        for c in clients:
            if c.stdout.readline().strip() != "ready":
                raise RuntimeError("a client process failed to start")
        pids = {**fixed_pids, **{f"gateway process {i + 1}": pid for i, pid in enumerate(gateway.pids)},
                **{f"client {i + 1}": c.pid for i, c in enumerate(clients)}}
        rpc = RPC_OF[transport]
        before_calls, before_cpu = gateway.counts(rpc), {k: proc_cpu_s(p) for k, p in pids.items()}
        busy0, t0 = cpu_busy_s(), time.perf_counter()
        time.sleep(seconds)
        after_calls, after_cpu = gateway.counts(rpc), {k: proc_cpu_s(p) for k, p in pids.items()}
        busy1, wall_s = cpu_busy_s(), time.perf_counter() - t0
        outs = [json.loads(c.communicate("stop\n", timeout=120)[0].strip().splitlines()[-1]) for c in clients]
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
                c.wait()
    split = [a - b for a, b in zip(after_calls, before_calls)]
    return {"transport": transport, "gateway_procs": gateway.procs, "client_procs": num_clients,
            "calls_per_s": sum(split) / wall_s, "split": split,
            "cores": {k: (after_cpu[k] - before_cpu[k]) / wall_s for k in pids},
            "machine_cores_busy": (busy1 - busy0) / wall_s if busy0 is not None else None,
            "client_errors": sum(o["errors"] for o in outs)}


def run(*, seconds: float, concurrency: int, rounds: int, configs=CONFIGS) -> dict:
    import redis

    from tokq.processes import stop_all
    from tokq.profiling.bench.workers import start_worker
    from tokq.redis.embedded import EmbeddedRedis

    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / "tokq-bench-spread.log", "ab")
    server = EmbeddedRedis().start()
    client = redis.Redis.from_url(server.url)
    worker = start_worker(server.url, "spread", env=_env(), log=log)
    gateways = {n: Gateway(n, server.url, log) for n in sorted({procs for _, procs, _ in configs})}
    try:
        for g in gateways.values():
            g.wait()
        deadline = time.monotonic() + START_TIMEOUT_S
        for g in gateways.values():  # ready: the gateway sees a live (warmed-up) worker
            while not g.ready():
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the worker never became ready")
                time.sleep(0.3)
        fixed = {"worker": worker.pid, "redis": int(client.info("server")["process_id"])}
        results = []
        for r in range(rounds):
            for transport, procs, num_clients in configs:
                result = measure(gateways[procs], transport, num_clients, seconds=seconds,
                                 concurrency=concurrency, fixed_pids=fixed)
                click.echo(f"round {r + 1}: {transport} --procs {procs}, {num_clients} client(s): "
                           f"{result['calls_per_s']:.0f} calls/s, split {result['split']}", err=True)
                results.append({"round": r, **result})
    finally:
        client.close()
        stop_all([worker, *(g.proc for g in gateways.values())])
        server.close()
        log.close()
    return {"seconds": seconds, "concurrency": concurrency, "rounds": rounds, "results": results,
            "loadavg": loadavg(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


# -- the load generator (its own process) -------------------------------------------------------

async def _client(transport: str, target: str, concurrency: int) -> dict:
    """Closed loop until a line arrives on stdin; prints "ready" once warmed up."""
    import threading

    import httpx

    from tokq import AsyncClient

    if transport == "grpc":
        session = AsyncClient(target)

        async def call(i: int) -> None:
            await session.embed([f"red running shoes {i % 97}"], timeout=30)
        close = session.close
    else:
        session = httpx.AsyncClient(base_url=target, timeout=30,
                                    limits=httpx.Limits(max_connections=concurrency))

        async def call(i: int) -> None:
            resp = await session.post("/v1/embeddings", json={"model": MODEL, "input": f"red running shoes {i % 97}"})
            resp.raise_for_status()
        close = session.aclose
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
    calls = errors = 0
    warm = 4 * concurrency  # every connection used, the client's pool has found the processes

    async def lane(k: int) -> None:
        nonlocal calls, errors
        i = k
        while not stop.is_set():
            try:
                await call(i)
                calls += 1
            except Exception:
                errors += 1
            if calls == warm:
                print("ready", flush=True)
            i += concurrency

    cpu0 = time.process_time()
    await asyncio.gather(*(lane(k) for k in range(concurrency)))
    await close()
    return {"calls": calls, "errors": errors, "cpu_s": time.process_time() - cpu0}


# -- the report ---------------------------------------------------------------------------------

def medians(report: dict) -> list[dict]:
    """Per configuration: median calls/s, split share and cores over rounds; the --procs 2 /
    --procs 1 ratio taken within each round."""
    by = {}
    for r in report["results"]:
        by.setdefault((r["transport"], r["gateway_procs"], r["client_procs"]), []).append(r)
    rows = []
    for (transport, procs, clients), runs in by.items():
        base = {x["round"]: x for x in by.get((transport, 1, clients), [])}
        ratios = [x["calls_per_s"] / base[x["round"]]["calls_per_s"] for x in runs
                  if x["round"] in base and base[x["round"]]["calls_per_s"] > 0]
        shares = [max(x["split"]) / sum(x["split"]) for x in runs if sum(x["split"]) > 0]
        keys = list(runs[0]["cores"])
        rows.append({"transport": transport, "gateway_procs": procs, "client_procs": clients,
                     "calls_per_s": statistics.median(x["calls_per_s"] for x in runs),
                     "vs_procs_1": statistics.median(ratios) if ratios else None,
                     "busiest_share": statistics.median(shares) if shares else None,
                     "cores": {k: statistics.median(x["cores"][k] for x in runs) for k in keys},
                     "machine_cores_busy": statistics.median(x.get("machine_cores_busy") or 0.0 for x in runs),
                     "errors": sum(x["client_errors"] for x in runs)})
    return rows


def markdown_section(report: dict, command: str) -> str:
    rows = medians(report)
    lines = [
        SECTION_START, "## One caller against `--procs N`: do calls spread over the gateway's processes?", "",
        f"`{command}` — {report['date']}, **{machine_cores(report['cpus'])}**: the load generator(s), "
        f"every gateway process, the worker (1 torch thread) and Redis compete for the same cores, beside other "
        f"work (load average at the end {' '.join(report['loadavg'])}). Python {report['python']}.",
        f"Single-input Embed calls, closed loop, {report['concurrency']} in flight per client process, a "
        f"{report['seconds']:g} s window per measurement, configurations interleaved, {report['rounds']} rounds; "
        "calls/s and the split between processes from the gateways' own metrics over the window; CPU "
        "(cores busy: CPU-seconds / wall seconds) from /proc per process. Medians over rounds; the ratio to "
        "`--procs 1` is taken within each round. gRPC client: `tokq.AsyncClient` (4 connections, calls "
        "spread over the processes they reach); HTTP client: one `httpx.AsyncClient` (keep-alive pool, one "
        "connection per call in flight).", "",
        "| transport | gateway procs | client procs | calls/s | vs `--procs 1` | busiest process's share "
        "| cores: gateway processes | worker | Redis | clients | other processes | errors |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cores = row["cores"]
        gw = " + ".join(f"{v:.2f}" for k, v in cores.items() if k.startswith("gateway"))
        cl = sum(v for k, v in cores.items() if k.startswith("client"))
        vs = "1.00x (base)" if row["gateway_procs"] == 1 else (f"{row['vs_procs_1']:.2f}x" if row["vs_procs_1"]
                                                                else "–")
        share = f"{row['busiest_share']:.0%}" if row["gateway_procs"] > 1 and row["busiest_share"] else "–"
        lines.append(f"| {row['transport']} | {row['gateway_procs']} | {row['client_procs']} "
                     f"| {row['calls_per_s']:,.0f} | {vs} | {share} | {gw} | {cores['worker']:.2f} "
                     f"| {cores['redis']:.2f} | {cl:.2f} "
                     f"| {max(0.0, row['machine_cores_busy'] - sum(cores.values())):.2f} | {row['errors']} |")
    busy = {(r["transport"], r["gateway_procs"], r["client_procs"]): r for r in rows}
    one, two = busy.get(("grpc", 2, 1)), busy.get(("grpc", 2, 2))
    total = {k: r["machine_cores_busy"] for k, r in busy.items()}
    lines += ["", "Reading (generated from the figures above):"]
    if one and one["vs_procs_1"]:
        lines.append(f"- One client against `--procs 2`: {one['vs_procs_1']:.2f}x the calls/s of `--procs 1`, "
                     f"its busiest process taking {one['busiest_share']:.0%} of the calls (50% is an even split).")
    if two and two["vs_procs_1"]:
        lines.append(f"- Two client processes: {two['vs_procs_1']:.2f}x.")
    lines.append(f"- The machine's {report['cpus']} cores were {min(total.values()):.2f}-{max(total.values()):.2f} "
                 "busy during the windows (all processes, other work included): near the core count, the "
                 "ceiling is the machine, not one gateway process, and a second gateway process moves it only "
                 "as far as it takes CPU that clients, worker and Redis were not using.")
    lines += ["", SECTION_END]
    return "\n".join(lines) + "\n"


# -- command line -------------------------------------------------------------------------------

@click.command("spread")
@click.option("--seconds", default=8.0, show_default=True, help="Measured window per configuration.")
@click.option("--concurrency", default=32, show_default=True, help="Calls in flight per client process.")
@click.option("--rounds", default=3, show_default=True)
@click.option("--config", "configs", multiple=True,
              help="transport:gateway-procs:client-procs, e.g. grpc:2:1 (repeatable) [default: grpc 1/2 "
                   "procs x 1/2 clients, http 1/2 procs x 1 client].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this benchmark's block of e.g. profiling/results/gateway.md.")
def spread_command(seconds, concurrency, rounds, configs, json_path, results_md) -> None:
    """Calls/s from one caller against `tokq gateway --procs 1` and `--procs 2`."""
    try:
        chosen = [(t, int(p), int(c)) for t, p, c in (x.split(":") for x in configs)] or CONFIGS
        if any(t not in RPC_OF or p < 1 or c < 1 for t, p, c in chosen):
            raise ValueError
    except ValueError:
        raise click.UsageError(f"--config takes grpc|http:procs:clients, got {configs}") from None
    report = run(seconds=seconds, concurrency=concurrency, rounds=rounds, configs=chosen)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    section = markdown_section(report, command_line())
    click.echo(section)
    if results_md:
        write_block(results_md, BLOCK, section)


@click.group()
def main() -> None:
    """The client process `tokq bench spread` starts (client)."""


@main.command("client")
@click.option("--transport", type=click.Choice(["grpc", "http"]), required=True)
@click.option("--target", required=True)
@click.option("--concurrency", type=int, required=True)
def client_command(transport, target, concurrency) -> None:
    """Closed-loop calls until a line arrives on stdin, then one JSON line of totals."""
    click.echo(json.dumps(asyncio.run(_client(transport, target, concurrency))))


if __name__ == "__main__":
    main()
