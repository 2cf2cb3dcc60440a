"""The API surface: generated code in sync with the proto, error mapping, config, client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import redis.exceptions

from tokq import config as cfg
from tokq.v1 import generate


def test_generated_code_matches_the_proto(tmp_path):
    fresh = generate.generate(tmp_path)
    committed = Path(generate.__file__).parent
    for path in fresh:
        assert path.read_bytes() == (committed / path.name).read_bytes(), (
            f"{path.name} drifted from embedder.proto: run `make proto`")


def test_http_statuses_come_from_the_same_mapping_as_grpc_codes():
    from tokq.gateway.errors import (InvalidArgument, ModelNotFound, PayloadTooLarge, Unavailable,
                                     to_http)
    from tokq.queue.shard import QueueFull

    status, body = to_http(InvalidArgument("bad dims", param="dimensions"))
    assert status == 400 and body == {"error": {"message": "bad dims", "type": "invalid_request_error",
                                                "param": "dimensions", "code": "invalid_argument"}}
    status, body = to_http(ModelNotFound("nope", param="model"))  # OpenAI's own 404
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert body["error"]["type"] == "invalid_request_error"
    status, body = to_http(PayloadTooLarge("big"))
    assert status == 413 and body["error"]["type"] == "invalid_request_error"  # not rate_limit_error
    assert to_http(QueueFull(10, 5, 12))[0] == 429
    assert to_http(Unavailable("down"))[0] == 503
    assert to_http(redis.exceptions.ConnectionError("refused"))[0] == 503
    assert to_http(TimeoutError())[0] == 504
    status, body = to_http(RuntimeError("boom"))
    assert status == 500 and "boom" not in body["error"]["message"]  # logged, not shown


def test_config_rejects_unknown_keys_and_takes_env_overrides():
    with pytest.raises(ValueError, match="unknown QueueConfig key.*lease_msec"):
        cfg.load(cfg.QueueConfig, {"lease_msec": 5})
    conf = cfg.load(cfg.QueueConfig, {"lookahead": 0}, env={"TOKQ_LEASE_MS": "1500", "TOKQ_LOOKAHEAD": "9"})
    assert (conf.lease_ms, conf.lookahead) == (1500, 0)  # explicit values beat the environment
    with pytest.raises(ValueError, match="TOKQ_LEASE_MS: expected int"):
        cfg.load(cfg.QueueConfig, env={"TOKQ_LEASE_MS": "soon"})
    assert cfg.load(cfg.GatewayConfig, {"port": None}, env={}).port == 50051  # unset flag = default


def test_client_refuses_a_bare_string():
    from tokq import Client

    with Client("127.0.0.1:9") as client:
        with pytest.raises(TypeError, match="list of strings"):
            client.embed("not a list")
        with pytest.raises(TypeError, match="list of strings"):  # not five one-letter inputs
            client.tokenize("hello")


def test_client_raises_unavailable_with_code_when_nothing_listens():
    from tokq import Client, TokqError
    from tokq.redis.embedded import free_port

    with Client(f"127.0.0.1:{free_port()}") as client, pytest.raises(TokqError) as err:
        client.embed(["hi"], timeout=2)
    assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_cli_lists_every_subcommand():
    from click.testing import CliRunner

    from tokq.cli import COMMANDS, main

    out = CliRunner().invoke(main, ["--help"]).output
    for name in COMMANDS:
        assert name in out


def test_redis_commands_are_retried_on_connection_errors_only():
    # After a timeout a script may already have run; enqueue, claim and collect must not run
    # twice. A refused or reset connection (a restarted Redis) is safe to retry.
    from tokq.redis.connection import connect

    # The retry every connection of the pool runs its commands through, run on failing calls.
    retry = connect("redis://127.0.0.1:1/0", cluster="no").connection_pool.connection_kwargs["retry"]

    def attempts(error: Exception) -> int:
        calls = []

        async def command():
            calls.append(error)
            raise error

        async def on_failure(exc):  # the client disconnects here; nothing to do in this test
            pass

        with pytest.raises(type(error)):
            asyncio.run(retry.call_with_retry(command, on_failure))
        return len(calls)

    assert attempts(redis.exceptions.ConnectionError("connection reset")) == 3  # 2 retries
    assert attempts(redis.exceptions.TimeoutError("no answer in time")) == 1


async def test_a_client_gone_while_sending_its_body_is_no_internal_error(caplog):
    """The connection closes partway through the body (Starlette's ClientDisconnect): nothing is
    logged as an internal error, and no one is answered."""
    from types import SimpleNamespace

    from tokq.gateway.embedding import Embedder
    from tokq.gateway.http import build_app

    app = build_app(Embedder({"m": SimpleNamespace(info=SimpleNamespace(queue_name="m"))}))
    scope = {"type": "http", "method": "POST", "path": "/v1/embeddings", "raw_path": b"/v1/embeddings",
             "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                                (b"content-length", b"1000")],
             "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 8080),
             "client": ("127.0.0.1", 5000), "root_path": ""}
    incoming = [{"type": "http.request", "body": b'{"input": "he', "more_body": True},
                {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
    await app(scope, receive, send)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] in ([], [499])
