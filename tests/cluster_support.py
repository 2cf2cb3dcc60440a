"""A test's own Redis Cluster on loopback (tests that kill or pause nodes must not do it to the
session's shared one): started with the tests' server binary, closed after, the test skipped
where no binary can start one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from tokq.testing.cluster import LocalCluster


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


@contextlib.contextmanager
def running_sentinel(tmp_path) -> Iterator[str]:
    """A Redis Sentinel on loopback, once it answers PING: yields its redis:// URL."""
    import subprocess
    import time

    import redis

    from tokq.processes import stop_all
    from tokq.redis.embedded import default_binary, free_port

    port = free_port()
    conf = tmp_path / "sentinel.conf"  # written by the Sentinel as it runs
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n")
    sentinel = subprocess.Popen([server_binary() or default_binary(), str(conf), "--sentinel"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert sentinel.poll() is None and time.monotonic() < deadline, "no Sentinel"
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_all([sentinel])
