"""Gateway CPU per single-input call over HTTP (POST /v1/embeddings) against gRPC (Embed), on the same
gateway process in the same run, and orjson against the standard json module for the HTTP body.

    tokq bench http-cpu [--calls 1000] [--concurrency 8] [--rounds 3] [--results-md profiling/results/gateway.md]

Starts an embedded Redis, one `tokq gateway --http-port` and one `tokq worker --threads 1`. Each
round sends ``--calls`` single-input calls (closed loop, ``--concurrency`` in flight) over gRPC
(tokq.AsyncClient), then over HTTP (httpx, keep-alive), reading each process's CPU time from /proc
right before and after the measured calls. Medians over rounds; the HTTP/gRPC ratio is taken
within each round. The load generator runs in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import statistics
import time
from datetime import datetime, timezone

import click

from tokq.profiling import harness
from tokq.profiling.bench.loadgen import closed_loop
from tokq.profiling.harness import median
from tokq.profiling.results_md import block, command_line, machine_cores, publish, table

BLOCK = "tokq bench http-cpu"
MODEL = "all-MiniLM-L6-v2"
WARMUP = 200


async def one_round(stack: harness.Stack, texts: list[str], concurrency: int, pids: dict[str, int]) -> dict:
    import httpx

    from tokq import AsyncClient

    gateway, out = stack.gateways[0], {}
    async with AsyncClient(gateway.target) as grpc_client, httpx.AsyncClient(base_url=gateway.http_url,
                                                                            timeout=60) as http:
        async def via_grpc(text):
            await grpc_client.embed([text], timeout=60)

        async def via_http(text):
            (await http.post("/v1/embeddings", json={"model": MODEL, "input": text})).raise_for_status()

        for name, call in (("grpc", via_grpc), ("http", via_http)):
            await closed_loop(call, texts[:WARMUP], concurrency)
            with harness.CpuWindow(pids) as cpu:
                await closed_loop(call, texts[WARMUP:], concurrency)
            out[name] = {"cpu_ms_per_call": cpu.ms_per(len(texts) - WARMUP),
                         "calls_per_s": (len(texts) - WARMUP) / cpu.wall_s}
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

    ways = {"orjson": lambda: orjson.dumps(body(vector), option=orjson.OPT_SERIALIZE_NUMPY),
            "json": lambda: json.dumps(body(vector.tolist()), separators=(",", ":")).encode()}
    times = {}
    for name, fn in ways.items():
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
    rng, words = random.Random(seed), harness.vocab_words()[:20000]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(calls + WARMUP)]
    with harness.Stack() as stack:
        stack.gateway(http=True)
        stack.worker("http-cpu")
        stack.wait()
        pids = {**stack.pids(), "load generator (this process)": os.getpid()}
        results = [asyncio.run(one_round(stack, texts, concurrency, pids)) for _ in range(rounds)]
    return {"calls": calls, "concurrency": concurrency, "rounds": results, "json": json_encoding(),
            "loadavg": harness.loadavg(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def markdown_section(report: dict, command: str) -> str:
    rounds, js = report["rounds"], report["json"]
    # A round whose gRPC calls cost the gateway less than one clock tick (/proc's resolution) has no ratio.
    ratios = [r["http"]["cpu_ms_per_call"]["gateway"] / grpc for r in rounds
              if (grpc := r["grpc"]["cpu_ms_per_call"]["gateway"]) > 0]
    ratio = (f"median {statistics.median(ratios):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in ratios)})" if ratios
             else "not measured: the gateway's gRPC CPU stayed under one clock tick of /proc in every round")
    return block(BLOCK, [
        "## HTTP API: gateway CPU per call, HTTP against gRPC", "",
        f"`{command}` — {report['date']}, {machine_cores(report['cpus'])} (other processes compete; load average "
        f"at the end {' '.join(report['loadavg'])}), Python {report['python']}.",
        f"{report['calls']} single-input calls per transport per round, {report['concurrency']} in flight, "
        f"{len(rounds)} rounds; CPU from /proc per process over exactly the measured calls; medians over rounds.", "",
        *table("process | gRPC CPU ms/call | HTTP CPU ms/call",
               ([p, *(f"{median(rounds, k, 'cpu_ms_per_call', p):.3f}" for k in ("grpc", "http"))]
                for p in rounds[0]["grpc"]["cpu_ms_per_call"])), "",
        f"Gateway HTTP/gRPC CPU ratio per call: {ratio}. Calls/s (closed loop, this machine): "
        f"gRPC {median(rounds, 'grpc', 'calls_per_s'):.0f}, HTTP {median(rounds, 'http', 'calls_per_s'):.0f} "
        "(bounded by the shared cores and the load generator, which spends more CPU per call on HTTP (httpx) "
        "than on gRPC; not a server limit).", "",
        f"JSON for a one-input response body (384 floats): orjson {js['orjson_us']:.1f} µs, stdlib json "
        f"{js['json_us']:.1f} µs ({js['json_over_orjson']:.1f}x): the gateway writes bodies with orjson."]) + "\n"


@click.command("http-cpu")
@click.option("--calls", default=1000, show_default=True, help="Measured calls per transport per round.")
@click.option("--concurrency", default=8, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--seed", default=1, show_default=True)
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this file's section (profiling/results/gateway.md).")
def http_cpu_command(calls, concurrency, rounds, seed, results_md) -> None:
    """HTTP vs gRPC gateway CPU per call, and orjson vs json."""
    publish(markdown_section(run(calls, concurrency, rounds, seed), command_line()), results_md, BLOCK)
