"""A Redis setting that cannot work stops the gateway, the worker and `tokq up` at start with one
line naming it (tokq.redis.connection.check_redis), never a traceback, a password or a process that
runs on failing every call:

- ``--redis-cluster yes`` against a standalone server (the gateway served, failing every call
  INTERNAL and logging a traceback 5 times a second; the worker exited with 70 lines);
- ``--redis-cluster no`` against a cluster node (the gateway said ready, its calls drew
  CROSSSLOT/MOVED);
- a password the server refuses, or none where it asks for one (70 lines, after ~10 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import redis
from cluster_support import local_cluster

from tokq.redis.connection import RedisSetupError, check_redis, is_cluster
from tokq.redis.embedded import free_port


def _wrong_password(url: str, password: str) -> str:
    return url.replace(f":{password}@", ":not-the-password@")


def _no_password(url: str, password: str) -> str:
    return url.replace(f":{password}@", "")


@pytest.fixture(scope="module")
def password_cluster():
    """A one-node cluster (all slots) that asks for a password: (URL with it, the password)."""
    with local_cluster(num_primaries=1, replicas_per_primary=0) as cluster:
        password = "cluster-secret"
        with cluster.nodes[0].client(cluster.host) as c:
            c.config_set("requirepass", password)
        yield cluster.url.replace("redis://", f"redis://:{password}@"), password


def test_each_mistake_is_one_error_naming_the_setting(redis_server, redis_url, redis_cluster_url,
                                                       password_cluster):
    pw = redis_server.password
    cases = [
        (redis_url, "yes", "--redis-cluster yes (TOKQ_REDIS_CLUSTER)", "cluster_enabled:0"),
        (redis_cluster_url, "no", "--redis-cluster no (TOKQ_REDIS_CLUSTER)", "cluster_enabled:1"),
        (_wrong_password(redis_url, pw), "auto", "refused the password", "--redis-url (TOKQ_REDIS_URL)"),
        (_wrong_password(redis_url, pw), "no", "refused the password", "--redis-url (TOKQ_REDIS_URL)"),
        (_no_password(redis_url, pw), "auto", "asks for a password", "--redis-url (TOKQ_REDIS_URL) has none"),
        (_wrong_password(*password_cluster), "auto", "refused the password", "--redis-url"),
        (_wrong_password(*password_cluster), "yes", "refused the password", "--redis-url"),
    ]
    for url, mode, *needles in cases:
        with pytest.raises(RedisSetupError) as err:
            check_redis(url, mode)
        message = str(err.value)
        assert all(n in message for n in needles), (url, mode, message)
        assert "\n" not in message and pw not in message and password_cluster[1] not in message


def test_what_can_work_passes_and_an_absent_server_is_not_a_mistake(redis_url, redis_cluster_url,
                                                                    password_cluster):
    assert check_redis(redis_url) is False and check_redis(redis_url, "no") is False
    assert check_redis(redis_cluster_url) is True and check_redis(redis_cluster_url, "yes") is True
    assert check_redis(password_cluster[0]) is True
    assert is_cluster(redis_cluster_url) is True
    # Not up yet: an explicit setting is taken as given (commands wait for the server, as after
    # an outage); auto, which needs the server's answer, is an error.
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    assert check_redis(nowhere, "yes") is True and check_redis(nowhere, "no") is False


def _run(args: list[str], env: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKQ_DEVICE": "cpu", "TOKQ_METRICS_PORT": "0",
           "TOKQ_HTTP_PORT": "0", "TOKQ_HOST": "127.0.0.1", "TOKQ_PORT": str(free_port()), **env}
    return subprocess.run([sys.executable, "-m", "tokq.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout_s)


def _assert_one_line(run: subprocess.CompletedProcess, needle: str, secret: str) -> None:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith("Error: ") and needle in lines[0], lines[0]
    assert secret not in run.stderr + run.stdout


@pytest.mark.parametrize("command", ["gateway", "worker", "up"])
def test_cluster_yes_on_a_standalone_redis_stops_each_command(command, redis_server, redis_url):
    args = [command, "--redis-url", redis_url] if command == "up" else [command]
    run = _run(args, {"TOKQ_REDIS_URL": redis_url, "TOKQ_REDIS_CLUSTER": "yes"})
    _assert_one_line(run, "--redis-cluster yes (TOKQ_REDIS_CLUSTER)", redis_server.password)


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_cluster_no_on_a_cluster_node_stops_each_command(command, redis_cluster_url):
    run = _run([command], {"TOKQ_REDIS_URL": redis_cluster_url, "TOKQ_REDIS_CLUSTER": "no",
                           "TOKQ_QUEUE_SHARDS": "4"})
    _assert_one_line(run, "--redis-cluster no (TOKQ_REDIS_CLUSTER)", "\0")


def test_a_wrong_password_stops_the_gateway_on_a_cluster(password_cluster):
    url, password = password_cluster
    run = _run(["gateway"], {"TOKQ_REDIS_URL": _wrong_password(url, password)})
    _assert_one_line(run, "refused the password", "not-the-password")


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_a_wrong_or_missing_password_stops_each_command_on_a_standalone_redis(command, redis_server,
                                                                              redis_url):
    run = _run([command], {"TOKQ_REDIS_URL": _wrong_password(redis_url, redis_server.password)})
    _assert_one_line(run, "refused the password", "not-the-password")
    run = _run([command], {"TOKQ_REDIS_URL": _no_password(redis_url, redis_server.password)})
    _assert_one_line(run, "asks for a password", redis_server.password)


def test_tokq_up_refuses_cluster_yes_with_its_embedded_redis():
    run = _run(["up"], {"TOKQ_REDIS_CLUSTER": "yes"})
    assert run.returncode == 2 and "--redis-cluster yes (TOKQ_REDIS_CLUSTER) needs --redis-url" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_server_that_answers_nothing_is_one_line_with_auto(monkeypatch):
    import tokq.redis.connection

    monkeypatch.setattr(tokq.redis.connection, "_PROBE_WAIT_S", 1.0)
    with pytest.raises(RedisSetupError, match="did not answer"):
        check_redis(f"redis://:hidden@127.0.0.1:{free_port()}/0")
    with pytest.raises(redis.exceptions.ConnectionError):  # what connect() meets: unchanged
        is_cluster(f"redis://127.0.0.1:{free_port()}/0")


class _SlowToAccept:
    """A TCP front for a Redis that answers no connect until ``open_after_s`` has passed (its
    accept queue full, so the kernel drops each new SYN: the client's connect times out, as with
    a pod not up yet or a firewall), then forwards every connection to ``target``."""

    def __init__(self, target: tuple[str, int], open_after_s: float) -> None:
        import socket

        self._target, self._open_after_s = target, open_after_s
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=0)
        self.port = self._listener.getsockname()[1]
        # One connection nobody accepts fills the queue (Linux keeps backlog + 1).
        self._filler = socket.create_connection(("127.0.0.1", self.port))
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import socket

        if self._stop.wait(self._open_after_s):
            return
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(2)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._filler.close()
        self._listener.close()


@pytest.mark.slow
def test_auto_waits_about_10_s_for_a_server_whose_connects_time_out(redis_server, redis_url):
    """The README's '(with auto) no answer within ~10 s': a server whose connects time out (not
    refused) stopped the probe after its first connect's three tries (~1.6 s). A server that
    starts answering 3 s in is found."""
    from urllib.parse import urlsplit

    where = urlsplit(redis_url)
    front = _SlowToAccept((where.hostname, where.port), open_after_s=3.0)
    try:
        url = redis_url.replace(f"{where.hostname}:{where.port}", f"127.0.0.1:{front.port}")
        assert check_redis(url) is False
    finally:
        front.close()


@pytest.mark.slow
def test_a_worker_started_before_its_redis_waits_for_it_then_serves():
    """The README: with ``--redis-cluster no``, a server not up yet is not an error. A worker with
    the default budget (fitted to the latency goal after its warm-up, then read again from Redis:
    that second read exited it with a traceback) waits, and serves once the server is up."""
    import threading
    import time

    from gateway_support import running_gateway

    from tokq import Client
    from tokq.model.info import ModelInfo
    from tokq.queue.keys import QueueKeys
    from tokq.redis.embedded import EmbeddedRedis

    server = EmbeddedRedis()  # its address and password known, not started yet
    env = {**os.environ, "TOKQ_REDIS_URL": server.url, "PYTHONUNBUFFERED": "1"}
    env.pop("TOKQ_LATENCY_GOAL_MS", None)  # the default goal: the budget is fitted
    worker = subprocess.Popen([sys.executable, "-m", "tokq.cli", "worker", "--worker-id", "early",
                               "--redis-cluster", "no"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(worker.stdout), daemon=True)
    reader.start()

    def await_line(needle: str, after: int = -1) -> int:
        """The index of the first line past ``after`` that holds ``needle``."""
        while (found := next((i for i, line in enumerate(list(lines)) if i > after and needle in line),
                             None)) is None:
            assert worker.poll() is None, "".join(lines[-20:])
            assert time.monotonic() < deadline, f"no {needle!r} line:\n" + "".join(lines[-20:])
            time.sleep(0.1)
        return found

    try:
        deadline = time.monotonic() + 120  # load, warm-up and fit took 15 s with both cores busy
        # The fit's one line, whichever budget it chose: a slow or loaded host cuts the
        # default ("budget 1024 -> N tokens"), a fast one keeps it ("its forward took").
        fitted = await_line("; p99 goal ")
        await_line("reading the shard count and budget failed", after=fitted)  # read again, failing
        assert worker.poll() is None, "".join(lines[-20:])
        server.start()
        try:
            client = redis.Redis.from_url(server.url)
            heartbeat = QueueKeys(ModelInfo.load().queue_name).heartbeat("early")
            while not client.exists(heartbeat):
                assert worker.poll() is None, "".join(lines[-20:])
                assert time.monotonic() < deadline + 60, "no heartbeat once Redis was up"
                time.sleep(0.1)
            with running_gateway(server.url) as port, Client(f"127.0.0.1:{port}") as c:
                assert c.embed(["served once Redis came up"], timeout=60).shape == (1, 384)
        finally:
            server.close()
    finally:
        worker.terminate()
        worker.wait(30)
    assert not any("Traceback" in line for line in lines), "".join(lines)


async def test_a_worker_fits_its_budget_while_redis_is_down(caplog):
    """The fit needs no Redis: with nothing listening and the forward modelled over the default
    goal (0.4 ms a token: 1,024 tokens 410 ms, over the 250 ms allowed), the worker cuts its
    default between its two failed budget reads, before its first claim, and then claims."""
    import asyncio
    import logging
    import time
    from types import SimpleNamespace

    from tokq.config import QueueConfig, WorkerConfig
    from tokq.latency_goal import DEFAULT_SLO_P99_MS
    from tokq.queue.sharded import ShardedQueue
    from tokq.redis.connection import close_client, connect
    from tokq.workers.budget import STEP, default_budget
    from tokq.workers.worker import Worker

    caplog.set_level(logging.INFO, logger="tokq.worker")
    engine = SimpleNamespace(device=SimpleNamespace(type="cpu"), capture_graphs=lambda num_tokens: 0,
                             warmup=lambda num_tokens: time.sleep(num_tokens * 0.0004),
                             info=SimpleNamespace(name="modelled", config={}, max_length=512))
    client = connect(f"redis://127.0.0.1:{free_port()}/0", cluster="no")
    config = WorkerConfig(latency_goal_ms=int(DEFAULT_SLO_P99_MS), token_budget=0)
    worker = Worker(engine, ShardedQueue(client, "modelled", QueueConfig()), config, QueueConfig(),
                    worker_id="fit-offline")

    def messages() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "tokq.worker"]

    run = asyncio.create_task(worker.run())
    try:
        deadline = time.monotonic() + 60
        while not any(m.startswith("claim failed") for m in messages()):
            assert not run.done() and time.monotonic() < deadline, "\n".join(messages())
            await asyncio.sleep(0.05)
        worker.stop()
        await asyncio.wait_for(run, 30)
    finally:
        run.cancel()
        await close_client(client)
    assert worker.budget.source == "fitted" and STEP <= worker.budget.tokens < default_budget("cpu")
    steps = [m for m in messages() if m.startswith(("reading the shard count", "budget ", "claim failed"))]
    assert [m.split(" ")[0] for m in steps[:4]] == ["reading", "budget", "reading", "claim"], steps
    assert steps[1].startswith(f"budget {default_budget('cpu')} -> {worker.budget.tokens} tokens"), steps[1]


@pytest.mark.parametrize("mode", ["auto", "no"])
def test_a_sentinel_is_one_line_naming_it(tmp_path, mode):
    """A Sentinel answers PING and INFO, so it passed for a standalone server; every queue
    command then failed (EVALSHA: unknown command)."""
    from cluster_support import running_sentinel

    with running_sentinel(tmp_path) as url, pytest.raises(RedisSetupError, match="is a Sentinel"):
        check_redis(url, mode)
