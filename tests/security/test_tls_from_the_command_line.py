"""TLS from the command line: `tokq embed --tls-ca/--tls-cert/--tls-key` calling a real gateway
served over TLS (and mutual TLS), and `tokq up` serving TLS from its TOKQ_TLS_* settings: its
readiness check spoke plaintext and waited for ever. Certificates:
tests/security/test_tls_and_api_keys.py's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from gateway_support import running_gateway
from service_stack import ctrl_c_reaches_it, read_until_serving
from test_tls_and_api_keys import pki  # noqa: F401 (the fixture: a CA, server and client certificates)
from tokq.redis.embedded import EmbeddedRedis, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served_redis():
    """A Redis with a real worker on it: the gateways below get their calls answered."""
    server = EmbeddedRedis().start()
    worker = subprocess.Popen([sys.executable, "-m", "tokq.cli", "worker", "--device", "cpu",
                               "--threads", "1"], env={**os.environ, "TOKQ_REDIS_URL": server.url})
    try:
        yield server.url
    finally:
        worker.terminate()
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        server.close()


def _embed(port: int | None, *args: str, env: dict | None = None, timeout: str = "120"):
    target = ["--target", f"127.0.0.1:{port}"] if port else []
    return subprocess.run([sys.executable, "-m", "tokq.cli", "embed", *target, "--timeout", timeout, *args,
                           "over TLS"], capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=180)


def _served(run) -> bool:
    assert "Traceback" not in run.stderr and "is not a tokq setting" not in run.stderr, run.stderr
    if run.returncode:
        return False
    assert json.loads(run.stdout)["model"] == "all-MiniLM-L6-v2"
    return True


def test_tokq_embed_calls_a_gateway_served_over_tls(served_redis, pki):
    with running_gateway(served_redis, tls_cert=str(pki["server"]), tls_key=str(pki["server_key"])) as port:
        assert _served(_embed(port, "--tls-ca", str(pki["ca"])))
        assert _served(_embed(port, env={"TOKQ_TLS_CA": str(pki["ca"])}))  # known: no misspelt-name warning
        plain = _embed(port, timeout="10")  # plaintext to a TLS gateway: refused, one JSON error line
        assert plain.returncode == 1, plain.stderr
        assert json.loads(plain.stderr.splitlines()[-1])["error"]["code"] == "UNAVAILABLE"


def test_tokq_embed_presents_a_client_certificate_to_a_mutual_tls_gateway(served_redis, pki):
    with running_gateway(served_redis, tls_cert=str(pki["server"]), tls_key=str(pki["server_key"]),
                         tls_client_ca=str(pki["ca"])) as port:
        assert not _served(_embed(port, "--tls-ca", str(pki["ca"]), timeout="10"))  # no certificate
        assert _served(_embed(port, "--tls-ca", str(pki["ca"]), "--tls-cert", str(pki["client"]),
                              "--tls-key", str(pki["client_key"])))
        assert _served(_embed(port, env={"TOKQ_TLS_CA": str(pki["ca"]),
                                         "TOKQ_CLIENT_TLS_CERT": str(pki["client"]),
                                         "TOKQ_CLIENT_TLS_KEY": str(pki["client_key"])}))


@pytest.mark.parametrize("args,message", [
    (["--tls-ca", "/nonexistent/ca.pem"],
     "--tls-ca '/nonexistent/ca.pem': No such file or directory (TOKQ_TLS_CA)"),
    (["--tls-ca", "{ca}", "--tls-cert", "{client}", "--tls-key", "/"], "--tls-key '/': Is a directory"),
    (["--tls-ca", "{not_pem}"], "is not a PEM file (TOKQ_TLS_CA)"),
    (["--tls-cert", "{client}"], "--tls-cert and --tls-key go together"),
])
def test_tokq_embed_refuses_certificate_files_it_cannot_use_in_one_line(pki, tmp_path, args, message):
    (not_pem := tmp_path / "not.pem").write_text("not a certificate\n")
    files = {"ca": pki["ca"], "client": pki["client"], "not_pem": not_pem}
    run = _embed(free_port(), *(arg.format(**files) for arg in args))
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("Error: ") and message in run.stderr, run.stderr


def _up(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tokq.cli", "up", "--port", str(free_port()),
                             "--http-port", str(free_port()), "--metrics-port", "0", "--gateway-procs", "1",
                             *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, preexec_fn=ctrl_c_reaches_it)


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_tokq_up_serves_tls_from_its_environment_and_prints_lines_that_work(pki, mutual):
    env = {"TOKQ_TLS_CERT": str(pki["server"]), "TOKQ_TLS_KEY": str(pki["server_key"])}
    if mutual:  # the client certificate: tokq embed's names, read by tokq up's readiness check too
        env |= {"TOKQ_TLS_CLIENT_CA": str(pki["ca"]), "TOKQ_TLS_CA": str(pki["ca"]),
                "TOKQ_CLIENT_TLS_CERT": str(pki["client"]), "TOKQ_CLIENT_TLS_KEY": str(pki["client_key"])}
    proc = _up(env)
    try:
        lines = read_until_serving(proc, timeout_s=150)  # it said "no worker ready yet" for ever
        text = "".join(lines)
        assert ("mutual TLS, health" if mutual else "(TLS, health") in text
        roots = pki["ca"] if mutual else pki["server"]  # without TOKQ_TLS_CA: the certificate itself
        embed = next(line.split("try:", 1)[1].strip() for line in lines if "try:" in line)
        assert f"--tls-ca {roots}" in embed
        assert (f"--tls-cert {pki['client']} --tls-key {pki['client_key']}" in embed) == mutual
        curl = next(line.strip() for line in lines if line.strip().startswith("curl "))
        assert "curl https://" in curl and f"--cacert {roots}" in curl
        assert "grpcurl -cacert" in text and "-plaintext" not in text
        # the printed line, run without the client's variables: the line carries what it needs
        clean = {k: v for k, v in os.environ.items()
                 if not k.startswith(("TOKQ_TLS", "TOKQ_CLIENT_TLS"))}
        cli = subprocess.run(embed, shell=True, capture_output=True, text=True, timeout=120, env=clean)
        assert cli.returncode == 0 and '"model": "all-MiniLM-L6-v2"' in cli.stdout, cli.stderr
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)


@pytest.mark.parametrize("env,message", [
    ({"TOKQ_TLS_CLIENT_CA": "{ca}"}, "tls_client_ca (mutual TLS) needs a client certificate for tokq up's "
                                     "readiness check"),
    ({"TOKQ_TLS_CA": "/nonexistent/ca.pem"}, "tls_ca '/nonexistent/ca.pem': No such file or directory "
                                             "(flag --tls-ca, env TOKQ_TLS_CA)"),
    ({"TOKQ_TLS_KEY": "{not_pem}"}, "is not a PEM file (flag --tls-key, env TOKQ_TLS_KEY)"),
])
def test_tokq_up_refuses_tls_it_cannot_check_before_starting_anything(pki, tmp_path, env, message):
    (not_pem := tmp_path / "not.pem").write_text("not a key\n")
    files = {"ca": pki["ca"], "not_pem": not_pem}
    env = {"TOKQ_TLS_CERT": str(pki["server"]), "TOKQ_TLS_KEY": str(pki["server_key"]),
           **{k: v.format(**files) for k, v in env.items()}}
    proc = _up(env)
    try:
        out, _ = proc.communicate(timeout=60)  # it started everything and waited for ever
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
    assert proc.returncode in (1, 2) and "Traceback" not in out, out
    assert out.strip().splitlines()[-1].startswith("Error: ") and message in out, out
    assert "Redis" not in out  # stopped before the embedded Redis started
