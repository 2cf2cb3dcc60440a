"""Hostile input: a one-input call's latency with nobody else calling, then with six concurrent
callers sending the largest requests the gateway takes (and larger), in the same run.

    tokq bench hostile --results-md profiling/results/service.md

A real stack: an embedded Redis, one `tokq gateway` process and one `tokq worker` process (one
torch thread). The probe sends one short input at a time, paced, and records latency; the
abusers run in their own process (six threads, each sending back to back). Each abuse scenario
is measured between two idle phases and compared to their pooled median/p99 (rounds interleave,
so load from other processes lands on every phase alike). CPU seconds per process are read from
/proc for each phase.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import grpc
import redis

from tokq import config as cfg
from tokq.gateway.validate import Limits
from tokq.processes import wait_for_health
from tokq.profiling.bench.workers import start_worker, wait_heartbeats
from tokq.queue.keys import QueueKeys
from tokq.model.info import ModelInfo, bundled_model_path
from tokq.processes import stop_all
from tokq.profiling.bench.proc_cpu import proc_cpu_s
from tokq.profiling.results_md import block, command_line, machine_cores, write_block
from tokq.redis.embedded import EmbeddedRedis, free_port
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc

NUM_ABUSERS = 6
PROBE_TEXT = "hello"
OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 64 << 20)]
BLOCK = "tokq bench hostile"


def _words() -> list[str]:
    return [w.strip() for w in open(bundled_model_path() / "vocab.txt", encoding="utf-8")
            if w.strip().isalpha() and len(w.strip()) > 2][:20000]


def _text(num_bytes: int, seed: int) -> str:
    rng = random.Random(seed)
    words = _words()
    out, size = [], 0
    while size < num_bytes:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out).encode()[:num_bytes].decode("utf-8", "ignore")  # UTF-8 bytes, not chars


def scenarios(limits: Limits) -> dict[str, dict]:
    """name -> what each abuser sends over and over."""
    per_input = limits.max_input_bytes
    n_full = max(1, limits.max_request_bytes // per_input)
    return {
        "8 MB strings, truncate=true":
            {"sizes": [8 << 20], "truncate": True},
        f"{n_full} x {per_input // 1024} KiB inputs (request at the cap), truncate=false":
            {"sizes": [per_input] * n_full, "truncate": False},
        f"{n_full} x {per_input // 1024} KiB inputs (request at the cap), truncate=true":
            {"sizes": [per_input] * n_full, "truncate": True},
        f"1 x {per_input // 1024} KiB input (input at the cap), truncate=true":
            {"sizes": [per_input], "truncate": True},
    }


def _abuse(target: str, spec: dict, ready, stop, counts) -> None:
    """Abuser process: NUM_ABUSERS threads sending ``spec`` requests back to back."""
    texts = [_text(n, seed=i) for i, n in enumerate(spec["sizes"])]
    request = pb.EmbedRequest(inputs=texts, truncate=spec["truncate"])
    ready.set()

    def loop(i: int) -> None:
        with grpc.insecure_channel(target, OPTIONS) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            while not stop.is_set():
                try:
                    stub.Embed(request, timeout=30)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                with counts.get_lock():
                    counts[_CODES.index(code) if code in _CODES else len(_CODES)] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(NUM_ABUSERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


_CODES = ["OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAVAILABLE"]


@contextlib.contextmanager
def _abusers(ctx, target: str, spec: dict):
    """The abuser process, at full pressure; yields it and its reply counts by code."""
    ready, stop, counts = ctx.Event(), ctx.Event(), ctx.Array("l", len(_CODES) + 1)
    abuser = ctx.Process(target=_abuse, args=(target, spec, ready, stop, counts), daemon=True)
    abuser.start()
    try:
        if not ready.wait(300):  # its texts are built
            raise RuntimeError(f"the abuser process did not start (exit code {abuser.exitcode})")
        time.sleep(2.0)  # abusers at full pressure before probing
        yield abuser, counts
    finally:
        stop.set()
        abuser.join(60)


def _bare_server(port: int, ready) -> None:
    """The reference server: grpc.aio with no tokq in it, and the gateway's message limit. It
    refuses every Embed as soon as gRPC has received it (never parsed) and answers Info with an
    empty message: what gRPC's Python server costs by itself."""
    import asyncio

    async def embed(request: bytes, context) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused unread")

    async def info(request: bytes, context) -> bytes:
        return b""

    async def serve() -> None:
        handler = grpc.method_handlers_generic_handler("tokq.v1.Embedder", {
            "Embed": grpc.unary_unary_rpc_method_handler(embed),
            "Info": grpc.unary_unary_rpc_method_handler(info)})
        server = grpc.aio.server(handlers=[handler], options=OPTIONS)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(serve())


def _probe_noop(stub, duration_s: float, pace_s: float) -> list[float]:
    """Latencies (ms) of Info calls, paced like ``_probe``'s: a call with no model work."""
    return _probe(stub, duration_s, pace_s, call=lambda: stub.Info(pb.InfoRequest(), timeout=30))


def _reference(ctx, gateway_target: str, gateway_stub, gateway_pid: int, specs: dict[str, dict], phase_s: float,
               pace_s: float) -> dict:
    """For the scenario whose requests are all refused (the gateway's work alone): a no-op call
    (Info) on the gateway and on a bare grpc.aio server, idle, then beside the same abusers.
    How much of the probe's slow-down gRPC's Python server causes by itself, in the same run."""
    name = next(n for n, spec in specs.items() if not spec["truncate"] and len(spec["sizes"]) > 1)
    port = free_port()
    ready = ctx.Event()
    bare = ctx.Process(target=_bare_server, args=(port, ready), daemon=True)
    bare.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the reference gRPC server did not start")
        bare_channel = grpc.insecure_channel(f"127.0.0.1:{port}", OPTIONS)
        servers = {"tokq gateway": (gateway_target, gateway_stub, gateway_pid),
                   "bare grpc.aio server": (f"127.0.0.1:{port}", pb_grpc.EmbedderStub(bare_channel), bare.pid)}
        rows = {}
        for label, (target, stub, pid) in servers.items():
            _probe_noop(stub, 1.0, pace_s)  # warm-up
            idle = _probe_noop(stub, phase_s, pace_s)
            with _abusers(ctx, target, specs[name]) as (_, counts):
                cpu0, t0, replies0 = proc_cpu_s(pid), time.monotonic(), sum(counts[:])
                abused = _probe_noop(stub, phase_s, pace_s)
                cpu_s, wall = proc_cpu_s(pid) - cpu0, time.monotonic() - t0
                replies = sum(counts[:]) - replies0  # during the probe's window
            _settle(pid)
            rows[label] = {**_compared(idle, abused), "calls": len(abused),
                           "abuser_replies": replies, "server_cores": cpu_s / wall,
                           "cpu_ms_per_reply": 1000 * cpu_s / max(1, replies)}
        bare_channel.close()
    finally:
        bare.kill()
        bare.join(10)
    return {"scenario": name, "servers": rows}


def _probe(stub, duration_s: float, pace_s: float, errors: dict | None = None,
           timings: list | None = None, call=None) -> list[float]:
    """Latencies (ms) of one-input calls (or of ``call()``); a failed call counts in ``errors``
    and, as the worst case, as infinitely slow (a probe must never fail). ``timings`` gets each
    answered Embed's (latency, then the gateway's tokenize, queue, inference and total ms): where
    a slow call's time went."""
    call = call or (lambda: stub.Embed(pb.EmbedRequest(inputs=[PROBE_TEXT]), timeout=30))
    latencies = []
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        start = time.perf_counter()
        try:
            reply = call()
            latencies.append((time.perf_counter() - start) * 1000)
            if timings is not None:
                t = reply.timing
                timings.append((latencies[-1], t.tokenize_ms, t.queue_ms, t.inference_ms, t.total_ms))
        except grpc.RpcError as exc:
            latencies.append(float("inf"))
            if errors is not None:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
        time.sleep(pace_s)
    return latencies


def _compared(idle: list[float], abused: list[float]) -> dict[str, float]:
    """p50 and p99 of each phase's latencies, and the p99 ratio abused / idle."""
    return {"idle_p50_ms": statistics.median(idle), "idle_p99_ms": _pct(idle, 0.99),
            "abused_p50_ms": statistics.median(abused), "abused_p99_ms": _pct(abused, 0.99),
            "p99_ratio": _pct(abused, 0.99) / _pct(idle, 0.99)}


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(rounds: int, phase_s: float, pace_s: float) -> dict:
    info = ModelInfo.load()
    limits = Limits.resolve(info, cfg.load(cfg.GatewayConfig, env={}))
    server = EmbeddedRedis().start()
    port = free_port()
    target = f"127.0.0.1:{port}"
    env = {**os.environ, "TOKQ_REDIS_URL": server.url, "PYTHONUNBUFFERED": "1"}
    gateway = subprocess.Popen([sys.executable, "-m", "tokq.cli", "gateway", "--host", "127.0.0.1",
                                "--port", str(port)], env=env)
    worker = start_worker(server.url, "bench", env=env, log=None)  # its output shows on this console
    procs = {"gateway": gateway.pid, "worker": worker.pid, "redis": server._proc.pid}
    keys = QueueKeys(info.queue_name)
    r = redis.Redis.from_url(server.url)
    try:
        deadline = time.monotonic() + 180
        wait_heartbeats(r, {"bench": worker}, 180)
        # ready: Redis answers and the worker's heartbeat is seen
        wait_for_health(target, [gateway], max(1.0, deadline - time.monotonic()))
        channel = grpc.insecure_channel(target, OPTIONS)
        stub = pb_grpc.EmbedderStub(channel)
        _probe(stub, 3.0, pace_s)  # warm-up
        results = {name: {"abused": [], "idle": [], "cpu_s": {}, "codes": {}, "probe_errors": {},
                          "idle_timings": [], "abused_timings": []}
                   for name in scenarios(limits)}
        ctx = multiprocessing.get_context("spawn")
        for rnd in range(rounds):
            for name, spec in scenarios(limits).items():
                res = results[name]
                res["idle"] += _probe(stub, phase_s, pace_s, res["probe_errors"], res["idle_timings"])
                with _abusers(ctx, target, spec) as (abuser, counts):
                    pids = {**procs, "abusers": abuser.pid, "probe": os.getpid()}
                    cpu0 = {k: proc_cpu_s(p) for k, p in pids.items()}
                    t0 = time.monotonic()
                    res["abused"] += _probe(stub, phase_s, pace_s, res["probe_errors"], res["abused_timings"])
                    wall = time.monotonic() - t0
                    for k, p in pids.items():
                        res["cpu_s"].setdefault(k, []).append((proc_cpu_s(p) - cpu0[k]) / wall)
                for i, code in enumerate(_CODES + ["other"]):
                    res["codes"][code] = res["codes"].get(code, 0) + counts[i]
                if not _drain(r, keys):
                    print("warning: the worker was not idle 120 s after the abusers stopped",
                          file=sys.stderr)
                _settle(gateway.pid)
            print(f"round {rnd + 1}/{rounds} done", file=sys.stderr)
        reference = _reference(ctx, target, stub, gateway.pid, scenarios(limits), phase_s, pace_s)
        channel.close()
    finally:
        stop_all([gateway, worker])
        server.close()
    out = {"limits": limits.__dict__, "load_average": os.getloadavg(), "rounds": rounds,
           "phase_s": phase_s, "pace_s": pace_s, "scenarios": {}}
    idle_all = [v for res in results.values() for v in res["idle"]]
    for name, res in results.items():
        idle, abused = res["idle"], res["abused"]
        out["scenarios"][name] = {
            "calls": len(abused), "idle_calls": len(idle), **_compared(idle, abused),
            # the tails behind each p99 (a p99 of ~500 calls is their 5th-6th slowest): latency,
            # then the gateway's tokenize / queue (enqueue to claim) / inference / total ms
            "idle_slowest_ms": sorted(res["idle_timings"])[-10:],
            "abused_slowest_ms": sorted(res["abused_timings"])[-10:],
            "cpu_cores": {k: statistics.median(v) for k, v in res["cpu_s"].items()},
            "abuser_replies": {k: v for k, v in res["codes"].items() if v},
            "probe_errors": res["probe_errors"],
        }
    out["idle_p99_ms_all"] = _pct(idle_all, 0.99)
    out["reference"] = reference
    return out


def _drain(r: redis.Redis, keys: QueueKeys, timeout_s: float = 120) -> bool:
    """Wait for the worker to finish what abusers left queued and to register as idle (it
    found nothing to claim and waits for a notice), so the next idle phase is idle. False if
    that did not happen within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (not int(r.get(keys.tokens) or 0) and not int(r.get(keys.inflight) or 0)
                and r.scard(keys.idle) > 0):
            return True
        time.sleep(0.2)
    return False


def _settle(pid: int, timeout_s: float = 30.0, window_s: float = 0.5, busy: float = 0.1) -> None:
    """Wait until ``pid`` uses less than ``busy`` of a core over ``window_s``: abusers that are
    gone can leave the gateway tokenizing their last requests, which the next idle phase
    would otherwise measure."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = proc_cpu_s(pid)
        time.sleep(window_s)
        if proc_cpu_s(pid) - before < busy * window_s:
            return


def render(report: dict, command: str) -> str:
    lim = report["limits"]
    lines = ["", "## Hostile input: a one-input call beside six abusive callers", "",
             "Command:", "", f"    {command}", "",
             f"{machine_cores(capital=True)}, load average "
             f"{', '.join(f'{x:.1f}' for x in report['load_average'])} at the end (this bench's own "
             "processes included; anything else running shows here too). One gateway, one "
             f"worker (1 torch thread), an embedded Redis; the probe sends `{PROBE_TEXT!r}` alone, "
             f"then sleeps {report['pace_s'] * 1000:.0f} ms; six abuser threads (one process) send "
             f"back to back. {report['rounds']} rounds x {report['phase_s']:.0f} s per phase; each "
             "scenario's idle figures are the idle phases just before its abused phases (each "
             "starts once the queue is empty, the worker has registered as idle and the gateway is quiet); "
             "the last ratio is against "
             f"the p99 of all idle phases pooled ({report['idle_p99_ms_all']:.1f} ms). Caps "
             f"(defaults from max_length 256): {lim['max_input_bytes']:,} bytes per input, "
             f"{lim['max_request_bytes']:,} per request.", "",
             "| abusers send | probe calls (failed) | idle p50 / p99 ms | abused p50 / p99 ms | p99 ratio "
             "(target <= 2) | p99 ratio, pooled idle | abusers' replies | CPU cores: gateway / worker / redis / "
             "abusers / probe |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in report["scenarios"].items():
        cpu = s["cpu_cores"]
        replies = ", ".join(f"{k} {v:,}" for k, v in s["abuser_replies"].items())
        lines.append(
            f"| {name} | {s['calls']} ({sum(s['probe_errors'].values())}) | {s['idle_p50_ms']:.1f} / {s['idle_p99_ms']:.1f} | "
            f"{s['abused_p50_ms']:.1f} / {s['abused_p99_ms']:.1f} | **{s['p99_ratio']:.2f}x** | "
            f"{s['abused_p99_ms'] / report['idle_p99_ms_all']:.2f}x | "
            f"{replies} | {cpu['gateway']:.2f} / {cpu['worker']:.2f} / {cpu['redis']:.2f} / "
            f"{cpu['abusers']:.2f} / {cpu['probe']:.2f} |")
    lines.append("")
    if report.get("reference"):
        lines += _render_reference(report["reference"], report["phase_s"])
    return block(BLOCK, lines)


def _render_reference(ref: dict, phase_s: float) -> list[str]:
    rows = ref["servers"]
    lines = [f"Reference, same run: a call with no model work (`Info`) on the gateway and on a bare "
             f"grpc.aio server (no tokq: it refuses every Embed as soon as gRPC has received it, "
             f"unparsed, with the gateway's message limit), {phase_s:.0f} s idle, then {phase_s:.0f} s "
             f"beside the abusers of \"{ref['scenario']}\":", "",
             "| server | idle p50 / p99 ms | abused p50 / p99 ms | p99 ratio | abusers' replies "
             "in the window | server CPU cores |", "|---|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['idle_p50_ms']:.2f} / {r['idle_p99_ms']:.2f} | "
                     f"{r['abused_p50_ms']:.2f} / {r['abused_p99_ms']:.2f} | {r['p99_ratio']:.2f}x | "
                     f"{r['abuser_replies']:,} | {r['server_cores']:.2f} |")
    bare, ours = rows["bare grpc.aio server"], rows["tokq gateway"]
    lines += ["", f"Reading (generated from the figures above): six callers sending requests of this "
              f"size back to back raise a no-op call's p99 {bare['p99_ratio']:.1f}x on a gRPC Python "
              f"server that does nothing with them, {ours['p99_ratio']:.1f}x on the gateway; "
              f"receiving them costs the bare server {bare['cpu_ms_per_reply']:.1f} ms of CPU each "
              f"({bare['server_cores']:.2f} cores), the gateway {ours['cpu_ms_per_reply']:.1f} ms "
              f"(refusing them included; {ours['server_cores']:.2f} cores).", ""]
    return lines


@click.command("hostile")
@click.option("--rounds", default=3, show_default=True)
@click.option("--phase-s", default=15.0, show_default=True)
@click.option("--pace-ms", default=20.0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the raw report here.")
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this file's block (e.g. profiling/results/service.md).")
def hostile_command(rounds, phase_s, pace_ms, json_path, results_md) -> None:
    """A one-input call's latency alone, then beside six callers sending the largest requests."""
    report = run(rounds, phase_s, pace_ms / 1000)
    section = render(report, command_line())
    print(section)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    if results_md:
        write_block(results_md, BLOCK, section)
