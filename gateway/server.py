"""The gateway process: an asyncio gRPC server with the Embedder service (Embed, Rerank, Info,
Tokenize), health and reflection,
the OpenAI-compatible HTTP API on the same loop, a readiness check behind both health endpoints,
and SO_REUSEPORT so several gateway processes can share one port."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from redis.exceptions import LockNotOwnedError

from tokq.tasks import stop_tasks, raise_if_cancelled
from tokq.gateway import http
from tokq.gateway.embedding import Embedder, ServedModel
from tokq.gateway.auth import ApiKeyInterceptor, ApiKeys, http_tls_options, server_credentials
from tokq.gateway.readiness import Readiness, SiblingProcesses
from tokq.gateway.replies import ReplyRouter
from tokq.gateway.rerank import RerankingService
from tokq.gateway.tokenize import Tokenizer
from tokq.gateway.wire import MAX_SEND_MESSAGE_BYTES, add_embedder_service
from tokq import config as cfg
from tokq import metrics
from tokq.address import host_port
from tokq.redis.connection import close_client, connect, connect_pubsub
from tokq.model.info import ModelInfo
from tokq.queue.sharded import ShardedQueue
from tokq.v1 import embedder_pb2

log = logging.getLogger("tokq.gateway")
SERVICE_NAME = embedder_pb2.DESCRIPTOR.services_by_name["Embedder"].full_name


QUEUE_STATS_PERIOD_S = 2.0
# Allocations (net, of container objects) between two young-generation collections.
GC_YOUNG_THRESHOLD = 10_000
# Seconds a stopping gateway waits for its background tasks' clean-up.
STOP_WAIT_S = 2.0


async def _export_queue_stats(queue: ShardedQueue, model: str) -> None:
    """The queue's depth and event totals for Prometheus, from one gateway process per model (the
    holder of a Redis lock), so a sum over gateways counts the shared queue once."""
    lock = queue.redis.lock(queue.keys.metrics_exporter, timeout=3 * QUEUE_STATS_PERIOD_S,
                            thread_local=False)
    holding = False
    unreadable: tuple[int, ...] = ()
    try:
        while True:
            try:
                if holding:
                    try:
                        await lock.reacquire()
                    except LockNotOwnedError:  # expired while this process could not renew it
                        holding = False
                if not holding:
                    holding = await lock.acquire(blocking=False)
                await queue.refresh_shard_count()  # shards other gateways still use count too
                if holding:
                    stats = await queue.stats.read()
                    metrics.observe_queue_stats(stats, model=model)
                    if stats.unreadable_shards != unreadable:  # logged as it changes
                        unreadable = stats.unreadable_shards
                        if unreadable:
                            log.warning("queue %s: stats of shard(s) %s unreadable (their node "
                                        "is unreachable); the queue gauges sum the other shards",
                                        queue.name, ", ".join(map(str, unreadable)))
                        else:
                            log.info("queue %s: every shard's stats readable again", queue.name)
                else:
                    metrics.forget_queue_stats(model)
            except Exception as exc:  # Redis down: stale figures would add to the next exporter's
                metrics.forget_queue_stats(model)
                log.debug("queue stats failed: %s", exc)
            raise_if_cancelled()
            await asyncio.sleep(QUEUE_STATS_PERIOD_S)
    finally:
        if holding:
            with contextlib.suppress(Exception):
                await asyncio.shield(lock.release())


def gateway_id() -> str:
    return f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}"


async def serve(config: cfg.GatewayConfig, queue_config: cfg.QueueConfig | None = None,
                stop: asyncio.Event | None = None, on_ready=None,
                siblings: SiblingProcesses | None = None, queue_exporter: bool = True) -> None:
    """Run until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None). ``siblings``: the other
    `--procs` processes, which must all listen before this one is ready. ``queue_exporter``: whether
    this process competes to export the queue's metrics."""
    api_keys = ApiKeys.from_config(config)
    credentials = server_credentials(config)
    client = connect(config.redis_url, max_connections=config.redis_max_connections,
                     cluster=config.redis_cluster)
    pubsub_client = connect_pubsub(config.redis_url, cluster=config.redis_cluster)
    queue_config = queue_config or cfg.load(cfg.QueueConfig)
    gid = gateway_id()
    models: dict[str, ServedModel] = {}
    for path, name in config.models():  # each model: its own tokenizer, queue and replies
        info = ModelInfo.load(path, name=name, revision=config.revision or None)
        if info.name in models:
            raise cfg.ConfigError(f"model {info.name!r} is served twice: give each --model its "
                                  "own --served-model-name")
        queue = ShardedQueue(client, info.queue_name, queue_config)
        router = ReplyRouter(pubsub_client, client, queue.producer.reply_key,
                             [k.notice_channel(gid) for k in queue.shard_keys()],
                             shard_of=queue.producer.shard_of_request)
        observer = metrics.GatewayMetrics(info.name, info.task)
        queue.producer.observe_enqueues = observer.enqueues_sent
        queue.producer.enqueue_hold_s = config.enqueue_hold_us / 1e6
        models[info.name] = ServedModel(info, Tokenizer(info, threads=config.tokenize_threads,
                                                            large_share=config.large_share),
                                        queue, router, config, gid, observer=observer)
    embedder = Embedder(models, unrouted=metrics.RequestCounts(""))
    max_message_bytes = max(m.limits.max_message_bytes for m in models.values())
    service = RerankingService(embedder, gid)

    interceptors = [ApiKeyInterceptor(api_keys, embedder.refused, SERVICE_NAME)] if api_keys else None
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.so_reuseport", 1),
        # gRPC core starts failing calls at random once 1,000 wait to be picked up by the
        # application: a burst of short queries must queue in Redis, not die here.
        ("grpc.server.max_pending_requests", config.max_pending_rpcs),
        ("grpc.server.max_pending_requests_hard_limit", 2 * config.max_pending_rpcs),
        # Follows the byte caps: a request a little over them gets our INVALID_ARGUMENT naming the
        # cap; one far over is refused by gRPC before it is read into memory.
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
        # tokq.Client pings a silent connection every 30 s while its calls wait; gRPC's default
        # answers pings that frequent with GOAWAY too_many_pings.
        ("grpc.http2.min_ping_interval_without_data_ms", 20_000),
    ])
    add_embedder_service(service, server)  # Embed's inputs read as UTF-8 bytes
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
    address = host_port(config.host, config.port)
    port = (server.add_secure_port(address, credentials) if credentials
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"could not bind {address}")

    async def report(ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)

    # Its own connection: under load every pooled one is busy, and a check waiting its turn would
    # report a loaded gateway as unready.
    ready_client = connect(config.redis_url, max_connections=1, cluster=config.redis_cluster)
    readiness = Readiness(ready_client, {m.info.name: m.queue.keys for m in embedder.models.values()},
                          period_s=config.ready_check_ms / 1000, on_change=report, siblings=siblings)
    http_server = http_task = None
    http_port = 0
    if config.http_port:
        sock = http.bind(config.host, config.http_port)
        http_port = sock.getsockname()[1]
        http_server = http.server(
            http.build_app(embedder, readiness,
                           max_body_bytes=max_message_bytes,
                           api_keys=api_keys),
            **http_tls_options(config))

    for model in models.values():
        with contextlib.suppress(Exception):  # Redis not up yet: the first enqueues record it
            await model.queue.record_shard_count()  # workers claim from every shard from now on
        await model.router.start()
    await server.start()
    if siblings:
        siblings.add()
    if http_server:
        http_task = asyncio.create_task(http_server.serve([sock]), name="http")
    stats_tasks = []
    metrics_server = None
    if config.metrics_port:
        metrics_server = metrics.start_metrics_server(config.metrics_port, addr=config.metrics_host or config.host)
    if config.metrics_port and queue_exporter:
        stats_tasks = [asyncio.create_task(_export_queue_stats(m.queue, name))
                       for name, m in models.items()]
    await readiness.start()
    log.info("gateway %s serving %s on %s (%s%s)%s", gid,
             ", ".join(f"{name} (queue {m.info.queue_name})" for name, m in models.items()),
             host_port(config.host, port), "TLS" if credentials else "plaintext",
             ", mutual TLS" if config.tls_client_ca else "", f", HTTP on port {http_port}" if http_port else "")
    log.info("API keys %s; reflection %s; event loop %s; metrics %s", "required" if api_keys else "off",
             "on" if config.reflection else "off",
             type(asyncio.get_running_loop()).__module__.split(".")[0],
             f"on {host_port(config.metrics_host or config.host, config.metrics_port)}"
             if config.metrics_port else "off")
    # What start-up loaded lives as long as the process: frozen, full collections stop rescanning it.
    gc.collect()
    gc.freeze()
    # Rarer young collections: each rescans every call in flight (docs/internals.md).
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    if on_ready:
        on_ready(port)

    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await readiness.stop()
        await report(False)
        if http_server:
            http_server.should_exit = True
        await server.stop(grace=5)
        if http_task:
            await http_task
        # Waited for (a little): each releases its exporter lock on the way out, on the client
        # closed below; a Redis that does not answer does not hold up the stop.
        await stop_tasks(stats_tasks, timeout_s=STOP_WAIT_S)
        if metrics_server:  # its port is free for a gateway started next in this process
            await asyncio.to_thread(metrics_server.shutdown)  # waits out its 0.5 s poll: not on the loop
            metrics_server.server_close()
        await asyncio.gather(*(model.finish_cancels(STOP_WAIT_S) for model in models.values()))
        for model in models.values():
            await model.router.stop()
            await model.queue.close()
            model.tokenizer.close()
        for redis_client in (client, ready_client, pubsub_client):
            await close_client(redis_client)
