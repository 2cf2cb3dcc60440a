"""A test's own Redis Cluster on loopback (tests that kill or pause nodes must not do it to the
session's shared one): started with the tests' server binary, closed after, the test skipped
where no binary can start one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from tokq.redis_cluster import LocalCluster


def server_binary() -> str | None:
    """The Redis/Valkey binary the tests run (Debian's redis-server in CI's second pass)."""
    return os.environ.get("TOKQ_TEST_REDIS_SERVER") or None


@contextlib.contextmanager
def local_cluster(**kwargs) -> Iterator[LocalCluster]:
    """A started LocalCluster(**kwargs), closed on the way out."""
    try:
        cluster = LocalCluster(binary=server_binary(), **kwargs)
    except (FileNotFoundError, ImportError) as exc:
        pytest.skip(f"no Redis server binary to start a cluster with: {exc}")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()
