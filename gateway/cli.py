"""`tokq gateway`: parse flags, then run one or more gateway processes on one port."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import signal
import sys

import click

from tokq import config as cfg
from tokq.address import ports_taken


def _run_one(gateway_values: dict, queue_values: dict, siblings=None, queue_exporter: bool = True) -> None:
    from tokq.gateway.event_loop import loop_factory
    from tokq.gateway.helper_threads import yield_to_loop_thread
    from tokq.gateway.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = cfg.load(cfg.GatewayConfig, gateway_values)
    # The loop and, once serving (gRPC's threads exist then), the threads yielding to its thread
    # are chosen here, not in serve(): they are the whole process's, and in-process users own theirs.
    with asyncio.Runner(loop_factory=loop_factory(config.event_loop)) as runner:
        runner.run(serve(config, cfg.load(cfg.QueueConfig, queue_values),
                         on_ready=lambda port: yield_to_loop_thread(), siblings=siblings,
                         queue_exporter=queue_exporter))


def _run_child(gateway_values: dict, queue_values: dict, listening, procs: int, index: int) -> None:
    """One of `--procs N` gateway processes: it dies with the parent, and is ready once all N listen.
    Only the first (on --metrics-port itself, the port a scrape config names) exports queue metrics."""
    from tokq.gateway.readiness import SiblingProcesses
    from tokq.processes import die_with_parent

    die_with_parent()
    _run_one(gateway_values, queue_values, SiblingProcesses(listening, procs), queue_exporter=index == 0)


@click.command("gateway")
@cfg.click_options(cfg.GatewayConfig, cfg.QueueConfig)
@click.option("--procs", type=click.IntRange(1, 256), default=1, envvar="TOKQ_PROCS",
              help="gateway processes sharing the port (SO_REUSEPORT); one tops out near 3,000 RPC/s "
                   "[env TOKQ_PROCS; default: 1]")
def gateway_command(procs: int, **values) -> None:
    """Serve the tokq.v1.Embedder gRPC API in front of the Redis queue."""
    gateway_values, queue_values = cfg.split(values, cfg.GatewayConfig, cfg.QueueConfig)
    base = cfg.load_or_exit(cfg.GatewayConfig, gateway_values)  # validate before forking
    cfg.load_or_exit(cfg.QueueConfig, queue_values)
    from tokq.gateway.auth import ApiKeys, client_key_warning, server_credentials

    from tokq.gateway.event_loop import loop_factory

    try:  # unreadable certificates or key files: one line now, not a traceback per process
        cfg.check_distinct_ports(base.port_uses(procs))  # its processes' metrics ports count up
        server_credentials(base)
        keys = ApiKeys.from_config(base)
        loop_factory(base.event_loop)  # uvloop asked for and missing
    except cfg.ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if warning := client_key_warning(keys is not None):  # once, here: not by each process
        click.echo(warning, err=True)
    from tokq.model.info import ModelInfo
    from tokq.model.source import model_errors_as_one_line

    with model_errors_as_one_line():  # as the worker says it, once, before Redis is asked or anything forks
        for path, name in base.models():  # a gateway tokenizes: it needs the tokenizer's files
            ModelInfo.load(path, name=name, revision=base.revision or None).require_tokenizer()
    metrics_host = base.metrics_host or base.host
    if busy := ports_taken([("gRPC", base.host, base.port), ("HTTP", base.host, base.http_port),
                            *(("metrics", metrics_host, base.metrics_port + i)
                              for i in range(procs) if base.metrics_port)]):
        raise click.UsageError(f"{busy} already in use (another gateway?): choose another "
                               "--port / --http-port / --metrics-port, or stop that process")
    from tokq.redis.connection import check_redis_or_exit

    check_redis_or_exit(base.redis_url, base.redis_cluster)  # a setting that cannot work: one line
    if procs <= 1:
        _run_one(gateway_values, queue_values)
        return
    ctx = multiprocessing.get_context("spawn")
    listening = ctx.Value("i", 0)
    children = []
    for i in range(procs):
        child_values = dict(gateway_values)
        if base.metrics_port:
            child_values["metrics_port"] = base.metrics_port + i
        proc = ctx.Process(target=_run_child, args=(child_values, queue_values, listening, procs, i),
                           name=f"tokq-gateway-{i}")
        proc.start()
        children.append(proc)

    asked_to_stop = []

    def _stop(*_):
        asked_to_stop.append(True)
        for proc in children:
            if proc.is_alive():
                proc.terminate()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # One process ending unasked ends them all: the port would otherwise serve fewer processes'
    # worth, silently; a supervisor (tokq up, Kubernetes) restarts the whole gateway instead.
    ready = multiprocessing.connection.wait([proc.sentinel for proc in children])
    first = next(proc for proc in children if proc.sentinel in ready)
    first.join()  # its sentinel closes as it exits, a moment before it can be reaped
    unasked = not asked_to_stop
    if unasked:
        logging.getLogger("tokq.gateway").error("gateway process %s exited (%s); stopping the others",
                                                first.name, first.exitcode)
    _stop()
    for proc in children:
        proc.join()
    if unasked:  # its own code, or 1 when it ended by a signal (negative) or cleanly (0)
        sys.exit(first.exitcode if first.exitcode and first.exitcode > 0 else 1)
