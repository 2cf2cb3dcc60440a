"""`tokq up` (what `make run` starts): serves the bundled model, Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import redis

from tokq.profiling.bench import proc_cpu
from tokq.redis.embedded import free_port, free_port_block
from service_stack import (alive, ctrl_c_reaches_it, embed_counts, listening_ports, needs_ipv6,
                           read_until_serving)

pytestmark = pytest.mark.slow


def test_tokq_up_serves_and_ctrl_c_stops_everything():
    from tokq import Client, TokqError

    port, http_port = free_port(), free_port()
    # PATH as in a new user's shell after `make run`: without the venv's bin directory
    venv_bin = os.path.dirname(sys.executable)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PATH": os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep) if d != venv_bin)}
    proc = subprocess.Popen([sys.executable, "-m", "tokq.cli", "up", "--port", str(port), "--workers", "2",
                             "--metrics-port", "0", "--http-port", str(http_port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, preexec_fn=ctrl_c_reaches_it)
    lines = []
    try:
        lines += read_until_serving(proc)
        text = "".join(lines)
        assert f"127.0.0.1:{port}" in text and "tokq embed" in text and "redis://" in text
        children = proc_cpu.children(proc.pid)
        assert len(children) == 4  # Redis, gateway, two workers
        # The workers split the cores but one (left to the gateway and Redis), one thread at least
        threads = [int(args[args.index("--threads") + 1])
                   for args in map(proc_cpu.cmdline, children) if "--threads" in args]
        assert threads == [max(1, (os.cpu_count() - 1) // 2)] * 2
        # The embedded Redis has a generated password; no child has it on its command line
        # (readable by any local user with ps) and it is not printed.
        envs = [dict(kv.split(b"=", 1) for kv in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                     if b"=" in kv) for pid in children]
        url = next(e[b"TOKQ_REDIS_URL"] for e in envs if b"TOKQ_REDIS_URL" in e).decode()
        password = redis.connection.parse_url(url)["password"]
        assert password and len(password) >= 20 and password not in text
        for pid in children:
            assert not any(password in arg for arg in proc_cpu.cmdline(pid))
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url.replace(password, "wrong")).ping()
        with Client(f"127.0.0.1:{port}") as client:
            vectors = client.embed(["make run works", "and answers"], timeout=60)
        assert vectors.shape == (2, 384)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        # the `tokq embed` line as printed, from that shell (it said `tokq`, which it does not find)
        embed = next(line.split("try:", 1)[1].strip() for line in lines if "try:" in line)
        cli = subprocess.run(embed, shell=True, capture_output=True, text=True, timeout=60, env=env)
        assert cli.returncode == 0 and '"model": "all-MiniLM-L6-v2"' in cli.stdout, cli.stderr
        # the HTTP API, with the curl line tokq up printed
        curl = next(line.strip() for line in lines if line.strip().startswith("curl "))
        assert f"http://127.0.0.1:{http_port}/v1/embeddings" in curl
        out = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=60).stdout
        assert np.array(json.loads(out)["data"][0]["embedding"]).shape == (384,)
        # A worker that dies is started again (the supervisor a worker's exit code 3 asks for):
        # both killed, so the call after it is served by restarted ones
        workers = [pid for pid in children if "--worker-id" in proc_cpu.cmdline(pid)]
        for i, name in ((1, "up-1"), (0, "up-0")):
            os.kill(next(pid for pid in workers if name in proc_cpu.cmdline(pid)), signal.SIGKILL)
            _read_until(proc, f"worker {i} exited (-9); restarting it")
        deadline = time.monotonic() + 60
        while len(children := proc_cpu.children(proc.pid)) < 4 or set(workers) & set(children):
            assert time.monotonic() < deadline, "the workers were not started again"
            time.sleep(0.2)
        # Started again is not ready yet: each loads the model and warms up, which on a loaded
        # machine outlasted one call's longest deadline (the gateway's 30 s default): asked again.
        with Client(f"127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 180
            while True:
                try:
                    assert client.embed(["still served"], timeout=30).shape == (1, 384)
                    break
                except TokqError as exc:
                    assert exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() < deadline, exc
    finally:
        _stop(proc)
    assert _all_gone(children)


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C a tokq up still running (a test that failed midway), its output drained."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)  # drained: a full pipe would block its exit


def _all_gone(pids) -> bool:
    time.sleep(0.5)  # reaped by the kernel after their parent's exit
    return [pid for pid in pids if alive(pid)] == []


def _read_until(proc: subprocess.Popen, needle: str, timeout_s: float = 300) -> None:
    """Read `tokq up`'s output (its children's log lines share the pipe) up to a line with
    ``needle``; fails if it exits first, or at the first line after ``timeout_s``."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while needle not in (line := proc.stdout.readline()):
        assert line, "tokq up exited:\n" + "".join(seen[-20:])
        assert time.monotonic() < deadline, f"no {needle!r} from tokq up:\n" + "".join(seen[-20:])
        seen.append(line)


def _role(pid: int) -> str:
    """What a child of `tokq up` runs: "redis", "gateway" or "worker" ("up" before its exec)."""
    args = proc_cpu.cmdline(pid)
    if len(args) > 3 and args[1:3] == ["-m", "tokq.cli"]:
        return args[3]
    return "redis" if args else "gone"


def _redis_child(pid: int) -> int | None:
    """`tokq up`'s embedded Redis."""
    return next((c for c in proc_cpu.children(pid) if _role(c) == "redis"), None)


def test_tokq_up_restarts_its_redis_and_a_stop_signalled_twice_still_stops_everything(tmp_path):
    """The embedded Redis killed: `tokq up` starts it again on its port and the service comes back.
    SIGHUP (the terminal closed) stops everything as Ctrl-C does, and a second signal while it
    stops does not cut that short: once it left the embedded Redis running, its directory (the
    password file) behind, and SIGHUP ended `tokq up` at once."""
    from tokq import Client, TokqError

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokq.cli", "up", "--port", str(port), "--http-port", "0",
                             "--gateway-procs", "1", "--metrics-port", str(free_port_block(2))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)},
                            preexec_fn=ctrl_c_reaches_it)
    children: list[int] = []
    try:
        read_until_serving(proc)
        redis_pid = _redis_child(proc.pid)
        os.kill(redis_pid, signal.SIGKILL)
        _read_until(proc, "the embedded Redis exited; restarting it", timeout_s=30)
        with Client(f"127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 120
            while True:  # the workers find the new server and claim again
                try:
                    assert client.embed(["after a Redis restart"], timeout=30).shape == (1, 384)
                    break
                except TokqError as exc:
                    assert time.monotonic() < deadline, exc
                    time.sleep(0.5)
        children = proc_cpu.children(proc.pid)
        assert len(children) == 3 and redis_pid not in children
        proc.send_signal(signal.SIGHUP)
        _read_until(proc, "stopping tokq", timeout_s=30)
        proc.send_signal(signal.SIGHUP)  # while the gateway and the worker stop
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    finally:
        _stop(proc)
    assert children and _all_gone(children)
    assert list(tmp_path.glob("tokq-redis-*")) == []


def test_a_closed_terminal_stops_tokq_up_and_then_its_children_in_order():
    """A terminal's hang-up reaches its whole process group: the gateway and workers died of it
    where they stood (no withdrawals, claims held to their lease, heartbeats left); now they
    ignore it and `tokq up` stops them as on Ctrl-C. Its Redis is the test's, to look after."""
    from tokq.redis.embedded import EmbeddedRedis

    server = EmbeddedRedis().start()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "tokq.cli", "up", "--port", str(free_port()),
                                 "--http-port", "0", "--metrics-port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "TOKQ_REDIS_URL": server.url},
                                preexec_fn=ctrl_c_reaches_it, start_new_session=True)  # its own group
        try:
            read_until_serving(proc)
            client = redis.Redis.from_url(server.url)
            assert client.keys("*:heartbeat:*")
            os.killpg(proc.pid, signal.SIGHUP)
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, out
        finally:
            _stop(proc)
        assert client.keys("*:heartbeat:*") == []  # each worker stopped cleanly, forgetting itself
    finally:
        server.close()


def test_tokq_up_killed_outright_takes_its_redis_with_it():
    """kill -9 of `tokq up` (the OOM killer): its children die with it, the embedded Redis too
    (in a session of its own, so that Ctrl-C reaches it only through tokq up, after the rest)."""
    proc = subprocess.Popen([sys.executable, "-m", "tokq.cli", "up", "--port", str(free_port()),
                             "--http-port", "0", "--metrics-port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[int] = []
    redis_dir = None
    try:
        deadline = time.monotonic() + 60
        # Redis, gateway and worker started: each past its exec, so its PR_SET_PDEATHSIG is set
        while sorted(map(_role, children := proc_cpu.children(proc.pid))) != ["gateway", "redis", "worker"]:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        redis_pid = _redis_child(proc.pid)
        redis_dir = os.readlink(f"/proc/{redis_pid}/cwd")  # its --dir, to clean up below
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while left := [pid for pid in children if alive(pid)]:
            assert time.monotonic() < deadline, f"outlived tokq up: {[proc_cpu.cmdline(p) for p in left]}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if redis_dir:
            shutil.rmtree(redis_dir, ignore_errors=True)


@pytest.mark.parametrize("taken,args,message", [
    ("port", [], "gRPC port {taken} on 127.0.0.1 already in use (another tokq up?)"),
    ("metrics+1", [], "metrics port {taken} on 127.0.0.1 already in use (another tokq up?)"),  # the worker's
    (None, ["--redis-server", "/bin/false"], "the embedded Redis did not start: /bin/false on port"),
])
def test_tokq_up_that_cannot_start_says_why_in_one_line_and_leaves_nothing(tmp_path, taken, args, message):
    """A port another process listens on (another `tokq up`), or a Redis server that does not start:
    one line, nothing started or left on disk. A metrics port's was a traceback from the child that
    found it taken, and a server that did not start left its directory with the password file."""
    port, metrics_port = free_port(), free_port_block(2)
    taken = {"port": port, "metrics+1": metrics_port + 1, None: None}[taken]
    with socket.socket() as holder:
        if taken:
            holder.bind(("127.0.0.1", taken))
            holder.listen()
        out = subprocess.run([sys.executable, "-m", "tokq.cli", "up", "--port", str(port), "--http-port", "0",
                              "--gateway-procs", "1",  # one gateway and one worker: a block of 2 ports
                              "--metrics-port", str(metrics_port), *args], capture_output=True, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("Error: " + message.format(taken=taken)), out.stderr
    assert list(tmp_path.glob("tokq-redis-*")) == []


def test_tokq_up_waits_for_a_slow_model_load_and_says_so(monkeypatch, capsys):
    """A worker still loading a large model when the wait's period ends: `tokq up` says it still
    waits, and goes on (it gave up after 120 s, stopping the worker it waited for)."""
    from tokq import up
    from tokq.processes import NotHealthy

    waits = []

    def loading(target, procs, timeout_s, credentials=None):
        waits.append(timeout_s)
        if len(waits) < 3:
            raise NotHealthy(target, "")

    monkeypatch.setattr(up, "wait_for_health", loading)
    up._wait_ready("127.0.0.1:1", [], report_every_s=0, check_every_s=30)
    assert waits == [30, 30, 30]
    assert capsys.readouterr().err.count("no worker ready yet (loading the model") == 2


def test_tokq_up_restarts_its_redis_while_waiting_for_readiness(monkeypatch, capsys):
    """Its Redis dead during start-up (the OOM killer during a model load), nothing would ever
    become ready: `tokq up` said it waited for the model, forever."""
    import signal as signals

    from tokq import up
    from tokq.processes import NotHealthy
    from tokq.redis.embedded import EmbeddedRedis

    server = EmbeddedRedis().start()
    try:
        port, waits = server.port, []

        def not_ready(target, procs, timeout_s, credentials=None):
            waits.append(server.running)
            if len(waits) < 2:
                raise NotHealthy(target, "")

        monkeypatch.setattr(up, "wait_for_health", not_ready)
        server._proc.send_signal(signals.SIGKILL)
        server._proc.wait()
        up._wait_ready("127.0.0.1:1", [], server, check_every_s=0.1)
        assert waits == [False, True] and server.running and server.port == port
        assert "the embedded Redis exited; restarting it" in capsys.readouterr().err
    finally:
        server.close()


def test_tokq_ups_http_port_defaults_to_8080():
    # The README's `curl localhost:8080` relies on this default (the serving test above runs
    # the API on a free port; the one below turns it off with --http-port 0).
    from tokq import config as cfg

    assert cfg.load(cfg.UpConfig, {}, env={}).http_port == 8080  # no flag, no TOKQ_HTTP_PORT


def test_tokq_up_spreads_calls_over_gateway_processes():
    """`tokq up --gateway-procs 2`: two gateway processes share the gRPC port, each serves its
    metrics (port +0, +1), the worker's come after them (+2), a client's calls reach both, and
    one of them dying stops tokq up (exit status 1) and everything it started."""
    from tokq import Client
    from tokq.profiling.bench.spread import gateway_children

    port, metrics_port = free_port(), free_port_block(3)
    proc = subprocess.Popen([sys.executable, "-m", "tokq.cli", "up", "--port", str(port), "--gateway-procs", "2",
                             "--metrics-port", str(metrics_port), "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "TOKQ_LATENCY_GOAL_MS": "0"},
                            preexec_fn=ctrl_c_reaches_it)
    gateways: list[int] = []
    everything: list[int] = []
    try:
        text = "".join(read_until_serving(proc))
        assert "2 gateway process(es), 1 worker(s)" in text
        assert f":{metrics_port}/metrics (and :{metrics_port + 1}), worker 0 :{metrics_port + 2}" in text
        assert "HTTP:" not in text  # --http-port 0: no HTTP API
        gateway_parent = next(pid for pid in proc_cpu.children(proc.pid) if "gateway" in proc_cpu.cmdline(pid))
        gateways = gateway_children(gateway_parent)
        assert len(gateways) == 2
        deadline = time.monotonic() + 90
        while True:  # the health check answered from one process; wait for both
            try:
                before = embed_counts([metrics_port, metrics_port + 1])
                break
            except OSError:
                assert time.monotonic() < deadline, "a gateway process never served metrics"
                time.sleep(0.2)
        # Each process listens on the shared gRPC port and its metrics port only: no HTTP port.
        assert {frozenset(listening_ports(pid)) for pid in gateways} == {
            frozenset({port, metrics_port}), frozenset({port, metrics_port + 1})}
        with Client(f"127.0.0.1:{port}") as client:  # it spreads calls over the processes it finds
            for i in range(40):
                assert client.embed([f"spread call {i}"], timeout=60).shape == (1, 384)
        after = embed_counts([metrics_port, metrics_port + 1])
        per_gateway = [a - b for a, b in zip(after, before)]
        assert sum(per_gateway) == 40 and min(per_gateway) >= 1, per_gateway
        worker_page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port + 2}/metrics", timeout=10).read()
        assert b"tokq_worker_" in worker_page
        # on tokq up's host (loopback by default), as the gateways' are; not on every interface
        assert _listen_addresses(metrics_port + 2) == {"127.0.0.1"}
        # One gateway process dying ends the gateway, and tokq up with it: nothing half-serves.
        everything += [*proc_cpu.children(proc.pid), *gateways]
        os.kill(gateways[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1 and "the gateway exited" in out
    finally:
        _stop(proc)
    assert gateways and _all_gone(everything)


@needs_ipv6
def test_tokq_up_serves_on_ipv6_loopback():
    """`tokq up --host ::1`: gRPC, the HTTP API and the gateway's and worker's metrics all answer
    at [::1] (it found no free port there with IPv4 sockets, and wrote ::1:port unbracketed)."""
    from tokq import Client

    port, http_port, metrics_port = free_port("::1"), free_port("::1"), free_port_block(2, "::1")
    proc = subprocess.Popen([sys.executable, "-m", "tokq.cli", "up", "--host", "::1", "--port", str(port),
                             "--http-port", str(http_port), "--metrics-port", str(metrics_port),
                             "--gateway-procs", "1"],  # a block of 2 ports: auto picks more on a GPU host
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=ctrl_c_reaches_it)
    try:
        text = "".join(read_until_serving(proc))
        # quoted: the brackets are a glob to a shell
        assert f"--target '[::1]:{port}'" in text and f"curl 'http://[::1]:{http_port}/v1/embeddings'" in text
        with Client(f"[::1]:{port}") as client:
            assert client.embed(["over IPv6"], timeout=60).shape == (1, 384)
        request = urllib.request.Request(f"http://[::1]:{http_port}/v1/embeddings", method="POST",
                                         data=json.dumps({"input": "over IPv6"}).encode(),
                                         headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert len(reply["data"][0]["embedding"]) == 384
        for metrics, family in ((metrics_port, b"tokq_gateway_"), (metrics_port + 1, b"tokq_worker_")):
            assert family in urllib.request.urlopen(f"http://[::1]:{metrics}/metrics", timeout=10).read()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def _listen_addresses(port: int) -> set[str]:
    """The IPv4 addresses a socket listens on ``port`` at (/proc/net/tcp)."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, local_port = local.split(":")
            if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_tokq_up_takes_api_keys_from_a_flag_and_a_file(tmp_path):
    """`tokq up --api-key K --api-key-file F`: its gateway takes calls with either key only, over
    gRPC and HTTP; the flag's key reaches it in the environment, not on a command line."""
    from tokq import Client, TokqError

    key_file = tmp_path / "keys"
    key_file.write_text("# one per line\nfrom-the-file\n")
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokq.cli", "up", "--port", str(port), "--http-port",
                             str(http_port), "--metrics-port", "0", "--api-key", "from-the-flag",
                             "--api-key-file", str(key_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "TOKQ_LATENCY_GOAL_MS": "0"},
                            preexec_fn=ctrl_c_reaches_it)
    try:
        text = "".join(read_until_serving(proc))
        assert "API keys required" in text and '-H "authorization: Bearer $TOKQ_API_KEY"' in text
        assert "from-the-flag" not in text
        for pid in proc_cpu.children(proc.pid):
            assert "from-the-flag" not in " ".join(proc_cpu.cmdline(pid))
        with Client(f"127.0.0.1:{port}") as client, pytest.raises(TokqError) as err:
            client.embed(["no key"], timeout=60)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        for key in ("from-the-flag", "from-the-file"):
            with Client(f"127.0.0.1:{port}", api_key=key) as client:
                assert client.embed([f"key {key}"], timeout=60).shape == (1, 384)
        url = f"http://127.0.0.1:{http_port}/v1/embeddings"
        body, json_type = json.dumps({"input": "over HTTP"}).encode(), {"Content-Type": "application/json"}
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST", headers=json_type),
                                   timeout=60)
        assert http_err.value.code == 401
        request = urllib.request.Request(url, data=body, method="POST",
                                         headers={**json_type, "Authorization": "Bearer from-the-file"})
        assert len(json.loads(urllib.request.urlopen(request, timeout=60).read())["data"]) == 1
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


@pytest.mark.parametrize("args,message", [
    (["--api-key-file", "/nonexistent/keys"], "api_key_file '/nonexistent/keys': No such file"),
    (["--api-key", "a,b"], "an API key with a comma cannot reach the gateway"),
])
def test_tokq_up_refuses_api_keys_it_cannot_pass_on_before_starting_anything(args, message):
    out = subprocess.run([sys.executable, "-m", "tokq.cli", "up", "--port", str(free_port()), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode in (1, 2) and message in out.stderr
    assert "Redis" not in out.stdout + out.stderr  # stopped before the embedded Redis started


def test_a_worker_that_keeps_dying_is_started_again_ever_later():
    """A worker dying at start (a device it cannot use, out of memory) was started again twice a
    second for ever, loading its model each time. One that ran a while is started at once."""
    from tokq.up import RESTART_MAX_S, RESTART_STABLE_S, RestartBackoff

    again, now, waits = RestartBackoff(0.0), 0.0, []
    for _ in range(7):
        now += 0.5  # dies half a second after each start
        waits.append(again.died(now))
        assert not again.ready(now + waits[-1] - 0.01) and again.ready(now + waits[-1])
        now += waits[-1]
        again.restarted(now)
    assert waits == [1, 2, 4, 8, 16, RESTART_MAX_S, RESTART_MAX_S]
    assert again.died(now + RESTART_STABLE_S) == 0  # it had run a minute: at once


def test_tokq_up_gives_its_workers_the_threads_tokq_threads_says():
    """TOKQ_THREADS (the workers' setting; tokq up has no flag of its own for it) reaches them:
    the --threads tokq up computed went on their command line after it and won, silently."""
    proc = subprocess.Popen([sys.executable, "-m", "tokq.cli", "up", "--port", str(free_port()),
                             "--http-port", "0", "--metrics-port", "0", "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "TOKQ_THREADS": "3"},
                            preexec_fn=ctrl_c_reaches_it)
    try:
        # Serving before Ctrl-C: one sent during start-up can land in a finalizer and be lost
        read_until_serving(proc)
        workers = [args for args in map(proc_cpu.cmdline, proc_cpu.children(proc.pid)) if "--threads" in args]
        assert [args[args.index("--threads") + 1] for args in workers] == ["3", "3"]
    finally:
        _stop(proc)


def test_tokq_up_refuses_a_tokq_threads_out_of_range_before_starting_anything():
    out = subprocess.run([sys.executable, "-m", "tokq.cli", "up", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "TOKQ_THREADS": "-1"})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == ("Error: threads=-1 is out of range, must be 0..4096 (flag "
                                                   "--threads, env TOKQ_THREADS)"), out.stderr
    assert "Redis" not in out.stdout + out.stderr  # stopped before the embedded Redis started


def test_a_stop_signal_swallowed_by_a_finalizer_still_stops_tokq_up():
    """The first Ctrl-C raised KeyboardInterrupt and turned stop signals off; raised inside a
    finalizer (Redis.__del__) Python swallowed it, and tokq up then ignored every later Ctrl-C
    until a SIGKILL. Its loops now check whether a stop was asked for."""
    from tokq.up import StopRequest

    stop = StopRequest()
    stop.check()  # nothing asked: goes on
    try:
        stop.handler()
    except KeyboardInterrupt:
        pass  # what a finalizer's "Exception ignored" does to it
    else:
        raise AssertionError("the first stop signal must interrupt")
    stop.handler()  # a second one does not cut the clean-up short
    with pytest.raises(KeyboardInterrupt):
        stop.check()  # but the loop stops


def test_tokq_threads_0_under_tokq_up_splits_the_cores(monkeypatch):
    """0 is torch's default for one worker; tokq up passing it on gave each of its workers every
    core (oversubscribed). It splits them, as when TOKQ_THREADS is unset; 3 is taken as given."""
    from tokq.up import _worker_threads, threads_per_worker

    monkeypatch.setenv("TOKQ_THREADS", "0")
    assert _worker_threads(2, 8) == threads_per_worker(2, 8) == 3
    monkeypatch.setenv("TOKQ_THREADS", "3")
    assert _worker_threads(4, 8) == 3
