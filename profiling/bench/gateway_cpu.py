"""CPU time per single-input Embed call, per process, against a bare grpc.aio server measured
in the same run.

    tokq bench gateway-cpu [--calls 2000] [--rates 60,200] [--concurrency 64] [--rounds 3]
        [--profile-dir DIR] [--results-md profiling/results/gateway.md]

Starts, as separate processes: an embedded Redis, one gateway and one worker (`tokq gateway`,
`tokq worker --threads 1`, their defaults otherwise; the gateway with a metrics port, as `tokq up`
runs it), and a bare grpc.aio server (`echo-server` below: the same Embed RPC answering a fixed
384-float vector, no work; on the gateway's default event loop, its helper threads yielding
to the loop's thread as the gateway's do: gateway/event_loop.py, gateway/helper_threads.py). For each load (each
rate of ``--rates``: open loop, Poisson arrivals; each level of ``--concurrency``: closed loop,
that many calls in flight, as fast as the system answers) and each round, a load client (its own
process, `load-client`) warms up, then sends ``--calls`` single-input Embed calls at that load to
the echo server, then to the gateway. Each process's CPU time (utime + stime of all its threads, from /proc/<pid>/stat) is
read right before and after the measured calls, so start-up and warm-up are not counted.
Per-call figures are medians over a load's rounds; the gateway/echo ratio is taken within each
round. The CPU a call costs depends on the load: at a low rate every call wakes the event loop
and gRPC's poller on its own, at a higher one calls share wake-ups (and the gateway's Redis
round trips, see tokq.queue.sharded), so each load is judged on its own.

With ``--profile-dir``, one more gateway run at the last load is sampled by py-spy (its own
process, outside the gateway) and the hottest frames are printed and written to the report.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import click

from tokq.host import cpu_name, vector_extension
from tokq.profiling.bench.proc_cpu import proc_cpu_s, proc_wakeups
from tokq.profiling.results_md import command_line, cpu_block_name, cpu_heading, cpu_label, markers, write_block

BLOCK = "tokq bench gateway-cpu"
SECTION_START, SECTION_END = markers(BLOCK)  # a run that did not record its CPU's vector extension
TARGET_MS_PER_CALL = 0.6
HIDDEN_SIZE = 384  # all-MiniLM-L6-v2's vector: what the echo server answers too
START_TIMEOUT_S = 180
CLIENT_CONNECTIONS = 4  # the load client's, as tokq bench service's: calls come over several connections
WAKEUPS_OF = ("gateway", "echo server")  # the servers compared: their threads' wake-ups per call


# -- reading CPU time ----------------------------------------------------------------------------

def loadavg() -> list[str]:
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return []


# -- the bare server -----------------------------------------------------------------------------

async def serve_echo(port: int) -> None:
    """tokq.v1.Embedder answering every Embed with the same unit vector: the cost of a Python
    gRPC call carrying this response, and nothing else."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from tokq.gateway.helper_threads import yield_to_loop_thread
    from tokq.v1 import embedder_pb2 as pb
    from tokq.v1 import embedder_pb2_grpc as pb_grpc

    vector = [1.0 / HIDDEN_SIZE ** 0.5] * HIDDEN_SIZE

    class Echo(pb_grpc.EmbedderServicer):
        async def Embed(self, request, context):
            return pb.EmbedResponse(embeddings=[pb.Embedding(values=vector) for _ in request.inputs],
                                    model="echo")

    server = grpc.aio.server()
    pb_grpc.add_EmbedderServicer_to_server(Echo(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"127.0.0.1:{port}") == 0:
        raise OSError(f"could not bind port {port}")
    await server.start()
    yield_to_loop_thread()  # the gateway's thread policy: the two differ only in their work
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


# -- the load client -----------------------------------------------------------------------------

async def run_closed_loop(send, arrivals, concurrency: int) -> list:
    """Send ``arrivals`` (their times ignored) with ``concurrency`` calls in flight, each lane
    sending its next call when its last one is answered; the samples, as run_open_loop's."""
    from tokq.profiling.bench import loadgen

    loop = asyncio.get_running_loop()
    start = loop.time()
    pending = iter(arrivals)
    samples = []

    async def lane() -> None:
        for arrival in pending:
            sent = loop.time() - start
            try:
                reply = await send(arrival.texts)
            except Exception as exc:  # a sender bug must show as an error, not kill the run
                reply = loadgen.Reply(f"CLIENT_{type(exc).__name__}")
            samples.append(loadgen.Sample(sent, sent, loop.time() - start, reply.status, arrival.num_tokens,
                                          reply.queue_ms, reply.inference_ms))
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return samples


async def drive(target: str, rate: float | None, concurrency: int | None, calls: int, warmup_calls: int, seed: int,
                workload: str | None, connections: int = CLIENT_CONNECTIONS) -> None:
    """Warm up, say "ready", wait for "go" on stdin, send ``calls`` single-input calls (open loop
    at ``rate``, or closed loop with ``concurrency`` in flight), print their summary as one JSON
    line, then wait for stdin to close (so the parent can read this process's CPU time while it
    still exists)."""
    from tokq.profiling.bench import loadgen
    from tokq.profiling.bench.service.systems import GrpcSender

    queries, _ = loadgen.load_queries(workload, 4000, seed)
    sender = GrpcSender(target, timeout_s=10.0, connections=connections)
    loop = asyncio.get_running_loop()
    schedule_rate = rate or 100.0  # closed loop: only the schedule's queries are used
    warm = loadgen.poisson_schedule(queries[::-1], schedule_rate, warmup_calls / schedule_rate, seed=seed + 1)
    arrivals = loadgen.poisson_schedule(queries, schedule_rate, 10 * calls / schedule_rate, seed=seed)[:calls]
    if concurrency:
        await run_closed_loop(sender, warm, concurrency)
    else:
        await loadgen.run_open_loop(sender, warm)
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    if concurrency:
        samples = await run_closed_loop(sender, arrivals, concurrency)
        summary = loadgen.summarize(samples, 0.0)
    else:
        samples = await loadgen.run_open_loop(sender, arrivals)
        summary = loadgen.summarize(samples, rate, arrivals[-1].t_s)
    print(json.dumps(summary), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)
    await sender.close()


# -- orchestration -------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def _this(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tokq.profiling.bench.gateway_cpu", *args], env=_env(), **kw)


def _tokq(*args: str, redis_url: str, log) -> subprocess.Popen:
    env = {**_env(), "TOKQ_REDIS_URL": redis_url}  # in the environment: the URL holds the password
    return subprocess.Popen([sys.executable, "-m", "tokq.cli", *args], env=env, stdout=log, stderr=log)


class Stack:
    """Redis + gateway + worker, and the bare echo server beside them."""

    def __init__(self, log_path: Path, token_budget: int = 0) -> None:
        import redis

        from tokq.processes import wait_for_health
        from tokq.profiling.bench.workers import start_worker, wait_heartbeats
        from tokq.redis.embedded import EmbeddedRedis, free_port

        self.log = open(log_path, "ab")
        self.redis = EmbeddedRedis().start()
        client = redis.Redis.from_url(self.redis.url)
        self.redis_pid = int(client.info("server")["process_id"])
        self.gateway_target = f"127.0.0.1:{free_port()}"
        self.echo_target = f"127.0.0.1:{free_port()}"
        self.metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
        self.gateway = _tokq("gateway", "--host", "127.0.0.1", "--port", self.gateway_target.rsplit(":", 1)[1],
                             "--metrics-port", self.metrics_url.rsplit(":", 1)[1].split("/")[0],
                             redis_url=self.redis.url, log=self.log)
        # 0: the worker's own budget, fitted to the latency goal as under `tokq up`
        self.worker = start_worker(self.redis.url, "cpu-bench", token_budget=token_budget, env=_env(), log=self.log)
        self.echo = _this("echo-server", "--port", self.echo_target.rsplit(":", 1)[1],
                          stdout=self.log, stderr=self.log)
        try:
            wait_for_health(self.echo_target, [self.echo], START_TIMEOUT_S)
            wait_for_health(self.gateway_target, [self.gateway], START_TIMEOUT_S)
            wait_heartbeats(client, {"cpu-bench": self.worker}, START_TIMEOUT_S)  # the worker has warmed up
        except BaseException:
            self.close()
            raise
        finally:
            client.close()

    def enqueue_round_trips(self) -> dict[str, float]:
        """The gateway's own count of enqueues and of the Redis round trips that carried them."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        found = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                 if s.name.startswith("tokq_gateway_enqueue_batch_requests")}
        return {"round_trips": found.get("tokq_gateway_enqueue_batch_requests_count", 0.0),
                "enqueues": found.get("tokq_gateway_enqueue_batch_requests_sum", 0.0)}

    def close(self) -> None:
        from tokq.processes import stop_all

        stop_all([self.gateway, self.worker, self.echo])
        self.redis.close()
        self.log.close()


def measure(target: str, pids: dict[str, int], *, load: dict, calls: int, warmup_calls: int, seed: int,
            workload: str | None, while_running=None, counters=None, connections: int = CLIENT_CONNECTIONS) -> dict:
    """One measured run of the load client against ``target``: CPU-seconds per process
    (``pids`` and the client itself) over exactly the measured calls, the client's summary, and
    how much each of ``counters()`` (name -> number) grew over the same calls."""
    how = ["--concurrency", str(load["concurrency"])] if "concurrency" in load else ["--rate", str(load["rate"])]
    client = _this("load-client", "--target", target, *how, "--calls", str(calls),
                   "--warmup-calls", str(warmup_calls), "--seed", str(seed), "--connections", str(connections),
                   *(["--workload", workload] if workload else []),
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if client.stdout.readline().strip() != "ready":
            raise RuntimeError("the load client failed during warm-up")
        pids = {**pids, "load client": client.pid}
        counted = counters() if counters else {}
        before = {name: proc_cpu_s(pid) for name, pid in pids.items()}
        woken = {name: proc_wakeups(pids[name]) for name in WAKEUPS_OF if name in pids}
        started = time.perf_counter()
        client.stdin.write("go\n")
        client.stdin.flush()
        extra = while_running() if while_running else None
        line = client.stdout.readline()
        wall_s = time.perf_counter() - started
        after = {name: proc_cpu_s(pid) for name, pid in pids.items()}
        woken = {name: proc_wakeups(pids[name]) - count for name, count in woken.items()}
        if counters:
            counted = {name: value - counted[name] for name, value in counters().items()}
        if extra is not None:
            extra.finish()
        summary = json.loads(line)
    finally:
        client.stdin.close()
        client.wait(timeout=60)
    # Per call sent: a call that timed out cost the gateway too (the report shows the errors;
    # the target is judged only on runs without them).
    n = max(summary["num_requests"], 1)
    return {"cpu_ms_per_call": {name: round(1000 * (after[name] - before[name]) / n, 4) for name in pids},
            "cpu_s": {name: round(after[name] - before[name], 3) for name in pids},
            "wakeups_per_call": {name: round(count / n, 2) for name, count in woken.items()},
            "wall_s": round(wall_s, 2), "summary": summary, "counters": counted}


class PySpy:
    """py-spy sampling a process (every thread, native frames too: gRPC's Cython core, hiredis,
    the Rust tokenizer) into collapsed stacks ("thread;frame;...;frame count" lines)."""

    def __init__(self, pid: int, out: Path, rate_hz: int = 250) -> None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.out = out
        out.unlink(missing_ok=True)
        # --native needs the process paused while a sample is read (no --nonblocking): the
        # profiled run's latencies suffer, not its CPU time.
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


def _frame(frame: str) -> tuple[str, bool]:
    """A frame without its line number (native frames: their library), and whether it is Python."""
    m = _FRAME.match(frame)
    if not m:
        return frame, False
    name, file = m["name"], m["file"]
    python = file.endswith(".py") or file.startswith("<")
    if name.startswith("0x"):
        return f"[{file}]", False
    return f"{name} ({file})", python


# With --native, py-spy cannot tell a thread blocked in the kernel from a busy one: samples
# inside these calls are waiting (idle pool threads, the idle event loop, a wait for the GIL).
_WAITS = ("pthread_cond_timedwait", "pthread_cond_wait", "PyThread_acquire_lock_timed", "epoll_wait",
          "epoll_pwait", "sem_wait", "sem_timedwait", "nanosleep", "clock_nanosleep", "poll (libc", "select (libc")


def top_frames(collapsed: str, n: int = 12) -> dict:
    """From py-spy's collapsed stacks, as shares of the busy samples (not waiting, see _WAITS):
    time per thread; the Python function running (the innermost Python frame, with the native
    code it called); the native frame on top; and the project's own functions, inclusive."""
    threads: Counter[str] = Counter()
    python_top: Counter[str] = Counter()
    native_top: Counter[str] = Counter()
    ours: Counter[str] = Counter()
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
        innermost_python = next((f for f, py in reversed(parsed) if py), "(no Python frame)")
        python_top[innermost_python] += c
        if parsed and not parsed[-1][1]:
            native_top[parsed[-1][0]] += c
        for f in {f for f, py in parsed if py and f.split("(")[-1].startswith(("gateway/", "tokq/", "workers/", "profiling/"))}:
            ours[f] += c
    share = lambda counts: [(f, round(k / max(total, 1), 4)) for f, k in counts.most_common(n)]
    return {"samples": all_samples, "busy_samples": total, "threads": share(threads), "python": share(python_top),
            "native": share(native_top), "ours": share(ours)}


def machine() -> dict:
    return {"cpu": cpu_name(), "vector_extension": vector_extension(), "num_cpus": os.cpu_count(),
            "platform": platform.platform()}


def load_name(load: dict) -> str:
    return f"{load['concurrency']} in flight" if "concurrency" in load else f"{load['rate']:g} req/s"


def run_all(*, calls: int, rates: list[float], concurrency: list[int], rounds: int, warmup_calls: int, seed: int,
            connections: int = CLIENT_CONNECTIONS, token_budget: int = 0,
            workload: str | None, profile_dir: Path | None, console) -> dict:
    import tempfile

    log_path = Path(tempfile.mkdtemp(prefix="tokq-gateway-cpu-")) / "stack.log"
    report = {"meta": {"command": command_line(),
                       "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "machine": machine(), "loadavg_at_start": loadavg(), "log": str(log_path),
                       "calls": calls, "rates": rates, "concurrency": concurrency, "rounds": rounds,
                       "workload": workload or "default", "client_connections": connections,
                       "token_budget": token_budget},
              "loads": []}
    stack = Stack(log_path, token_budget)
    try:
        tokq_pids = {"gateway": stack.gateway.pid, "worker": stack.worker.pid, "redis": stack.redis_pid}
        for spec in [{"rate": r} for r in rates] + [{"concurrency": c} for c in concurrency]:
            kw = dict(load=spec, calls=calls, warmup_calls=warmup_calls, workload=workload, connections=connections)
            load = {**spec, "rounds": []}
            report["loads"].append(load)
            for r in range(rounds):
                echo = measure(stack.echo_target, {"echo server": stack.echo.pid}, seed=seed + r, **kw)
                tokq = measure(stack.gateway_target, tokq_pids, seed=seed + r, counters=stack.enqueue_round_trips, **kw)
                ratio = tokq["cpu_ms_per_call"]["gateway"] / max(echo["cpu_ms_per_call"]["echo server"], 1e-9)
                load["rounds"].append({"echo": echo, "tokq": tokq, "gateway_vs_echo": round(ratio, 2)})
                console.print(f"{load_name(spec)}, round {r + 1}: gateway {tokq['cpu_ms_per_call']['gateway']:.3f} ms/call, "
                              f"echo {echo['cpu_ms_per_call']['echo server']:.3f} ms/call ({ratio:.2f}x); "
                              f"worker {tokq['cpu_ms_per_call']['worker']:.3f}, redis {tokq['cpu_ms_per_call']['redis']:.3f}, "
                              f"client {tokq['cpu_ms_per_call']['load client']:.3f}; "
                              f"p99 {tokq['summary']['latency_ms']['p99']:.0f} ms")
        if profile_dir:
            profile_dir.mkdir(parents=True, exist_ok=True)
            out = profile_dir / "gateway-pyspy.txt"
            spec = {k: v for k, v in report["loads"][-1].items() if k != "rounds"}
            profiled = measure(stack.gateway_target, tokq_pids, seed=seed, load=spec, calls=calls,
                               warmup_calls=warmup_calls, workload=workload, connections=connections,
                               while_running=lambda: PySpy(stack.gateway.pid, out))
            frames = top_frames(out.read_text())
            report["profile"] = {"path": str(gzip_file(out)), "load": load_name(spec),
                                 "gateway_cpu_ms_per_call": profiled["cpu_ms_per_call"]["gateway"],
                                 **frames}
    finally:
        stack.close()
    report["meta"]["loadavg_at_end"] = loadavg()
    report["meta"]["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return report


def gzip_file(path: Path) -> Path:
    """``path`` gzipped beside it (the original removed): collapsed stacks of a long run are
    megabytes of repeated frame names, kept in the repository for anyone to re-read."""
    packed = path.with_name(path.name + ".gz")
    packed.write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()
    return packed


def loads(report: dict) -> list[dict]:
    """The report's loads; a report from before ``--rates`` (one rate, its rounds at the top) as one."""
    if "loads" in report:
        return report["loads"]
    return [{"rate": report["meta"]["rate"], "rounds": report["rounds"]}]


def medians(rounds: list[dict]) -> dict:
    """Median CPU ms per call of each process over one load's rounds, and of the within-round ratio."""
    out = {}
    for system in ("echo", "tokq"):
        names = rounds[0][system]["cpu_ms_per_call"]
        out[system] = {n: round(statistics.median(r[system]["cpu_ms_per_call"][n] for r in rounds), 4)
                       for n in names}
    out["gateway_vs_echo"] = round(statistics.median(r["gateway_vs_echo"] for r in rounds), 2)
    return out


def enqueues_per_round_trip(rounds: list[dict]) -> str:
    """Over a load's measured calls: enqueues / Redis round trips carrying them (tokq.redis.pipeline:
    above 1 where concurrent calls shared one); "-" for reports from before it was counted."""
    counted = [r["tokq"].get("counters") or {} for r in rounds]
    trips = sum(c.get("round_trips", 0) for c in counted)
    return f"{sum(c.get('enqueues', 0) for c in counted) / trips:.2f}" if trips else "-"


def wakeups(rounds: list[dict]) -> str:
    """Median context switches per call of the gateway's threads and of the bare server's (see
    proc_cpu.proc_wakeups), "8.9 / 5.7"; "-" for reports from before they were counted."""
    if not all("wakeups_per_call" in r["tokq"] and "wakeups_per_call" in r["echo"] for r in rounds):
        return "-"
    gateway = statistics.median(r["tokq"]["wakeups_per_call"]["gateway"] for r in rounds)
    bare = statistics.median(r["echo"]["wakeups_per_call"]["echo server"] for r in rounds)
    return f"{gateway:.1f} / {bare:.1f}"


def verdict(rounds: list[dict]) -> str:
    """The target, judged on one load's median gateway CPU per call, only if no call failed."""
    if any(sum(r[s]["summary"]["errors"].values()) for r in rounds for s in ("tokq", "echo")):
        return "not judged: some calls failed"
    return "met" if medians(rounds)["tokq"]["gateway"] <= TARGET_MS_PER_CALL else "not met"


def _client_and_budget(meta: dict) -> str:
    """", over 4 connections; the worker's budget fitted as under `tokq up`": how the run was set
    up, where it recorded it (runs before these settings existed say nothing)."""
    if "client_connections" not in meta:
        return ""
    n = meta["client_connections"]
    budget = (f"the worker's budget {meta['token_budget']:,} tokens" if meta.get("token_budget")
              else "the worker's budget its own (fitted to the latency goal, as under `tokq up`)")
    return f" over {n} connection{'s' if n != 1 else ''}; {budget}"


def markdown_section(report: dict) -> str:
    meta = report["meta"]
    per_load = loads(report)
    rates = [f"{load['rate']:g}" for load in per_load if "rate" in load]
    levels = [str(load["concurrency"]) for load in per_load if "concurrency" in load]
    how = " and ".join(filter(None, [
        f"open loop (Poisson) at each of {', '.join(rates)} req/s" if rates else "",
        f"closed loop with each of {', '.join(levels)} calls in flight" if levels else ""]))
    machine = meta["machine"]
    start, end = markers(cpu_block_name(BLOCK, machine), BLOCK)
    lines = [start, cpu_heading("Gateway CPU per call", machine), "",
             f"Command: `{meta['command']}`  ",
             f"Date: {meta['started_at']} to {meta['finished_at']}  ",
             f"Machine: {cpu_label(machine)}, {machine['num_cpus']} CPUs, {machine['platform']}; "
             f"**shared with other people's builds and tests**: load average {' '.join(meta['loadavg_at_start'])} "
             f"at start, {' '.join(meta['loadavg_at_end'])} at end, so figures are noisy.  ",
             f"Load: {meta['calls']} single-input Embed calls per run, {how} "
             f"from a separate client process{_client_and_budget(meta)}, after a warm-up; {meta['rounds']} rounds per "
             "load, each measuring the bare echo server, then tokq (gateway + worker `--threads 1` + Redis), at the "
             "same load. The gateway "
             "serves metrics (`--metrics-port`, on as `tokq up` runs it; read for the enqueues per round trip), so its "
             "queue-stats export every 2 s is counted too. CPU = utime + "
             "stime of every thread of each process (/proc/<pid>/stat) over the measured calls only; wake-ups = "
             "context switches of all the server's threads (/proc/<pid>/task/*/status) over the same calls; medians "
             "over a load's rounds.", "",
             f"| load | gateway ms/call | bare grpc.aio server ms/call | gateway / bare (within rounds) "
             f"| target <= {TARGET_MS_PER_CALL} ms | thread wake-ups per call, gateway / bare "
             "| enqueues per Redis round trip | tokq p99 ms per round | failed calls per round (tokq, echo) |",
             "|---:|---:|---:|---:|---|---:|---:|---|---|"]
    for load in per_load:
        rounds, med = load["rounds"], medians(load["rounds"])
        p99 = ", ".join(f"{r['tokq']['summary']['latency_ms']['p99']:.0f}" for r in rounds)
        errors = ", ".join(f"{sum(r['tokq']['summary']['errors'].values())}/{sum(r['echo']['summary']['errors'].values())}"
                           for r in rounds)
        lines.append(f"| {load_name(load)} | {med['tokq']['gateway']:.3f} | {med['echo']['echo server']:.3f} "
                     f"| **{med['gateway_vs_echo']:.2f}x** ({', '.join(str(r['gateway_vs_echo']) for r in rounds)}) "
                     f"| **{verdict(rounds)}** | {wakeups(rounds)} | {enqueues_per_round_trip(rounds)} | {p99} "
                     f"| {errors} |")
    lines += ["", "Every process, CPU ms per call (median over the rounds; per round):", "",
              "| load | process | median | per round |", "|---:|---|---:|---|"]
    for load in per_load:
        rounds, med = load["rounds"], medians(load["rounds"])
        for system in ("tokq", "echo"):
            for name, value in med[system].items():
                per_round = ", ".join(f"{r[system]['cpu_ms_per_call'][name]:.3f}" for r in rounds)
                lines.append(f"| {load_name(load)} | {name} ({'tokq run' if system == 'tokq' else 'echo run'}) "
                             f"| {value:.3f} | {per_round} |")
    lines.append("")
    prof = report.get("profile")
    if prof:
        at = f" at {prof['load']}" if "load" in prof else ""
        lines += [f"### Where the gateway's CPU goes (py-spy --native, {prof['busy_samples']} busy of "
                  f"{prof['samples']} samples of one more run{at}; "
                  f"gateway {prof['gateway_cpu_ms_per_call']:.3f} ms/call while sampled)", "",
                  f"Collapsed stacks: `{prof['path']}`. Shares are of the busy samples (those not blocked in a wait).", ""]
        for key, title in (("threads", "thread"), ("python", "Python function running (with the native code it called)"),
                           ("native", "native frame on top"), ("ours", "tokq function, inclusive")):
            lines += [f"| {title} | share |", "|---|---:|"]
            lines += [f"| `{frame}` | {value:.1%} |" for frame, value in prof[key]] + [""]
    lines.append(end)
    return "\n".join(lines) + "\n"


def parse_levels(value: str, option: str, kind=float) -> list:
    """A comma-separated option (``--rates 60,200``), kept a string for the command line the
    report shows; "" or "0" = none."""
    try:
        levels = [kind(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: give numbers, comma-separated (60,200)", param_hint=f"'{option}'") from None
    if levels == [0]:
        return []
    if any(v <= 0 for v in levels):
        raise click.BadParameter(f"{value!r}: every level must be positive", param_hint=f"'{option}'")
    return levels


# -- command line --------------------------------------------------------------------------------

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
              help="Rewrite the 'Gateway CPU per call' block of this markdown file.")
@click.option("--from-json", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Render this earlier --json report instead of measuring.")
@click.option("--client-connections", default=CLIENT_CONNECTIONS, show_default=True, type=click.IntRange(1, 64),
              help="Connections the load client spreads its calls over (tokq.AsyncClient).")
@click.option("--token-budget", default=0, show_default=True, type=click.IntRange(0),
              help="The worker's token budget; 0 = its own, fitted to the latency goal as under `tokq up`.")
def gateway_cpu_command(calls, rates, concurrency, rounds, warmup_calls, seed, workload, profile_dir, json_path, results_md,
                        from_json, client_connections, token_budget) -> None:
    """Gateway CPU per single-input call (gateway, worker, Redis, load client) against a bare gRPC server."""
    from rich.console import Console

    console = Console(stderr=True)
    rates = parse_levels(rates, "--rates")
    concurrency = parse_levels(concurrency, "--concurrency", int)
    if not rates and not concurrency:
        raise click.UsageError("nothing to measure: give --rates or --concurrency")
    if from_json:
        report = json.loads(Path(from_json).read_text())
    else:
        report = run_all(calls=calls, rates=rates, concurrency=concurrency, rounds=rounds, warmup_calls=warmup_calls, seed=seed,
                         connections=client_connections, token_budget=token_budget, workload=workload,
                         profile_dir=Path(profile_dir) if profile_dir else None, console=console)
        for load in report["loads"]:
            load["medians"] = medians(load["rounds"])
    section = markdown_section(report)
    console.print(section, markup=False, highlight=False)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    if results_md:
        write_block(results_md, cpu_block_name(BLOCK, report["meta"]["machine"]), section)


@click.group()
def main() -> None:
    """The processes `tokq bench gateway-cpu` starts (echo-server, load-client)."""


@main.command("echo-server")
@click.option("--port", type=int, required=True)
def echo_command(port) -> None:
    from tokq.gateway.event_loop import loop_factory

    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:  # the gateway's default loop
        runner.run(serve_echo(port))


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
