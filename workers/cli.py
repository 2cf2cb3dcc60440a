"""`tokq-worker` (also `tokq worker`): load the model, then serve the queue until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

import click

from tokq import config as cfg
from tokq.address import ports_taken


async def _serve(config: cfg.WorkerConfig, queue_config: cfg.QueueConfig, worker_id: str | None,
                 burst: bool) -> None:
    from tokq.redis.connection import check_redis_or_exit, close_client, connect
    from tokq.model.source import model_errors_as_one_line
    from tokq.queue.sharded import ShardedQueue
    from tokq.workers.engine import Engine
    from tokq.workers.worker import Worker, default_worker_id

    import torch

    from tokq.workers.device import worker_threads

    torch.set_num_threads(worker_threads(config.threads))
    with model_errors_as_one_line():  # unsupported or missing model, device, dtype, backend
        engine = Engine.load(config.model or None, device=config.device, dtype=config.dtype,
                             attn_backend=config.attn_backend, name=config.served_model_name or None,
                             revision=config.revision or None,
                             prompt_cache_bytes=config.prompt_cache_mb << 20,
                             cuda_graph_tokens=config.cuda_graph_tokens)
    check_redis_or_exit(config.redis_url, config.redis_cluster)  # a setting that cannot work: one line
    client = connect(config.redis_url, max_connections=8, cluster=config.redis_cluster)
    worker_id = worker_id or default_worker_id(engine.device)
    observer = None
    if config.metrics_port:
        from tokq import metrics
        from tokq.model.flops import device_peak_flops

        observer = metrics.WorkerMetrics(
            engine.info.name, worker_id, model_config=engine.info.config,
            peak_flops=device_peak_flops(engine.device), device=str(engine.device),
            dtype=str(engine.dtype).removeprefix("torch."))
        metrics.start_metrics_server(config.metrics_port, addr=config.metrics_host)
    worker = Worker(engine, ShardedQueue(client, engine.info.queue_name, queue_config), config, queue_config,
                    worker_id=worker_id, observer=observer)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    # Only a set budget is known yet: a published one is read, or the default fitted, as it runs
    # (this line said the default's 1,024 just before "token budget 1024 -> 64 (published)").
    budget = (f"budget {worker.budget.tokens} tokens" if config.token_budget else
              f"budget: the published one, else the {worker.budget.tokens}-token default fitted to its goal")
    logging.getLogger("tokq.worker").info(
        "worker %s: %s on %s (%s, attention %s, linear %s%s), %s, queue %s",
        worker.worker_id, engine.info.name, engine.device, engine.dtype, engine.attn_backend,
        engine.linear_backend,
        f", CUDA graphs up to {engine.graphs.max_tokens} tokens" if engine.graphs else "",
        budget, engine.info.queue_name)
    try:
        await worker.run(burst=burst)
    finally:
        await close_client(client)


def _check(config: cfg.WorkerConfig, worker_id: str | None, this_host: bool = False) -> int:
    """Liveness: 0 when this worker's (or, without --worker-id, any worker's; with ``this_host``,
    any worker's started on this host with the default id hostname-device) heartbeat is fresh."""
    import redis

    from tokq.redis.connection import connect_sync
    from tokq.queue.keys import QueueKeys
    from tokq.model.info import ModelInfo
    from tokq.model.source import model_errors_as_one_line

    with model_errors_as_one_line():  # a probe's log shows one line too, not a traceback
        info = ModelInfo.load(config.model or None, name=config.served_model_name or None,
                              revision=config.revision or None)
    keys = QueueKeys(info.queue_name)
    try:
        client = connect_sync(config.redis_url, config.redis_cluster)
    except redis.RedisError as exc:
        click.echo(f"unhealthy: Redis unreachable: {exc}", err=True)
        return 1
    try:
        if worker_id:
            alive = bool(client.exists(keys.heartbeat(worker_id)))
        else:
            ids = [w.decode() for w in client.zrange(keys.workers, 0, -1)]
            if this_host:  # a k8s pod: its own worker, not another pod's
                ids = [w for w in ids if w.startswith(f"{socket.gethostname()}-")]
            alive = any(client.exists(keys.heartbeat(w)) for w in ids)
    except redis.RedisError as exc:
        click.echo(f"unhealthy: Redis unreachable: {exc}", err=True)
        return 1
    finally:
        client.close()
    click.echo("alive" if alive else "no heartbeat", err=not alive)
    return 0 if alive else 1


# -h too: `tokq worker` inherits it from the tokq group; the `tokq-worker` script has no group
@click.command("worker", context_settings={"help_option_names": ["-h", "--help"]})
@cfg.click_options(cfg.WorkerConfig, cfg.QueueConfig)
@click.option("--worker-id", envvar="TOKQ_WORKER_ID",
              help="stable across restarts, names the worker's metrics [env TOKQ_WORKER_ID; default: "
                   "hostname-device, e.g. node3-cuda0; workers sharing a device need their own]")
@click.option("--burst", is_flag=True, help="drain the queue, then exit (tests, batch jobs)")
@click.option("--check", is_flag=True, help="liveness probe: exit 0 if the heartbeat is fresh, else 1")
@click.option("--this-host", is_flag=True, help="with --check: only workers started here with the default id")
def worker_command(worker_id, burst, check, this_host, **values) -> None:
    """Claim token-budget batches from Redis and embed them."""
    worker_values, queue_values = cfg.split(values, cfg.WorkerConfig, cfg.QueueConfig)
    config = cfg.load_or_exit(cfg.WorkerConfig, worker_values)
    queue_config = cfg.load_or_exit(cfg.QueueConfig, queue_values)
    if check:
        sys.exit(_check(config, worker_id, this_host))
    from tokq.workers import device

    if error := device.torch_version_error():  # one line, before anything loads
        raise click.ClickException(error)
    if busy := ports_taken([("metrics", config.metrics_host, config.metrics_port)]):
        # One line before the model loads: else a traceback once it had.
        raise click.UsageError(f"{busy} already in use (another worker?): choose another --metrics-port, "
                               "or stop that process")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(config, queue_config, worker_id, burst))


def main() -> None:
    cfg.warn_unknown_env()
    worker_command(prog_name="tokq-worker")
