"""Many models per fleet on a real Redis Cluster: one gateway process serves two models (one
--model each), each with its own sharded queue and its own worker; the request's model routes it."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import redis
from test_service_on_a_cluster import _wait_serving

from tokq import Client, TokqError
from tokq.config import ConfigError, GatewayConfig
from tokq.queue.keys import QueueKeys, shard_queue_name
from tokq.model.info import ModelInfo
from tokq.processes import stop_all
from tokq.redis.embedded import free_port

pytestmark = pytest.mark.slow
NAMES = ("minilm-a", "minilm-b")


def test_served_names_pair_with_models_in_order():
    config = GatewayConfig(model=("/m/a", "/m/b"), served_model_name=("a",))
    assert config.models() == [("/m/a", "a"), ("/m/b", None)]
    assert GatewayConfig().models() == [(None, None)]
    with pytest.raises(ConfigError, match="served model names"):
        GatewayConfig(model=("/m/a",), served_model_name=("a", "b"))


@pytest.fixture(scope="module")
def two_models(redis_cluster, bundled_model_dir):
    for node in redis_cluster.nodes:
        if not node.running:
            redis_cluster.restart(node.port)
    redis_cluster.flushall()
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKQ_REDIS_URL": redis_cluster.url,
           "TOKQ_QUEUE_SHARDS": "2"}
    model_args = [a for name in NAMES for a in ("--model", str(bundled_model_dir),
                                                "--served-model-name", name)]
    procs = [subprocess.Popen([sys.executable, "-m", "tokq.cli", "gateway", "--host", "127.0.0.1",
                               "--port", str(port), *model_args], env=env)]
    try:
        for name in NAMES:  # a worker serves one model
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tokq.cli", "worker", "--model", str(bundled_model_dir),
                 "--served-model-name", name, "--worker-id", f"w-{name}", "--threads", "1"], env=env))
        _wait_serving(f"127.0.0.1:{port}", procs[0])
        yield f"127.0.0.1:{port}"
    finally:
        stop_all(procs, timeout_s=20)


def _enqueued(url: str, name: str) -> int:
    queue = ModelInfo.load(None, name=name).queue_name
    with redis.RedisCluster.from_url(url) as c:
        return sum(int(c.hget(QueueKeys(shard_queue_name(queue, s)).counters, "enqueued") or 0)
                   for s in range(2))


def test_the_request_model_routes_it_to_that_model_queue(two_models, redis_cluster):
    redis_cluster_url = redis_cluster.url
    texts = ["one gateway", "two models", "each its own queue"]
    before = {name: _enqueued(redis_cluster_url, name) for name in NAMES}
    vectors = {}
    for name in NAMES:
        with Client(two_models, model=name) as client:
            vectors[name] = client.embed(texts, timeout=60)
        after = _enqueued(redis_cluster_url, name)
        assert after - before[name] == len(texts)  # on this model's queue ...
        before[name] = after
    for name in NAMES:  # ... and nothing more on the other's
        assert _enqueued(redis_cluster_url, name) == before[name]
    np.testing.assert_allclose(vectors[NAMES[0]], vectors[NAMES[1]], atol=1e-5)  # same weights


def test_info_lists_every_model_and_an_unknown_model_is_refused(two_models):
    with Client(two_models) as client:
        info = client.info(timeout=10)
    assert list(info.models) == sorted(NAMES) and info.model == NAMES[0]
    with Client(two_models, model="no-such-model") as client, pytest.raises(TokqError) as err:
        client.embed(["hi"], timeout=10)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "minilm-a" in err.value.message
    with Client(two_models) as client, pytest.raises(TokqError) as err:
        client.embed(["hi"], timeout=10)  # several served: the request must name one
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
