"""Security: gRPC over TLS (a real TLS channel, certificates made here with `cryptography`),
mutual TLS refusing a client without a certificate, API keys (UNAUTHENTICATED without one, health
open), reflection that can be turned off, metrics on their own address, Redis reached over TLS."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import shutil
import subprocess
import sys
import urllib.request

import grpc
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway_support import left_for_the_gc, running_gateway
from tokq import Client, TokqError
from tokq.redis.embedded import EmbeddedRedis, free_port


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool, server: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, as files."""
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("tokq test CA", ca_key, _name("tokq test CA"), ca_key, ca=True)
    files = {"ca": ca}
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        files[role] = _issue(f"tokq {role}", key, ca.subject, ca_key, ca=False, server=role == "server")
        files[f"{role}_key"] = key
    paths = {}
    for name, obj in files.items():
        paths[name] = d / f"{name}.pem"
        paths[name].write_bytes(_pem(obj))
    return paths


def _reference_ids(text: str) -> list[int]:
    from transformers import AutoTokenizer

    from tokq.model.info import bundled_model_path

    return AutoTokenizer.from_pretrained(str(bundled_model_path()))(text)["input_ids"]


# Health answers (no worker runs in these tests, so readiness says NOT_SERVING): reachable is the point.
ANSWERED = (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)


def _health(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_tls_serves_over_a_real_tls_channel_and_refuses_plaintext(redis_url, pki):
    with running_gateway(redis_url, tls_cert=str(pki["server"]), tls_key=str(pki["server_key"])) as port:
        creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
        with Client(f"127.0.0.1:{port}", credentials=creds) as client:
            assert client.info(timeout=10).model == "all-MiniLM-L6-v2"
            assert client.tokenize(["over TLS"], timeout=10) == [_reference_ids("over TLS")]
        with Client(f"127.0.0.1:{port}") as plain, pytest.raises(TokqError) as err:
            plain.info(timeout=5)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
            assert _health(channel) in ANSWERED


def test_mutual_tls_refuses_a_client_without_a_certificate(redis_url, pki):
    with running_gateway(redis_url, tls_cert=str(pki["server"]), tls_key=str(pki["server_key"]),
                         tls_client_ca=str(pki["ca"])) as port:
        anonymous = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
        with Client(f"127.0.0.1:{port}", credentials=anonymous) as client, pytest.raises(TokqError) as err:
            client.info(timeout=5)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        with_cert = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes(),
                                                 private_key=pki["client_key"].read_bytes(),
                                                 certificate_chain=pki["client"].read_bytes())
        with Client(f"127.0.0.1:{port}", credentials=with_cert) as client:
            assert client.info(timeout=10).dimensions == 384


def test_api_keys_are_required_except_for_health(redis_url, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# one key per line\nfile-key-123\n")
    with running_gateway(redis_url, api_keys=("flag-key-456",), api_key_file=str(key_file)) as port:
        target = f"127.0.0.1:{port}"
        for key in ("flag-key-456", "file-key-123"):
            with Client(target, api_key=key) as client:
                assert client.info(timeout=10).model == "all-MiniLM-L6-v2"
                assert client.tokenize(["keyed"], timeout=10) == [_reference_ids("keyed")]
        for key, needle in ((None, "an API key is required"), ("wrong", "not accepted"),
                            ("flag-key-45", "not accepted")):
            with Client(target, api_key=key) as client, pytest.raises(TokqError) as err:
                client.embed(["no entry"], timeout=10)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and needle in err.value.message

        def refused():
            with Client(target, api_key="wrong") as client, pytest.raises(TokqError):
                client.embed(["no entry"], timeout=10)
        assert left_for_the_gc(refused) == []  # gateway.errors.refuse, not context.abort()
        with grpc.insecure_channel(target) as channel:
            assert _health(channel) in ANSWERED  # probes carry no key
            with pytest.raises(grpc.RpcError) as err:  # reflection describes the API: keyed too
                list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_reflection_can_be_turned_off_and_metrics_bind_their_own_address(redis_url):
    metrics_port = free_port()
    with running_gateway(redis_url, reflection=False, metrics_port=metrics_port,
                         host="127.0.0.1", metrics_host="127.0.0.1") as port:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
        assert b"tokq_" in body


@pytest.mark.slow
def test_embedded_redis_password_is_in_a_private_file_not_on_its_command_line():
    import os
    import stat

    import redis

    from tokq.redis.embedded import EmbeddedRedis, redact_url

    with EmbeddedRedis() as server:
        assert len(server.password) >= 20 and server.host == "127.0.0.1"
        # Written 0600 for the server to read at start, then removed: on no disk while it runs.
        assert not os.path.exists(os.path.join(server._dir, "redis.conf"))
        written = server._write_config()
        assert stat.S_IMODE(os.stat(written).st_mode) == 0o600
        os.unlink(written)
        server.stop()
        server.start()  # and so again for a restart (tokq up restarts a Redis that died)
        assert not os.path.exists(os.path.join(server._dir, "redis.conf"))
        assert server.password.encode() not in open(f"/proc/{server._proc.pid}/cmdline", "rb").read()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=server.host, port=server.port).ping()
        assert redis.Redis.from_url(server.url).ping()
        assert server.password not in redact_url(server.url) and "***" in redact_url(server.url)


def test_http_api_takes_the_same_keys_and_tls(redis_url, pki):
    import ssl

    import httpx

    http_port = free_port()
    with running_gateway(redis_url, http_port=http_port, api_keys=("http-key-789",),
                         tls_cert=str(pki["server"]), tls_key=str(pki["server_key"])):
        base = f"https://127.0.0.1:{http_port}"
        with httpx.Client(verify=ssl.create_default_context(cafile=str(pki["ca"])), timeout=30) as http:
            assert http.get(f"{base}/health").status_code == 200  # open for probes
            assert http.get(f"{base}/ready").status_code in (200, 503)  # (no worker here) not 401
            for headers in ({}, {"authorization": "Bearer nope"}):
                resp = http.post(f"{base}/v1/embeddings", json={"input": "hi"}, headers=headers)
                assert resp.status_code == 401 and resp.json()["error"]["code"] == "unauthenticated"
                assert http.get(f"{base}/v1/models", headers=headers).status_code == 401
            models = http.get(f"{base}/v1/models", headers={"authorization": "Bearer http-key-789"})
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "all-MiniLM-L6-v2"
        with httpx.Client(timeout=10) as plain, pytest.raises(httpx.HTTPError):
            plain.get(f"http://127.0.0.1:{http_port}/health")


def test_http_api_takes_mutual_tls_too(redis_url, pki):
    import ssl

    import httpx

    http_port = free_port()
    with running_gateway(redis_url, http_port=http_port, tls_cert=str(pki["server"]),
                         tls_key=str(pki["server_key"]), tls_client_ca=str(pki["ca"])):
        base = f"https://127.0.0.1:{http_port}"
        anonymous = ssl.create_default_context(cafile=str(pki["ca"]))
        with httpx.Client(verify=anonymous, timeout=10) as http, pytest.raises(httpx.HTTPError):
            http.get(f"{base}/health")
        with_cert = ssl.create_default_context(cafile=str(pki["ca"]))
        with_cert.load_cert_chain(str(pki["client"]), str(pki["client_key"]))
        with httpx.Client(verify=with_cert, timeout=30) as http:
            assert http.get(f"{base}/health").status_code == 200


@pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.2 is a loopback address on Linux only")
def test_metrics_are_off_unless_a_port_is_set_and_bind_the_grpc_host_by_default(redis_url):
    from service_stack import listening_ports

    before = listening_ports(os.getpid())
    with running_gateway(redis_url) as port:  # no metrics port: nothing listens but gRPC
        assert listening_ports(os.getpid()) - before == {port}
    metrics_port = free_port()
    with running_gateway(redis_url, host="127.0.0.2", metrics_port=metrics_port):  # no metrics host
        body = urllib.request.urlopen(f"http://127.0.0.2:{metrics_port}/metrics", timeout=10).read()
        assert b"tokq_" in body
        with pytest.raises(OSError):  # the gRPC host's address only
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)


@pytest.fixture
def tls_redis_url(pki):
    """A real Redis serving TLS only (Debian's redis-server, built with TLS; CI installs it), as
    the rediss:// URL a deployment gives: the CA that signed its certificate in the query."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary (Debian's has TLS; .ci/run installs it)")
    server = EmbeddedRedis(binary, tls={"cert": str(pki["server"]), "key": str(pki["server_key"]),
                                        "ca": str(pki["ca"])})
    try:
        server.start(timeout_s=30)
    except Exception as exc:  # it stopped the server; its folder goes too
        server.close()
        if "Bad directive" in str(exc) and "tls" in str(exc):  # a build without TLS refuses the options
            pytest.skip(f"this redis-server has no TLS: {exc}")
        raise
    with contextlib.closing(server):
        yield server.url


@pytest.mark.slow
def test_gateway_and_worker_reach_redis_over_tls_with_a_rediss_url(tls_redis_url):
    # The README: "rediss:// for TLS". The server speaks TLS only: plaintext is not answered.
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(tls_redis_url.replace("rediss://", "redis://").split("?")[0],
                             socket_timeout=2).ping()
    worker = subprocess.Popen([sys.executable, "-m", "tokq.cli", "worker", "--device", "cpu", "--threads", "1"],
                              env={**os.environ, "TOKQ_REDIS_URL": tls_redis_url})
    try:
        with running_gateway(tls_redis_url) as port, Client(f"127.0.0.1:{port}") as client:
            vectors = client.embed(["over TLS to Redis", "and back"], timeout=120)
            assert vectors.shape == (2, 384)
            assert abs(float((vectors[0] ** 2).sum()) - 1) < 1e-4
    finally:
        worker.terminate()
        try:
            code = worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            code = worker.wait()
    assert code == 0  # a clean stop: its Redis link was sound to the end
