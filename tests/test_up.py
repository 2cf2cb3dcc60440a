"""`tokq up` (what `make run` starts): serves the bundled model, Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import redis

from tokq.redis_server import free_port
from service_stack import ctrl_c_reaches_it, read_until_serving

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes; read its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_tokq_up_serves_and_ctrl_c_stops_everything():
    from tokq import Client

    port, http_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokq.cli", "up", "--port", str(port), "--workers", "2",
                             "--metrics-port", "0", "--http-port", str(http_port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=ctrl_c_reaches_it)
    lines = []
    try:
        lines += read_until_serving(proc)
        text = "".join(lines)
        assert f"127.0.0.1:{port}" in text and "tokq embed" in text and "redis://" in text
        children = _children(proc.pid)
        assert len(children) == 4  # Redis, gateway, two workers
        # The embedded Redis has a generated password; no child has it on its command line
        # (readable by any local user with ps) and it is not printed.
        envs = [dict(kv.split(b"=", 1) for kv in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                     if b"=" in kv) for pid in children]
        url = next(e[b"TOKQ_REDIS_URL"] for e in envs if b"TOKQ_REDIS_URL" in e).decode()
        password = redis.connection.parse_url(url)["password"]
        assert password and len(password) >= 20 and password not in text
        for pid in children:
            assert password.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url.replace(password, "wrong")).ping()
        with Client(f"127.0.0.1:{port}") as client:
            vectors = client.embed(["make run works", "and answers"], timeout=60)
        assert vectors.shape == (2, 384)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        cli = subprocess.run([sys.executable, "-m", "tokq.cli", "embed", "--target", f"127.0.0.1:{port}",
                              "hello"], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and '"model": "all-MiniLM-L6-v2"' in cli.stdout
        # the HTTP API, with the curl line tokq up printed
        curl = next(line.strip() for line in lines if line.strip().startswith("curl "))
        assert f"http://127.0.0.1:{http_port}/v1/embeddings" in curl
        out = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=60).stdout
        assert np.array(json.loads(out)["data"][0]["embedding"]).shape == (384,)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    time.sleep(0.5)
    assert [pid for pid in children if _alive(pid)] == []
