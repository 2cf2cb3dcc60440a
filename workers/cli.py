"""`tokq-worker` (also `tokq worker`): load the model, then serve the queue until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import click

from tokq import config as cfg


async def _serve(config: cfg.WorkerConfig, worker_id: str | None, burst: bool) -> None:
    from tokq.connection import connect
    from tokq.shards import ShardedQueue
    from tokq.workers.engine import Engine
    from tokq.workers.worker import Worker, default_worker_id

    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    engine = Engine.load(config.model or None, device=config.device, dtype=config.dtype,
                         attn_backend=config.attn_backend, name=config.model_name or None)
    client = connect(config.redis_url, max_connections=8, cluster=config.redis_cluster)
    queue_config = cfg.load(cfg.QueueConfig)
    worker_id = worker_id or default_worker_id()
    observer = None
    if config.metrics_port:
        from tokq import metrics

        observer = metrics.WorkerMetrics(
            engine.info.name, worker_id, model_config=engine.info.config,
            peak_flops=metrics.device_peak_flops(engine.device), device=str(engine.device),
            dtype=str(engine.dtype).removeprefix("torch."))
        metrics.start_metrics_server(config.metrics_port)
    worker = Worker(engine, ShardedQueue(client, engine.info.queue_name, queue_config), config, queue_config,
                    worker_id=worker_id, observer=observer)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    logging.getLogger("tokq.worker").info(
        "worker %s: %s on %s (%s, attention %s), budget %d tokens, queue %s", worker.worker_id,
        engine.info.name, engine.device, engine.dtype, engine.attn_backend, worker.budget,
        engine.info.queue_name)
    try:
        await worker.run(burst=burst)
    finally:
        await client.aclose()


def _check(config: cfg.WorkerConfig, worker_id: str | None) -> int:
    """Liveness: 0 when this worker's (or, without --worker-id, any worker's) heartbeat is fresh."""
    import redis

    from tokq.connection import connect_sync
    from tokq.keys import QueueKeys
    from tokq.model_info import ModelInfo

    info = ModelInfo.load(config.model or None, name=config.model_name or None)
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
            alive = any(client.exists(keys.heartbeat(w.decode())) for w in client.zrange(keys.workers, 0, -1))
    except redis.RedisError as exc:
        click.echo(f"unhealthy: Redis unreachable: {exc}", err=True)
        return 1
    finally:
        client.close()
    click.echo("alive" if alive else "no heartbeat", err=not alive)
    return 0 if alive else 1


@click.command("worker")
@click.option("--redis-url", help="redis:// or rediss:// URL (env TOKQ_REDIS_URL)")
@click.option("--redis-cluster", type=click.Choice(["auto", "yes", "no"]),
              help="Redis Cluster mode; auto asks the server (default)")
@click.option("--model", help="local model directory; default: the bundled all-MiniLM-L6-v2")
@click.option("--model-name", help="served model name (and queue name)")
@click.option("--device", help="auto | cpu | cuda | cuda:N")
@click.option("--dtype", help="auto | float32 | bfloat16 | float16")
@click.option("--attn-backend", help="auto | flash_attn | torch_varlen | sdpa ...")
@click.option("--token-budget", type=int, help="tokens per batch; default: the published budget "
              "(tokq profile --apply), else a per-device default")
@click.option("--threads", type=int, help="torch CPU threads (default: all cores)")
@click.option("--heartbeat-ms", type=int)
@click.option("--metrics-port", type=int)
@click.option("--worker-id", help="default: hostname-pid")
@click.option("--burst", is_flag=True, help="drain the queue, then exit (tests, batch jobs)")
@click.option("--check", is_flag=True, help="liveness probe: exit 0 if the heartbeat is fresh, else 1")
def worker_command(worker_id, burst, check, **values) -> None:
    """Claim token-budget batches from Redis and embed them."""
    try:
        config = cfg.load(cfg.WorkerConfig, values)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if check:
        sys.exit(_check(config, worker_id))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(config, worker_id, burst))


def main() -> None:
    worker_command(prog_name="tokq-worker")
