"""What the benchmarks that start tokq share: a stack of real processes, a bare gRPC server, helper
processes that talk in lines, /proc CPU windows, rounds and their medians, and the benches' options."""

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
from collections.abc import Callable, Iterable
from pathlib import Path

import click

from tokq.profiling.bench.proc_cpu import children, cmdline, machine_busy_s, proc_cpu_s, proc_wakeups

START_TIMEOUT_S = 180
HIDDEN_SIZE = 384  # all-MiniLM-L6-v2's vector: what the bare server answers too
GRPC_LIMITS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 64 << 20)]


# -- the benches' shared options ---------------------------------------------------------------

def results_md_option(topic: str):
    return click.option("--results-md", type=click.Path(dir_okay=False), default=None,
                        help=f"Rewrite this bench's section of this file (profiling/results/{topic}).")


def bench_options(topic: str, *, rounds: int | None = 3, json_out: bool = False):
    """The options a bench ends with, in this order: --rounds, --json (the raw figures), --results-md."""
    options = [*([click.option("--rounds", default=rounds, show_default=True)] if rounds else []),
               *([click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
                               help="Also write the raw figures here.")] if json_out else []),
               results_md_option(topic)]

    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command
    return apply


model_option = click.option("--model", default=None, help="Model directory [default: bundled all-MiniLM-L6-v2].")
threads_option = click.option("--threads", default=0, show_default=True, help="torch threads (0: torch's default).")


def save_json(path: str | None, report) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")


# -- processes ---------------------------------------------------------------------------------

def env(**extra: str) -> dict[str, str]:
    """This process's environment, offline, unbuffered, plus ``extra``."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", **extra}


def python(*args: str, extra_env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], env=env(**(extra_env or {})), **popen)


def tokq(*args: str, redis_url: str, log=subprocess.DEVNULL, extra_env: dict[str, str] | None = None):
    """`tokq ARGS` on ``redis_url``, given in the environment (the URL may hold a password)."""
    return python("-m", "tokq.cli", *args, extra_env={"TOKQ_REDIS_URL": redis_url, **(extra_env or {})},
                  stdout=log, stderr=log)


def bundled_queue() -> str:
    from tokq.model.info import ModelInfo

    return ModelInfo.load().queue_name


def start_worker(redis_url: str, worker_id: str, *, token_budget: int | None = None,
                 extra_env: dict[str, str] | None = None, log=subprocess.DEVNULL) -> subprocess.Popen:
    """One `tokq worker` of the bundled model with one torch thread."""
    from tokq.model.info import bundled_model_path

    budget = ["--token-budget", str(token_budget)] if token_budget else []
    return tokq("worker", "--model", str(bundled_model_path()), "--worker-id", worker_id, *budget, "--threads", "1",
                redis_url=redis_url, log=log, extra_env=extra_env)


def wait_until(ready: Callable[[], bool], what: str, procs: Iterable[subprocess.Popen] = (),
               timeout_s: float = START_TIMEOUT_S, poll_s: float = 0.2) -> None:
    """Until ``ready()``; fails if one of ``procs`` exits first or ``timeout_s`` passes."""
    procs, deadline = list(procs), time.monotonic() + timeout_s
    while not ready():
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(poll_s)


def wait_heartbeats(client, procs: dict[str, subprocess.Popen], timeout_s: float = 300) -> None:
    """Until every worker (by id) has a heartbeat key: it has loaded and warmed up."""
    from tokq.queue.keys import QueueKeys

    keys = QueueKeys(bundled_queue())
    wait_until(lambda: all(client.exists(keys.heartbeat(w)) for w in procs), "worker heartbeats", procs.values(),
               timeout_s)


def gateway_children(pid: int) -> list[int]:
    """The processes `tokq gateway --procs N` started (spawned workers, not the resource tracker)."""
    return [c for c in children(pid) if any("spawn_main" in arg for arg in cmdline(c))]


class Gateway:
    """`tokq gateway` on loopback: gRPC, and an HTTP port and one metrics port per process when asked."""

    def __init__(self, redis_url: str, *, procs: int = 1, http: bool = False, metrics: bool = False,
                 log=subprocess.DEVNULL) -> None:
        from tokq.redis.embedded import free_port

        self.procs, self.port = procs, free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.http_port = free_port() if http else None
        base = free_port(offsets=tuple(range(procs))) if metrics else None  # process i serves on base + i
        self.metrics_ports = [base + i for i in range(procs)] if metrics else []
        args = ["--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--http-port", str(self.http_port)] if http else []
        args += ["--procs", str(procs)] if procs > 1 else []
        args += ["--metrics-port", str(base)] if metrics else []
        self.proc = tokq("gateway", *args, redis_url=redis_url, log=log)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def pids(self) -> list[int]:
        """One process runs in the launcher itself; several are its children."""
        return gateway_children(self.proc.pid) if self.procs > 1 else [self.proc.pid]

    def metric(self, name: str, process: int = 0, **labels: str) -> float:
        return metric(f"http://127.0.0.1:{self.metrics_ports[process]}/metrics", name, **labels)


class Stack:
    """An embedded Redis with `tokq worker`s and `tokq gateway`s on it, each its own process."""

    def __init__(self, log: str | Path | None = None) -> None:
        import redis

        from tokq.redis.embedded import EmbeddedRedis

        self.log = open(log, "ab") if log else subprocess.DEVNULL
        self.redis = EmbeddedRedis().start()
        self.client = redis.Redis.from_url(self.redis.url)
        self.workers: dict[str, subprocess.Popen] = {}
        self.gateways: list[Gateway] = []

    def worker(self, worker_id: str, **kw) -> subprocess.Popen:
        self.workers[worker_id] = start_worker(self.redis.url, worker_id, log=self.log, **kw)
        return self.workers[worker_id]

    def gateway(self, **kw) -> Gateway:
        self.gateways.append(Gateway(self.redis.url, log=self.log, **kw))
        return self.gateways[-1]

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> Stack:
        """Every worker warmed up, then every gateway healthy (Redis and a live worker seen)."""
        from tokq.processes import wait_for_health

        wait_heartbeats(self.client, self.workers, timeout_s)
        for g in self.gateways:
            wait_for_health(g.target, [g.proc], timeout_s)
        return self

    def pids(self) -> dict[str, int]:
        """The first gateway, the first worker and Redis, by role."""
        return {**({"gateway": self.gateways[0].proc.pid} if self.gateways else {}),
                "worker": next(iter(self.workers.values())).pid, "redis": self.redis.pid}

    def stop_workers(self) -> None:
        from tokq.processes import stop_all

        stop_all(self.workers.values(), timeout_s=30)
        self.workers.clear()

    def close(self) -> None:
        from tokq.processes import stop_all

        stop_all([*(g.proc for g in self.gateways), *self.workers.values()], timeout_s=30)
        self.client.close()
        self.redis.close()
        if self.log is not subprocess.DEVNULL:
            self.log.close()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the bare gRPC server ----------------------------------------------------------------------

class BareServer:
    """tokq.v1.Embedder with no tokq in it: one fixed unit vector per input, on the gateway's loop and
    thread policy; ``refuse``: every Embed refused unparsed (the gateway's message limits), Info empty."""

    def __init__(self, *, refuse: bool = False, log=subprocess.DEVNULL) -> None:
        from tokq.processes import wait_for_health
        from tokq.redis.embedded import free_port

        self.target = f"127.0.0.1:{free_port()}"
        self.proc = python("-m", "tokq.profiling.harness", "bare-server", "--port", self.target.rsplit(":", 1)[1],
                           *(["--refuse"] if refuse else []), stdout=log, stderr=log)
        try:
            wait_for_health(self.target, [self.proc], 120)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        from tokq.processes import stop_all

        stop_all([self.proc], timeout_s=10)


async def serve_bare(port: int, refuse: bool) -> None:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from tokq.v1 import embedder_pb2 as pb
    from tokq.v1 import embedder_pb2_grpc as pb_grpc

    if refuse:
        async def refused(request: bytes, context) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused unread")

        async def info(request: bytes, context) -> bytes:
            return b""

        handler = grpc.method_handlers_generic_handler("tokq.v1.Embedder", {
            "Embed": grpc.unary_unary_rpc_method_handler(refused), "Info": grpc.unary_unary_rpc_method_handler(info)})
        server = grpc.aio.server(handlers=[handler], options=GRPC_LIMITS)
    else:
        vector = [1.0 / HIDDEN_SIZE ** 0.5] * HIDDEN_SIZE

        class Echo(pb_grpc.EmbedderServicer):
            async def Embed(self, request, context):
                return pb.EmbedResponse(embeddings=[pb.Embedding(values=vector) for _ in request.inputs], model="echo")

        server = grpc.aio.server()
        pb_grpc.add_EmbedderServicer_to_server(Echo(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"127.0.0.1:{port}") == 0:
        raise OSError(f"could not bind port {port}")
    await server.start()
    if not refuse:
        from tokq.gateway.helper_threads import yield_to_loop_thread

        yield_to_loop_thread()  # the gateway's thread policy: the two differ only in their work
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


# -- helper processes --------------------------------------------------------------------------

class Child:
    """A helper process (`python -m MODULE ARGS`) talking in lines: it prints "ready" once warmed up,
    reads commands from stdin and answers one JSON line."""

    def __init__(self, module: str, *args: str) -> None:
        self.proc = python("-m", module, *args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def ready(self) -> Child:
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a helper process failed to start ({self.proc.args[2]})")
        return self

    def say(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


async def read_line() -> str:
    """The next line of stdin (a Child's command), without blocking the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


def reply(obj) -> None:
    print(json.dumps(obj) if not isinstance(obj, str) else obj, flush=True)


# -- measuring ---------------------------------------------------------------------------------

class CpuWindow:
    """CPU-seconds of named processes over a ``with`` block (/proc): ``cpu_s``, ``wall_s``, ``cores()``,
    ``ms_per(calls)``, the ``wakeups`` ones' context switches, and the whole machine's busy cores."""

    def __init__(self, pids: dict[str, int], wakeups: Iterable[str] = ()) -> None:
        self.pids, self.wakeup_names = pids, [n for n in wakeups if n in pids]

    def __enter__(self) -> CpuWindow:
        self._woken = {n: proc_wakeups(self.pids[n]) for n in self.wakeup_names}
        self._before = {n: proc_cpu_s(p) for n, p in self.pids.items()}
        self._busy, self._t0 = machine_busy_s(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        self.cpu_s = {n: proc_cpu_s(p) - self._before[n] for n, p in self.pids.items()}
        self.wakeups = {n: proc_wakeups(self.pids[n]) - w for n, w in self._woken.items()}
        busy = machine_busy_s()
        self.machine_cores = (busy - self._busy) / self.wall_s if busy is not None else None

    def cores(self) -> dict[str, float]:
        return {n: s / self.wall_s for n, s in self.cpu_s.items()}

    def ms_per(self, calls: int, digits: int | None = None) -> dict[str, float]:
        return {n: 1000 * s / calls if digits is None else round(1000 * s / calls, digits) for n, s in self.cpu_s.items()}


def settle(pid: int, timeout_s: float = 30.0, window_s: float = 0.5, busy: float = 0.1) -> None:
    """Until ``pid`` uses less than ``busy`` of a core over ``window_s``, so a phase's last requests
    are not measured in the next phase."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = proc_cpu_s(pid)
        time.sleep(window_s)
        if proc_cpu_s(pid) - before < busy * window_s:
            return


def interleaved(rounds: int, configs: Iterable, measure: Callable, *, flip: bool = False) -> dict:
    """Per config, ``measure(config)`` of every round; each round runs every config in turn (in reverse
    every other round with ``flip``), so load from other processes lands on each alike."""
    configs = list(configs)
    out: dict = {c: [] for c in configs}
    for r in range(rounds):
        for c in configs[::-1] if flip and r % 2 else configs:
            out[c].append(measure(c))
    return out


def metrics(url: str, *names: str, **labels: str) -> dict[str, float]:
    """Per name, the sum of a Prometheus page's samples of that name with ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    text, out = urllib.request.urlopen(url, timeout=5).read().decode(), dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out and all(s.labels.get(k) == v for k, v in labels.items()):
                out[s.name] += s.value
    return out


def metric(url: str, name: str, **labels: str) -> float:
    return metrics(url, name, **labels)[name]


def pct(values: list[float], q: float) -> float:
    """The ``q`` (0..1) quantile by rank: a p99 of 500 calls is their 5th-6th slowest."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def dig(row, path):
    for key in path:
        row = row[key]
    return row


def median(rows: Iterable, *path):
    """The median over rounds of each round's value at ``path`` (keys into nested dicts)."""
    return statistics.median(dig(r, path) for r in rows)


def medians(rows: list[dict]) -> dict:
    """Every value of the rounds' dicts (nested ones too), as its median over rounds."""
    return {k: medians([r[k] for r in rows]) if isinstance(v, dict) else median(rows, k) for k, v in rows[0].items()}


def ratio(rows: Iterable, num: tuple, den: tuple) -> float:
    """The median over rounds of each round's ``num`` / ``den``: ratios taken within a round."""
    return statistics.median(dig(r, num) / dig(r, den) for r in rows)


def vocab_words(lowercase: bool = False) -> list[str]:
    """Whole words of the bundled model's vocabulary (one token each), 3 letters or more."""
    from tokq.model.info import bundled_model_path

    words = (w.strip() for w in open(bundled_model_path() / "vocab.txt", encoding="utf-8"))
    return [w for w in words if w.isalpha() and len(w) > 2 and (w.islower() or not lowercase)]


def loadavg() -> list[str]:
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return []


def machine() -> dict:
    from tokq.host import cpu_name, vector_extension

    return {"cpu": cpu_name(), "vector_extension": vector_extension(), "num_cpus": os.cpu_count(),
            "platform": platform.platform()}


@click.group()
def main() -> None:
    """Processes the benchmarks start."""


@main.command("bare-server")
@click.option("--port", type=int, required=True)
@click.option("--refuse", is_flag=True)
def bare_server_command(port, refuse) -> None:
    if refuse:
        asyncio.run(serve_bare(port, True))
        return
    from tokq.gateway.event_loop import loop_factory

    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:  # the gateway's default loop
        runner.run(serve_bare(port, False))


if __name__ == "__main__":
    main()
