"""CPU time per single-input Embed call, per process, against a bare grpc.aio server measured in the
same run.

    tokq bench gateway-cpu [--calls 2000] [--rates 60,200] [--concurrency 64] [--rounds 3]
        [--profile-dir DIR] [--results-md profiling/results/gateway.md]

Starts an embedded Redis, one gateway (with a metrics port, as `tokq up` runs it), one worker
(`--threads 1`) and the harness's bare server (the same Embed RPC answering a fixed 384-float
vector, on the gateway's event loop and thread policy). For each load (each rate of ``--rates``:
open loop, Poisson arrivals; each level of ``--concurrency``: closed loop, that many calls in
flight) and each round, a load client (its own process) warms up, then sends ``--calls`` calls at
that load to the bare server, then to the gateway. Each process's CPU time is read from /proc
right before and after the measured calls. Per-call figures are medians over a load's rounds; the
gateway/bare ratio is taken within each round. With ``--profile-dir``, one more gateway run at the
last load is sampled by py-spy and its hottest frames are reported.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import click

from tokq.profiling import harness
from tokq.profiling.harness import median
from tokq.profiling.results_md import command_line, cpu_block_name, cpu_heading, cpu_label, markers, publish, table

BLOCK = "tokq bench gateway-cpu"
TARGET_MS_PER_CALL = 0.6
CLIENT_CONNECTIONS = 4  # the load client's, as tokq bench service's: calls come over several connections
WAKEUPS_OF = ("gateway", "echo server")  # the servers compared: their threads' wake-ups per call


# -- the load client (its own process) ---------------------------------------------------------

async def drive(target: str, rate: float | None, concurrency: int | None, calls: int, warmup_calls: int, seed: int,
                workload: str | None, connections: int) -> None:
    """Warm up, say "ready", wait for "go", send ``calls`` single-input calls (open loop at
    ``rate``, or closed loop with ``concurrency`` in flight), answer their summary, then wait for
    stdin to close (the parent reads this process's CPU time while it still exists)."""
    from tokq.profiling.bench import loadgen
    from tokq.profiling.bench.service.systems import GrpcSender

    queries, _ = loadgen.load_queries(workload, 4000, seed)
    sender = GrpcSender(target, timeout_s=10.0, connections=connections)
    schedule_rate = rate or 100.0  # closed loop: only the schedule's queries are used
    warm = loadgen.poisson_schedule(queries[::-1], schedule_rate, warmup_calls / schedule_rate, seed=seed + 1)
    arrivals = loadgen.poisson_schedule(queries, schedule_rate, 10 * calls / schedule_rate, seed=seed)[:calls]

    async def run(schedule):
        if concurrency:
            return await loadgen.run_closed_loop(sender, schedule, concurrency)
        return await loadgen.run_open_loop(sender, schedule)
    await run(warm)
    harness.reply("ready")
    await harness.read_line()
    samples = await run(arrivals)
    harness.reply(loadgen.summarize(samples, 0.0) if concurrency else loadgen.summarize(samples, rate, arrivals[-1].t_s))
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await sender.close()


def measure(target: str, pids: dict[str, int], *, load: dict, calls: int, warmup_calls: int, seed: int,
            workload: str | None, while_running=None, counters=None, connections: int = CLIENT_CONNECTIONS) -> dict:
    """One measured run of the load client against ``target``: CPU per process (``pids`` and the
    client) over exactly the measured calls, the client's summary, and how much each of
    ``counters()`` grew over the same calls. ``while_running()`` starts (a sampler) before the
    calls and is finished after them."""
    how = ["--concurrency", str(load["concurrency"])] if "concurrency" in load else ["--rate", str(load["rate"])]
    client = harness.Child(__name__, "load-client", "--target", target, *how, "--calls", str(calls),
                           "--warmup-calls", str(warmup_calls), "--seed", str(seed), "--connections", str(connections),
                           *(["--workload", workload] if workload else []))
    try:
        client.ready()
        extra = while_running() if while_running else None
        counted = counters() if counters else {}
        with harness.CpuWindow({**pids, "load client": client.pid}, wakeups=WAKEUPS_OF) as cpu:
            client.say("go")
            summary = client.answer()
        if counters:
            counted = {name: value - counted[name] for name, value in counters().items()}
        if extra is not None:
            extra.finish()
    finally:
        client.close()
    # Per call sent: a call that timed out cost the gateway too (only runs without errors are judged).
    n = max(summary["num_requests"], 1)
    return {"cpu_ms_per_call": cpu.ms_per(n, 4), "cpu_s": {k: round(v, 3) for k, v in cpu.cpu_s.items()},
            "wakeups_per_call": {k: round(v / n, 2) for k, v in cpu.wakeups.items()},
            "wall_s": round(cpu.wall_s, 2), "summary": summary, "counters": counted}


# -- py-spy ------------------------------------------------------------------------------------

class PySpy:
    """py-spy sampling a process (every thread, native frames too: gRPC's Cython core, hiredis,
    the Rust tokenizer) into collapsed stacks ("thread;frame;...;frame count" lines)."""

    def __init__(self, pid: int, out: Path, rate_hz: int = 250) -> None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.out = out
        out.unlink(missing_ok=True)
        # --native pauses the process while it reads a sample: latencies suffer, not CPU time.
        self.proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate_hz),
                                      "--threads", "--native", "--output", str(out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached before the calls start

    def finish(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        _, err = self.proc.communicate(timeout=60)
        if not self.out.is_file():
            raise RuntimeError(f"py-spy wrote no profile: {err.decode(errors='replace').strip()}")


_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
# With --native, py-spy cannot tell a thread blocked in the kernel from a busy one: samples
# inside these calls are waiting (idle pool threads, the idle event loop, a wait for the GIL).
_WAITS = ("pthread_cond_timedwait", "pthread_cond_wait", "PyThread_acquire_lock_timed", "epoll_wait",
          "epoll_pwait", "sem_wait", "sem_timedwait", "nanosleep", "clock_nanosleep", "poll (libc", "select (libc")


def _frame(frame: str) -> tuple[str, bool]:
    """A frame without its line number (native frames: their library), and whether it is Python."""
    m = _FRAME.match(frame)
    if not m:
        return frame, False
    if m["name"].startswith("0x"):
        return f"[{m['file']}]", False
    return f"{m['name']} ({m['file']})", m["file"].endswith(".py") or m["file"].startswith("<")


def top_frames(collapsed: str, n: int = 10) -> dict:
    """From py-spy's collapsed stacks, as shares of the busy samples: time per thread; by self
    time, the Python function running (with the native code it called) and the native frame on
    top; by total time, every Python function below the process's entry (those in 90% or more
    of the samples)."""
    threads, python_top, native_top, ours = Counter(), Counter(), Counter(), Counter()
    total = all_samples = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        c = int(count)
        all_samples += c
        if any(f.startswith(_WAITS) for f in frames):
            continue
        total += c
        threads[re.sub(r"^thread \(\d+\): ", "", thread).rstrip("0123456789_")] += c
        parsed = [_frame(f) for f in frames]
        python_top[next((f for f, py in reversed(parsed) if py), "(no Python frame)")] += c
        if parsed and not parsed[-1][1]:
            native_top[parsed[-1][0]] += c
        for f in {f for f, py in parsed if py}:
            ours[f] += c
    share = lambda counts: [(f, round(k / max(total, 1), 4)) for f, k in counts.most_common(n)]  # noqa: E731
    ours = Counter({f: k for f, k in ours.items() if k < 0.9 * total})
    return {"samples": all_samples, "busy_samples": total, "threads": share(threads), "python": share(python_top),
            "native": share(native_top), "total": share(ours)}


def gzip_file(path: Path) -> Path:
    """``path`` gzipped beside it (the original removed): collapsed stacks are megabytes of frames."""
    packed = path.with_name(path.name + ".gz")
    packed.write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()
    return packed


# -- the run -----------------------------------------------------------------------------------

def load_name(load: dict) -> str:
    return f"{load['concurrency']} in flight" if "concurrency" in load else f"{load['rate']:g} req/s"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_all(*, calls: int, rates: list[float], concurrency: list[int], rounds: int, warmup_calls: int, seed: int,
            workload: str | None, profile_dir: Path | None, connections: int = CLIENT_CONNECTIONS,
            token_budget: int = 0, console=None) -> dict:
    import tempfile

    log_path = Path(tempfile.mkdtemp(prefix="tokq-gateway-cpu-")) / "stack.log"
    report = {"meta": {"command": command_line(), "started_at": now(), "machine": harness.machine(),
                       "loadavg_at_start": harness.loadavg(), "log": str(log_path), "calls": calls, "rates": rates,
                       "concurrency": concurrency, "rounds": rounds, "workload": workload or "default",
                       "client_connections": connections, "token_budget": token_budget}, "loads": []}
    with harness.Stack(log_path) as stack:
        gateway = stack.gateway(metrics=True)
        stack.worker("cpu-bench", token_budget=token_budget)  # 0: its own, fitted to the latency goal
        echo = harness.BareServer(log=stack.log)
        try:
            stack.wait()

            def enqueues() -> dict[str, float]:  # the gateway's own count of enqueues and their round trips
                name, url = "tokq_gateway_enqueue_batch_requests", f"http://127.0.0.1:{gateway.metrics_ports[0]}/metrics"
                found = harness.metrics(url, f"{name}_count", f"{name}_sum")
                return {"round_trips": found[f"{name}_count"], "enqueues": found[f"{name}_sum"]}
            kw = dict(calls=calls, warmup_calls=warmup_calls, workload=workload, connections=connections)
            for spec in [{"rate": r} for r in rates] + [{"concurrency": c} for c in concurrency]:
                load = {**spec, "rounds": []}
                report["loads"].append(load)
                for r in range(rounds):
                    bare = measure(echo.target, {"echo server": echo.proc.pid}, load=spec, seed=seed + r, **kw)
                    tokq = measure(gateway.target, stack.pids(), load=spec, seed=seed + r, counters=enqueues, **kw)
                    ratio = tokq["cpu_ms_per_call"]["gateway"] / max(bare["cpu_ms_per_call"]["echo server"], 1e-9)
                    load["rounds"].append({"echo": bare, "tokq": tokq, "gateway_vs_echo": round(ratio, 2)})
                    ms = tokq["cpu_ms_per_call"]
                    click.echo(f"{load_name(spec)}, round {r + 1}: gateway {ms['gateway']:.3f} ms/call, echo "
                               f"{bare['cpu_ms_per_call']['echo server']:.3f} ({ratio:.2f}x); worker "
                               f"{ms['worker']:.3f}, redis {ms['redis']:.3f}, client {ms['load client']:.3f}; "
                               f"p99 {tokq['summary']['latency_ms']['p99']:.0f} ms", err=True)
            if profile_dir:
                profile_dir.mkdir(parents=True, exist_ok=True)
                out = profile_dir / "gateway-pyspy.txt"
                spec = {k: v for k, v in report["loads"][-1].items() if k != "rounds"}
                profiled = measure(gateway.target, stack.pids(), load=spec, seed=seed, **kw,
                                   while_running=lambda: PySpy(gateway.proc.pid, out))
                frames = top_frames(out.read_text())
                report["profile"] = {"path": str(gzip_file(out)), "load": load_name(spec),
                                     "gateway_cpu_ms_per_call": profiled["cpu_ms_per_call"]["gateway"], **frames}
        finally:
            echo.close()
    report["meta"].update(loadavg_at_end=harness.loadavg(), finished_at=now())
    return report


# -- the report --------------------------------------------------------------------------------

def medians(rounds: list[dict]) -> dict:
    """Median CPU ms per call of each process over a load's rounds, and of the within-round ratio."""
    out = {system: {n: round(median(rounds, system, "cpu_ms_per_call", n), 4)
                    for n in rounds[0][system]["cpu_ms_per_call"]} for system in ("echo", "tokq")}
    out["gateway_vs_echo"] = round(median(rounds, "gateway_vs_echo"), 2)
    return out


def enqueues_per_round_trip(rounds: list[dict]) -> str:
    """Enqueues / Redis round trips carrying them over a load's calls (above 1: calls shared one)."""
    trips = sum(r["tokq"]["counters"].get("round_trips", 0) for r in rounds)
    return f"{sum(r['tokq']['counters'].get('enqueues', 0) for r in rounds) / trips:.2f}" if trips else "-"


def verdict(rounds: list[dict]) -> str:
    """The target, judged on a load's median gateway CPU per call, only if no call failed."""
    if any(sum(r[s]["summary"]["errors"].values()) for r in rounds for s in ("tokq", "echo")):
        return "not judged: some calls failed"
    return "met" if medians(rounds)["tokq"]["gateway"] <= TARGET_MS_PER_CALL else "not met"


def markdown_section(report: dict, results_md: str | None = None) -> str:
    """The section; ``results_md``: the file it goes to, which links the py-spy stacks relative to it."""
    meta, loads, machine = report["meta"], report["loads"], report["meta"]["machine"]
    rates = [f"{load['rate']:g}" for load in loads if "rate" in load]
    levels = [str(load["concurrency"]) for load in loads if "concurrency" in load]
    how = " and ".join(filter(None, [f"open loop (Poisson) at each of {', '.join(rates)} req/s" if rates else "",
                                     f"closed loop with each of {', '.join(levels)} calls in flight" if levels else ""]))
    n = meta["client_connections"]
    budget = (f"the worker's budget {meta['token_budget']:,} tokens" if meta["token_budget"]
              else "the worker's budget its own (fitted to the latency goal, as under `tokq up`)")
    start, end = markers(cpu_block_name(BLOCK, machine), BLOCK)
    lines = [start, cpu_heading("Gateway CPU per call", machine), "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['started_at']} to {meta['finished_at']}  ",
             f"Machine: {cpu_label(machine)}, {machine['num_cpus']} CPUs, {machine['platform']}; "
             f"**shared with other people's builds and tests**: load average {' '.join(meta['loadavg_at_start'])} "
             f"at start, {' '.join(meta['loadavg_at_end'])} at end, so figures are noisy.  ",
             f"Load: {meta['calls']} single-input Embed calls per run, {how} from a separate client process over "
             f"{n} connection{'s' if n != 1 else ''}; {budget}, after a warm-up; {meta['rounds']} rounds per load, "
             "each measuring the bare echo server, then tokq (gateway + worker `--threads 1` + Redis), at the same "
             "load. The gateway serves metrics (`--metrics-port`, on as `tokq up` runs it; read for the enqueues "
             "per round trip), so its queue-stats export every 2 s is counted too. CPU = utime + stime of every "
             "thread of each process (/proc/<pid>/stat) over the measured calls only; wake-ups = context switches "
             "of all the server's threads (/proc/<pid>/task/*/status) over the same calls; medians over a load's "
             "rounds. Calls/s per gateway core = 1000 / gateway ms per call: the calls one core of gateway would "
             "serve at this cost a call; the cores busy show how far the gateway was from saturated (on a "
             "small CPU host the worker's forward is the limit, not the gateway).", ""]
    rows = []
    for load in loads:
        rounds, med = load["rounds"], medians(load["rounds"])
        wake = (f"{median(rounds, 'tokq', 'wakeups_per_call', 'gateway'):.1f} / "
                f"{median(rounds, 'echo', 'wakeups_per_call', 'echo server'):.1f}")
        errors = ", ".join(f"{sum(r['tokq']['summary']['errors'].values())}/{sum(r['echo']['summary']['errors'].values())}"
                           for r in rounds)
        cores = median([r["tokq"]["cpu_s"]["gateway"] / r["tokq"]["wall_s"] for r in rounds])
        rows.append([load_name(load), f"{med['tokq']['gateway']:.3f}", f"{med['echo']['echo server']:.3f}",
                     f"{1000 / med['tokq']['gateway']:,.0f} ({cores:.2f})",
                     f"**{med['gateway_vs_echo']:.2f}x** ({', '.join(str(r['gateway_vs_echo']) for r in rounds)})",
                     f"**{verdict(rounds)}**", wake, enqueues_per_round_trip(rounds),
                     ", ".join(f"{r['tokq']['summary']['latency_ms']['p99']:.0f}" for r in rounds), errors])
    lines += table(f"load | gateway ms/call | bare grpc.aio server ms/call | calls/s per gateway core (gateway cores busy) "
                   f"| gateway / bare (within rounds) | target "
                   f"<= {TARGET_MS_PER_CALL} ms | thread wake-ups per call, gateway / bare | enqueues per Redis round "
                   "trip | tokq p99 ms per round | failed calls per round (tokq, echo)", rows, "rrrrrlrrll")
    lines += ["", "Every process, CPU ms per call (median over the rounds; per round):", ""]
    lines += table("load | process | median | per round", (
        [load_name(load), f"{name} ({system} run)", f"{value:.3f}",
         ", ".join(f"{r[system]['cpu_ms_per_call'][name]:.3f}" for r in load["rounds"])]
        for load in loads for system in ("tokq", "echo") for name, value in medians(load["rounds"])[system].items()),
        "rlrl")
    lines.append("")
    if prof := report.get("profile"):
        stacks = (f"[{Path(prof['path']).name}]({os.path.relpath(prof['path'], Path(results_md).parent)})"
                  if results_md else f"`{prof['path']}`")
        lines += [f"### Where the gateway's CPU goes (py-spy --native, {prof['busy_samples']} busy of "
                  f"{prof['samples']} samples of one more run at {prof['load']}; "
                  f"gateway {prof['gateway_cpu_ms_per_call']:.3f} ms/call while sampled)", "",
                  f"Collapsed stacks: {stacks}. Shares are of the busy samples (those not blocked in a wait).", ""]
        for key, title in (("threads", "thread"), ("python", "self: Python function running (with the native code it called)"),
                           ("native", "self: native frame on top"), ("total", "total: Python function, inclusive")):
            lines += table(f"{title} | share", ([f"`{frame}`", f"{value:.1%}"] for frame, value in prof.get(key, ()))) + [""]
    lines.append(end)
    return "\n".join(lines) + "\n"


def parse_levels(value: str, option: str, kind=float) -> list:
    """A comma-separated option (``--rates 60,200``); "" or "0" = none."""
    try:
        levels = [kind(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: give numbers, comma-separated (60,200)", param_hint=f"'{option}'") from None
    if levels == [0]:
        return []
    if any(v <= 0 for v in levels):
        raise click.BadParameter(f"{value!r}: every level must be positive", param_hint=f"'{option}'")
    return levels


@click.command("gateway-cpu")
@click.option("--calls", default=2000, show_default=True, help="Measured single-input calls per run.")
@click.option("--rates", default="60,200", show_default=True,
              help="Offered loads in req/s (open loop), comma-separated, 0 = none; each measured on its own. The "
                   "highest should stay within what one worker thread keeps up with on a busy 2-core machine.")
@click.option("--concurrency", default="64", show_default=True,
              help="Closed-loop loads: calls in flight, comma-separated, 0 = none; each measured on its own.")
@click.option("--rounds", default=3, show_default=True)
@click.option("--warmup-calls", default=300, show_default=True)
@click.option("--seed", default=1, show_default=True)
@click.option("--workload", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSONL workload [default: as `tokq bench service`].")
@click.option("--profile-dir", type=click.Path(file_okay=False), default=None,
              help="Also sample the gateway with py-spy in one more run; collapsed stacks go here.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--results-md", type=click.Path(dir_okay=False), default=None,
              help="Rewrite this file's 'Gateway CPU per call' section (profiling/results/gateway.md).")
@click.option("--from-json", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Render this earlier --json report instead of measuring.")
@click.option("--client-connections", default=CLIENT_CONNECTIONS, show_default=True, type=click.IntRange(1, 64),
              help="Connections the load client spreads its calls over (tokq.AsyncClient).")
@click.option("--token-budget", default=0, show_default=True, type=click.IntRange(0),
              help="The worker's token budget; 0 = its own, fitted to the latency goal as under `tokq up`.")
def gateway_cpu_command(calls, rates, concurrency, rounds, warmup_calls, seed, workload, profile_dir, json_path,
                        results_md, from_json, client_connections, token_budget) -> None:
    """Gateway CPU per single-input call (gateway, worker, Redis, load client) against a bare gRPC server."""
    rates = parse_levels(rates, "--rates")
    concurrency = parse_levels(concurrency, "--concurrency", int)
    if not rates and not concurrency:
        raise click.UsageError("nothing to measure: give --rates or --concurrency")
    if from_json:
        report = json.loads(Path(from_json).read_text())
    else:
        report = run_all(calls=calls, rates=rates, concurrency=concurrency, rounds=rounds, warmup_calls=warmup_calls,
                         seed=seed, connections=client_connections, token_budget=token_budget, workload=workload,
                         profile_dir=Path(profile_dir) if profile_dir else None)
        for load in report["loads"]:
            load["medians"] = medians(load["rounds"])
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    publish(markdown_section(report, results_md), results_md, cpu_block_name(BLOCK, report["meta"]["machine"]))


@click.group()
def main() -> None:
    """The load client `tokq bench gateway-cpu` starts."""


@main.command("load-client")
@click.option("--target", required=True)
@click.option("--rate", type=float, default=None)
@click.option("--concurrency", type=int, default=None)
@click.option("--calls", type=int, required=True)
@click.option("--warmup-calls", type=int, default=300)
@click.option("--seed", type=int, default=1)
@click.option("--workload", default=None)
@click.option("--connections", type=int, default=CLIENT_CONNECTIONS)
def client_command(target, rate, concurrency, calls, warmup_calls, seed, workload, connections) -> None:
    if (rate is None) == (concurrency is None):
        raise click.UsageError("give --rate or --concurrency")
    asyncio.run(drive(target, rate, concurrency, calls, warmup_calls, seed, workload, connections))


if __name__ == "__main__":
    main()
