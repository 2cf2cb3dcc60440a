"""deploy/ for Redis Cluster: the compose override builds a 3+3 cluster and points gateway and
worker at it with sharded queues; the autoscaler's signal covers every shard."""

from __future__ import annotations

import asyncio
import re

import yaml
from prometheus_client import REGISTRY
from queue_support import items
from test_compose_and_k8s_manifests import COMPOSE_DIR, K8S, check_env

from tokq import metrics
from tokq.config import QueueConfig
from tokq.redis.connection import connect
from tokq.queue.sharded import ShardedQueue


def test_compose_cluster_override_builds_a_replicated_cluster_and_uses_it():
    base = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())["services"]
    override = yaml.safe_load((COMPOSE_DIR / "compose.cluster.yaml").read_text())["services"]
    nodes = [n for n in override if n.startswith("redis-node-")]
    assert len(nodes) == 6
    for n in nodes:
        command = override[n]["command"]
        assert command[command.index("--cluster-enabled") + 1] == "yes"
    init = " ".join(override["redis-cluster-init"]["command"])
    assert "--cluster-replicas 1" in init and "--cluster create" in init
    assert set(override["redis-cluster-init"]["depends_on"]) == set(nodes)
    for name in ("gateway", "worker"):
        assert name in base
        env = override[name]["environment"]
        check_env(name, env)
        host = re.match(r"redis://([^:/]+):(\d+)", env["TOKQ_REDIS_URL"]).group(1)
        assert host in nodes
        assert QueueConfig(queue_shards=int(env["TOKQ_QUEUE_SHARDS"])).queue_shards >= len(nodes) // 2
        assert "redis-cluster-init" in override[name]["depends_on"]


def test_autoscaler_reads_the_queue_gauges_that_sum_every_shard(redis_url):
    (scaled,) = [d for d in yaml.safe_load_all((K8S / "autoscaler.yaml").read_text())
                 if d and d["kind"] == "ScaledObject"]
    queries = {t["name"]: t["metadata"]["query"] for t in scaled["spec"]["triggers"]}
    assert "tokq_queue_queued_tokens" in queries["all"]
    assert "tokq_queue_lane_queued_tokens" in queries["interactive"]

    async def run() -> None:
        client = connect(redis_url)
        q = ShardedQueue(client, "gauge-model", QueueConfig(queue_shards=4))
        try:
            for r in range(12):  # interactive: 11 tokens each; batch-class: 7 each
                await q.producer.enqueue(f"r{r}", items(5, 6), timeout_ms=60_000, gateway_id="gw")
                await q.producer.enqueue(f"b{r}", items(7), timeout_ms=60_000, gateway_id="gw",
                                         priority="batch")
            used = {q.producer.shard_of_request(f"r{r}") for r in range(12)}
            assert len(used) > 1
            metrics.observe_queue_stats(await q.stats.read(), model="gauge-model")
        finally:
            await q.close()
            await client.aclose()

    asyncio.run(run())
    sample = REGISTRY.get_sample_value
    assert sample("tokq_queue_queued_tokens", {"model": "gauge-model"}) == 12 * 11 + 12 * 7
    interactive = sum(sample("tokq_queue_lane_queued_tokens", {"model": "gauge-model", "lane": lane})
                      for lane in ("light", "heavy"))
    assert interactive == 12 * 11
    assert sample("tokq_queue_lane_queued_tokens", {"model": "gauge-model", "lane": "batch"}) == 12 * 7
