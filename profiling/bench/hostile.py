"""Hostile input: a one-input call's latency alone, then beside six callers (one process) sending the
largest requests the gateway takes (and larger), on a real stack; CPU per process from /proc."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time

import click
import grpc

from tokq.profiling import harness
from tokq.profiling.harness import GRPC_LIMITS, pct
from tokq.profiling.results_md import block, command_line, machine_cores, publish, table

NUM_ABUSERS = 6
PRESSURE_S = 2.0  # abusers at full pressure before probing
WARMUP_S = 3.0  # probe calls before the first idle phase (1/3 of it before each reference server)
PROBE_TEXT = "hello"
BLOCK = "tokq bench hostile"
CODES = ["OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAVAILABLE"]


def _stub(channel):
    from tokq.v1 import embedder_pb2_grpc as pb_grpc

    return pb_grpc.EmbedderStub(channel)


def _text(num_bytes: int, seed: int, words: list[str]) -> str:
    rng, out, size = random.Random(seed), [], 0
    while size < num_bytes:
        out.append(rng.choice(words))
        size += len(out[-1]) + 1
    return " ".join(out).encode()[:num_bytes].decode("utf-8", "ignore")  # UTF-8 bytes, not chars


def scenarios(limits) -> dict[str, dict]:
    """name -> what each abuser sends over and over."""
    per_input = limits.max_input_bytes
    n_full = max(1, limits.max_request_bytes // per_input)
    at_cap = f"{n_full} x {per_input // 1024} KiB inputs (request at the cap)"
    return {"8 MB strings, truncate=true": {"sizes": [8 << 20], "truncate": True},
            f"{at_cap}, truncate=false": {"sizes": [per_input] * n_full, "truncate": False},
            f"{at_cap}, truncate=true": {"sizes": [per_input] * n_full, "truncate": True},
            f"1 x {per_input // 1024} KiB input (input at the cap), truncate=true": {"sizes": [per_input],
                                                                                   "truncate": True}}


def _abuse(target: str, spec: dict, ready, stop, counts) -> None:
    """Abuser process: NUM_ABUSERS threads sending ``spec`` requests back to back."""
    from tokq.v1 import embedder_pb2 as pb

    words = harness.vocab_words()[:20000]
    request = pb.EmbedRequest(inputs=[_text(n, i, words) for i, n in enumerate(spec["sizes"])], truncate=spec["truncate"])
    ready.set()

    def loop() -> None:
        with grpc.insecure_channel(target, GRPC_LIMITS) as channel:
            stub = _stub(channel)
            while not stop.is_set():
                try:
                    stub.Embed(request, timeout=30)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                with counts.get_lock():
                    counts[CODES.index(code) if code in CODES else len(CODES)] += 1
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(NUM_ABUSERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@contextlib.contextmanager
def _abusers(ctx, target: str, spec: dict):
    """The abuser process, at full pressure; yields it and its reply counts by code."""
    ready, stop, counts = ctx.Event(), ctx.Event(), ctx.Array("l", len(CODES) + 1)
    abuser = ctx.Process(target=_abuse, args=(target, spec, ready, stop, counts), daemon=True)
    abuser.start()
    try:
        if not ready.wait(300):  # its texts are built
            raise RuntimeError(f"the abuser process did not start (exit code {abuser.exitcode})")
        time.sleep(PRESSURE_S)
        yield abuser, counts
    finally:
        stop.set()
        abuser.join(60)


def _probe(stub, duration_s: float, pace_s: float, errors: dict | None = None, timings: list | None = None,
           call=None) -> list[float]:
    """Latencies (ms) of one-input calls (or ``call()``), a failed one infinite and counted in ``errors``;
    ``timings`` gets each answer's latency and the gateway's tokenize, queue, inference and total ms."""
    from tokq.v1 import embedder_pb2 as pb

    call = call or (lambda: stub.Embed(pb.EmbedRequest(inputs=[PROBE_TEXT]), timeout=30))
    latencies, end = [], time.monotonic() + duration_s
    while time.monotonic() < end:
        start = time.perf_counter()
        try:
            answer = call()
            latencies.append((time.perf_counter() - start) * 1000)
            if timings is not None:
                t = answer.timing
                timings.append((latencies[-1], t.tokenize_ms, t.queue_ms, t.inference_ms, t.total_ms))
        except grpc.RpcError as exc:
            latencies.append(float("inf"))
            if errors is not None:
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
        time.sleep(pace_s)
    return latencies


def _compared(idle: list[float], abused: list[float]) -> dict[str, float]:
    return {"idle_p50_ms": statistics.median(idle), "idle_p99_ms": pct(idle, 0.99),
            "abused_p50_ms": statistics.median(abused), "abused_p99_ms": pct(abused, 0.99),
            "p99_ratio": pct(abused, 0.99) / pct(idle, 0.99)}


def _reference(ctx, gateway, gateway_stub, specs: dict[str, dict], phase_s: float, pace_s: float) -> dict:
    """A no-op call (Info) on the gateway and on a bare grpc.aio server, idle and beside the abusers whose
    requests are all refused: how much of the slow-down gRPC's Python server causes by itself."""
    from tokq.v1 import embedder_pb2 as pb

    name = next(n for n, spec in specs.items() if not spec["truncate"] and len(spec["sizes"]) > 1)
    bare = harness.BareServer(refuse=True)
    try:
        with grpc.insecure_channel(bare.target, GRPC_LIMITS) as bare_channel:
            servers = {"tokq gateway": (gateway.target, gateway_stub, gateway.proc.pid),
                       "bare grpc.aio server": (bare.target, _stub(bare_channel), bare.proc.pid)}
            rows = {}
            for label, (target, stub, pid) in servers.items():
                def noop(seconds: float) -> list[float]:
                    return _probe(stub, seconds, pace_s, call=lambda: stub.Info(pb.InfoRequest(), timeout=30))
                noop(WARMUP_S / 3)
                idle = noop(phase_s)
                with _abusers(ctx, target, specs[name]) as (_, counts):
                    replies0 = sum(counts[:])
                    with harness.CpuWindow({"server": pid}) as cpu:
                        abused = noop(phase_s)
                    replies = sum(counts[:]) - replies0  # during the probe's window
                harness.settle(pid)
                rows[label] = {**_compared(idle, abused), "calls": len(abused), "abuser_replies": replies,
                               "server_cores": cpu.cores()["server"],
                               "cpu_ms_per_reply": 1000 * cpu.cpu_s["server"] / max(1, replies)}
    finally:
        bare.close()
    return {"scenario": name, "servers": rows}


def _drain(r, keys, timeout_s: float = 120) -> bool:
    """Until nothing is queued or in flight and the worker is idle; False if not within ``timeout_s``."""
    try:
        harness.wait_until(lambda: (not int(r.get(keys.tokens) or 0) and not int(r.get(keys.inflight) or 0)
                                    and r.scard(keys.idle) > 0), "an idle worker", timeout_s=timeout_s)
        return True
    except TimeoutError:
        return False


def run(rounds: int, phase_s: float, pace_s: float) -> dict:
    from tokq import config as cfg
    from tokq.gateway.validate import Limits
    from tokq.model.info import ModelInfo
    from tokq.queue.keys import QueueKeys

    info = ModelInfo.load()
    limits = Limits.resolve(info, cfg.load(cfg.GatewayConfig, env={}))
    results = {name: {"abused": [], "idle": [], "cpu_s": {}, "codes": {}, "probe_errors": {}, "idle_timings": [],
                      "abused_timings": []} for name in scenarios(limits)}
    ctx = multiprocessing.get_context("spawn")
    with harness.Stack() as stack:
        gateway = stack.gateway()
        stack.worker("bench")
        stack.wait()
        keys = QueueKeys(info.queue_name)
        with grpc.insecure_channel(gateway.target, GRPC_LIMITS) as channel:
            stub = _stub(channel)
            _probe(stub, WARMUP_S, pace_s)
            for rnd in range(rounds):
                for name, spec in scenarios(limits).items():
                    res = results[name]
                    res["idle"] += _probe(stub, phase_s, pace_s, res["probe_errors"], res["idle_timings"])
                    with _abusers(ctx, gateway.target, spec) as (abuser, counts):
                        pids = {**stack.pids(), "abusers": abuser.pid, "probe": os.getpid()}
                        with harness.CpuWindow(pids) as cpu:
                            res["abused"] += _probe(stub, phase_s, pace_s, res["probe_errors"], res["abused_timings"])
                        for k, cores in cpu.cores().items():
                            res["cpu_s"].setdefault(k, []).append(cores)
                    for i, code in enumerate(CODES + ["other"]):
                        res["codes"][code] = res["codes"].get(code, 0) + counts[i]
                    if not _drain(stack.client, keys):
                        print("warning: the worker was not idle 120 s after the abusers stopped", file=sys.stderr)
                    harness.settle(gateway.proc.pid)
                print(f"round {rnd + 1}/{rounds} done", file=sys.stderr)
            reference = _reference(ctx, gateway, stub, scenarios(limits), phase_s, pace_s)
    out = {"limits": limits.__dict__, "load_average": os.getloadavg(), "rounds": rounds, "phase_s": phase_s,
           "pace_s": pace_s, "scenarios": {}, "reference": reference,
           "idle_p99_ms_all": pct([v for res in results.values() for v in res["idle"]], 0.99)}
    for name, res in results.items():
        out["scenarios"][name] = {
            "calls": len(res["abused"]), "idle_calls": len(res["idle"]), **_compared(res["idle"], res["abused"]),
            # the tails behind each p99: latency, then the gateway's tokenize / queue / inference / total ms
            "idle_slowest_ms": sorted(res["idle_timings"])[-10:],
            "abused_slowest_ms": sorted(res["abused_timings"])[-10:],
            "cpu_cores": {k: statistics.median(v) for k, v in res["cpu_s"].items()},
            "abuser_replies": {k: v for k, v in res["codes"].items() if v}, "probe_errors": res["probe_errors"]}
    return out


def render(report: dict, command: str) -> str:
    lim, rows = report["limits"], []
    for name, s in report["scenarios"].items():
        cpu = s["cpu_cores"]
        rows.append([name, f"{s['calls']} ({sum(s['probe_errors'].values())})",
                     f"{s['idle_p50_ms']:.1f} / {s['idle_p99_ms']:.1f}", f"{s['abused_p50_ms']:.1f} / {s['abused_p99_ms']:.1f}",
                     f"**{s['p99_ratio']:.2f}x**", f"{s['abused_p99_ms'] / report['idle_p99_ms_all']:.2f}x",
                     ", ".join(f"{k} {v:,}" for k, v in s["abuser_replies"].items()),
                     " / ".join(f"{cpu[k]:.2f}" for k in ("gateway", "worker", "redis", "abusers", "probe"))])
    lines = ["", "## Hostile input: a one-input call beside six abusive callers", "", "Command:", "", f"    {command}", "",
             f"{machine_cores(capital=True)}, load average {', '.join(f'{x:.1f}' for x in report['load_average'])} at "
             "the end (this bench's own processes included; anything else running shows here too). One gateway, one "
             f"worker (1 torch thread), an embedded Redis; the probe sends `{PROBE_TEXT!r}` alone, then sleeps "
             f"{report['pace_s'] * 1000:.0f} ms; six abuser threads (one process) send back to back. {report['rounds']} "
             f"rounds x {report['phase_s']:.0f} s per phase; each scenario's idle figures are the idle phases just "
             "before its abused phases (each starts once the queue is empty, the worker has registered as idle and "
             "the gateway is quiet); the last ratio is against the p99 of all idle phases pooled "
             f"({report['idle_p99_ms_all']:.1f} ms). Caps (defaults from max_length 256): "
             f"{lim['max_input_bytes']:,} bytes per input, {lim['max_request_bytes']:,} per request.", "",
             *table("abusers send | probe calls (failed) | idle p50 / p99 ms | abused p50 / p99 ms | p99 ratio (target "
                    "<= 2) | p99 ratio, pooled idle | abusers' replies | CPU cores: gateway / worker / redis / abusers "
                    "/ probe", rows, "l" * 8), ""]
    if ref := report.get("reference"):
        servers, phase_s = ref["servers"], report["phase_s"]
        lines += [f"Reference, same run: a call with no model work (`Info`) on the gateway and on a bare grpc.aio "
                  "server (no tokq: it refuses every Embed as soon as gRPC has received it, unparsed, with the "
                  f"gateway's message limit), {phase_s:.0f} s idle, then {phase_s:.0f} s beside the abusers of "
                  f"\"{ref['scenario']}\":", "",
                  *table("server | idle p50 / p99 ms | abused p50 / p99 ms | p99 ratio | abusers' replies in the window "
                         "| server CPU cores", ([label, f"{r['idle_p50_ms']:.2f} / {r['idle_p99_ms']:.2f}",
                                                 f"{r['abused_p50_ms']:.2f} / {r['abused_p99_ms']:.2f}",
                                                 f"{r['p99_ratio']:.2f}x", f"{r['abuser_replies']:,}",
                                                 f"{r['server_cores']:.2f}"] for label, r in servers.items()), "l" * 6)]
        bare, ours = servers["bare grpc.aio server"], servers["tokq gateway"]
        lines += ["", f"Reading (generated from the figures above): six callers sending requests of this size back "
                  f"to back raise a no-op call's p99 {bare['p99_ratio']:.1f}x on a gRPC Python server that does "
                  f"nothing with them, {ours['p99_ratio']:.1f}x on the gateway; receiving them costs the bare server "
                  f"{bare['cpu_ms_per_reply']:.1f} ms of CPU each ({bare['server_cores']:.2f} cores), the gateway "
                  f"{ours['cpu_ms_per_reply']:.1f} ms (refusing them included; {ours['server_cores']:.2f} cores).", ""]
    return block(BLOCK, lines)


@click.command("hostile")
@click.option("--phase-s", default=15.0, show_default=True)
@click.option("--pace-ms", default=20.0, show_default=True)
@harness.bench_options("service.md", json_out=True)
def hostile_command(phase_s, pace_ms, rounds, json_path, results_md) -> None:
    """A one-input call's latency alone, then beside six callers sending the largest requests."""
    report = run(rounds, phase_s, pace_ms / 1000)
    harness.save_json(json_path, report)
    publish(render(report, command_line()), results_md, BLOCK)
