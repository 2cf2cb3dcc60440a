"""Gateway CPU per single-input call over HTTP (POST /v1/embeddings) against gRPC (Embed), measured
on the same gateway process in the same run, and orjson against the standard json module for the
HTTP response body.

    tokq bench http-cpu [--calls 1000] [--concurrency 8] [--rounds 3]
        [--results-md profiling/results/gateway.md]

Starts an embedded Redis, one `tokq gateway --http-port` and one `tokq worker --threads 1`. Each
round sends ``--calls`` single-input calls (closed loop, ``--concurrency`` in flight) over gRPC
(tokq.AsyncClient) and then over HTTP (httpx, keep-alive), reading each process's CPU time from
/proc right before and after the measured calls. Per-call figures are medians over the rounds;
the HTTP/gRPC ratio is taken within each round. The load generator runs in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone

import click

from tokq.profiling.bench.gateway_cpu import loadavg
from tokq.profiling.bench.proc_cpu import proc_cpu_s
from tokq.profiling.results_md import command_line, machine_cores, markers, write_block

BLOCK = "tokq bench http-cpu"
SECTION_START, SECTION_END = markers(BLOCK)
MODEL = "all-MiniLM-L6-v2"


def _texts(n: int, seed: int) -> list[str]:
    from tokq.model.info import bundled_model_path

    words = [w.strip() for w in open(bundled_model_path() / "vocab.txt", encoding="utf-8")
             if w.strip().isalpha() and len(w.strip()) > 2][:20000]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(n)]


async def _closed_loop(call, texts: list[str], concurrency: int) -> None:
    it = iter(texts)

    async def lane():
        for text in it:
            await call(text)
    await asyncio.gather(*(lane() for _ in range(concurrency)))


async def _run_round(grpc_target: str, http_url: str, texts: list[str], concurrency: int,
                     pids: dict[str, int], warmup: int) -> dict:
    import httpx

    from tokq import AsyncClient

    out = {}
    async with AsyncClient(grpc_target) as grpc_client, httpx.AsyncClient(base_url=http_url, timeout=60) as http:
        async def via_grpc(text):
            await grpc_client.embed([text], timeout=60)

        async def via_http(text):
            resp = await http.post("/v1/embeddings", json={"model": MODEL, "input": text})
            resp.raise_for_status()

        for name, call in (("grpc", via_grpc), ("http", via_http)):
            await _closed_loop(call, texts[:warmup], concurrency)
            before = {p: proc_cpu_s(pid) for p, pid in pids.items()}
            started = time.perf_counter()
            await _closed_loop(call, texts, concurrency)
            wall_s = time.perf_counter() - started
            after = {p: proc_cpu_s(pid) for p, pid in pids.items()}
            out[name] = {"cpu_ms_per_call": {p: 1000 * (after[p] - before[p]) / len(texts) for p in pids},
                         "calls_per_s": len(texts) / wall_s}
    return out


def json_encoding(repeats: int = 2000) -> dict:
    """Seconds per one-input response body: orjson writing the float32 array directly against
    json.dumps of the same body as Python floats (what Starlette's JSONResponse would do)."""
    import numpy as np
    import orjson

    vector = np.random.default_rng(0).standard_normal(384).astype(np.float32)

    def body(v):
        return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": v}],
                "model": MODEL, "usage": {"prompt_tokens": 8, "total_tokens": 8}}

    def with_orjson():
        orjson.dumps(body(vector), option=orjson.OPT_SERIALIZE_NUMPY)

    def with_json():
        json.dumps(body(vector.tolist()), separators=(",", ":")).encode()

    times = {}
    for name, fn in (("orjson", with_orjson), ("json", with_json)):
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(repeats):
                fn()
            runs.append((time.perf_counter() - t) / repeats)
        times[name] = statistics.median(runs)
    return {"orjson_us": times["orjson"] * 1e6, "json_us": times["json"] * 1e6,
            "json_over_orjson": times["json"] / times["orjson"]}


def run(calls: int, concurrency: int, rounds: int, seed: int) -> dict:
    import redis

    from tokq.processes import stop_all
    from tokq.profiling.bench.workers import start_worker
    from tokq.redis.embedded import EmbeddedRedis, free_port

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    server = EmbeddedRedis().start()
    env["TOKQ_REDIS_URL"] = server.url
    port, http_port = free_port(), free_port()
    import subprocess

    def spawn(*args):
        return subprocess.Popen([sys.executable, "-m", "tokq.cli", *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    gateway = spawn("gateway", "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port))
    worker = start_worker(server.url, "http-cpu", env=env)
    try:
        import httpx

        deadline = time.monotonic() + 180
        while True:  # ready: Redis answers and the worker has warmed up
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or gateway.poll() is not None or worker.poll() is not None:
                raise RuntimeError("the gateway or worker did not start")
            time.sleep(0.5)
        client = redis.Redis.from_url(server.url)
        pids = {"gateway": gateway.pid, "worker": worker.pid, "redis": int(client.info("server")["process_id"]),
                "load generator (this process)": os.getpid()}
        client.close()
        texts = _texts(calls + 200, seed)
        results = [asyncio.run(_run_round(f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", texts[200:],
                                          concurrency, pids, warmup=200)) for _ in range(rounds)]
    finally:
        stop_all([gateway, worker])
        server.close()
    return {"calls": calls, "concurrency": concurrency, "rounds": results, "json": json_encoding(),
            "loadavg": loadavg(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def markdown_section(report: dict, command: str) -> str:
    rounds = report["rounds"]
    procs = list(rounds[0]["grpc"]["cpu_ms_per_call"])

    def med(kind, proc):
        return statistics.median(r[kind]["cpu_ms_per_call"][proc] for r in rounds)

    ratios = [r["http"]["cpu_ms_per_call"]["gateway"] / r["grpc"]["cpu_ms_per_call"]["gateway"] for r in rounds]
    rates = {k: statistics.median(r[k]["calls_per_s"] for r in rounds) for k in ("grpc", "http")}
    js = report["json"]
    lines = [
        SECTION_START,
        "### HTTP API: gateway CPU per call, HTTP against gRPC",
        "",
        f"`{command}` — {report['date']}, {machine_cores(report['cpus'])} (other "
        f"processes compete; load average at the end {' '.join(report['loadavg'])}), Python {report['python']}.",
        f"{report['calls']} single-input calls per transport per round, {report['concurrency']} in flight, "
        f"{len(rounds)} rounds; CPU from /proc per process over exactly the measured calls; medians over rounds.",
        "",
        "| process | gRPC CPU ms/call | HTTP CPU ms/call |",
        "|---|---:|---:|",
        *[f"| {p} | {med('grpc', p):.3f} | {med('http', p):.3f} |" for p in procs],
        "",
        f"Gateway HTTP/gRPC CPU ratio per call: median {statistics.median(ratios):.2f}x "
        f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)}). Calls/s (closed loop, this machine): "
        f"gRPC {rates['grpc']:.0f}, HTTP {rates['http']:.0f} (bounded by the shared cores and the load "
        "generator, which spends more CPU per call on HTTP (httpx) than on gRPC; not a server limit).",
        "",
        f"JSON for a one-input response body (384 floats): orjson {js['orjson_us']:.1f} µs, stdlib json "
        f"{js['json_us']:.1f} µs ({js['json_over_orjson']:.1f}x): the gateway writes bodies with orjson.",
        SECTION_END,
    ]
    return "\n".join(lines) + "\n"


@click.command("http-cpu")
@click.option("--calls", default=1000, show_default=True, help="Measured calls per transport per round.")
@click.option("--concurrency", default=8, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--seed", default=1, show_default=True)
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this file's HTTP CPU block.")
def http_cpu_command(calls, concurrency, rounds, seed, results_md) -> None:
    """HTTP vs gRPC gateway CPU per call, and orjson vs json."""
    report = run(calls, concurrency, rounds, seed)
    section = markdown_section(report, command_line())
    click.echo(section)
    if results_md:
        write_block(results_md, BLOCK, section)
