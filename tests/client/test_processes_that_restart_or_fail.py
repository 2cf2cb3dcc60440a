"""The client against gateway processes that come and go or fail fast: stand-in gateway
processes (real gRPC servers on loopback sharing one port by SO_REUSEPORT, as `tokq gateway
--procs N` does), each naming itself in its replies' trailing metadata like the real one."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tokq import client as client_module
from tokq.client import GATEWAY_ID_METADATA, Client, TokqError
from tokq.redis.embedded import free_port
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc


class StandIn(pb_grpc.EmbedderServicer):
    """A gateway process: answers Embed after ``delay_s``, or fails at once with ``fail``."""

    def __init__(self, name: str, *, delay_s: float = 0.0, fail: grpc.StatusCode | None = None) -> None:
        self.name, self.delay_s, self.fail = name, delay_s, fail
        self.calls = 0
        self.info_models: list[str] = []
        self.embed_calls: list[tuple[str, dict]] = []  # (model asked for, call metadata)

    def _answer(self, context) -> None:
        self.calls += 1
        context.set_trailing_metadata(((GATEWAY_ID_METADATA, self.name),))
        if self.fail is not None:
            context.abort(self.fail, "this process cannot take calls")
        time.sleep(self.delay_s)

    def Embed(self, request, context):
        self.embed_calls.append((request.model, dict(context.invocation_metadata())))
        self._answer(context)
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=[1.0, 0.0]) for _ in request.inputs])

    def Info(self, request, context):
        self._answer(context)
        self.info_models.append(request.model)
        return pb.InfoResponse(model=request.model)


def serve(port: int, servicer: StandIn) -> grpc.Server:
    server = grpc.server(ThreadPoolExecutor(16), options=[("grpc.so_reuseport", 1)])
    pb_grpc.add_EmbedderServicer_to_server(servicer, server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    return server


def call_many(client: Client, n: int, threads: int = 8) -> dict[str, int]:
    outcomes: dict[str, int] = {}

    def one(i):
        try:
            client.embed([f"q{i}"], timeout=5)
            return "OK"
        except TokqError as exc:
            return exc.code.name
    with ThreadPoolExecutor(threads) as pool:
        for outcome in pool.map(one, range(n)):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def test_info_asks_about_the_clients_model():
    port = free_port()
    process = StandIn("A")
    server = serve(port, process)
    try:
        with Client(f"127.0.0.1:{port}", model="model-b") as client:
            assert client.info(timeout=5).model == "model-b"
        assert process.info_models == ["model-b"]  # not the gateway's first model
    finally:
        server.stop(None)


def test_after_a_restart_whose_processes_listen_one_after_another_calls_spread_again(monkeypatch):
    """The gateway restarts: its first new process takes every reconnecting connection and the
    first search, all at once, finds only it; the second, listening later, is found by the
    searches that follow now and again (their waits shortened here)."""
    monkeypatch.setattr(client_module, "REDISCOVER_FIRST_S", 0.05)
    monkeypatch.setattr(client_module, "REDISCOVER_MAX_S", 0.2)
    port = free_port()
    servers = [serve(port, StandIn("A")), serve(port, StandIn("B"))]
    client = Client(f"127.0.0.1:{port}")
    try:
        call_many(client, 40)
        for server in servers:
            server.stop(None).wait()
        a2, b2 = StandIn("A2", delay_s=0.005), StandIn("B2", delay_s=0.005)
        servers = [serve(port, a2)]
        deadline = time.monotonic() + 30
        while client.processes() != {"A2": client_module.DEFAULT_CONNECTIONS} or client._pool._misses_left:
            assert time.monotonic() < deadline, client.processes()
            call_many(client, 8)  # the first search spends itself on A2 alone
        servers.append(serve(port, b2))
        deadline = time.monotonic() + 30
        while "B2" not in client.processes():
            assert time.monotonic() < deadline, f"B2 never reached: {client.processes()}"
            call_many(client, 4)
            time.sleep(0.01)
        a2.calls = b2.calls = 0
        assert call_many(client, 200) == {"OK": 200}
        assert min(a2.calls, b2.calls) >= 50, (a2.calls, b2.calls)  # both take calls again
    finally:
        client.close()
        for server in servers:
            server.stop(None)


def test_a_process_failing_fast_does_not_draw_most_calls():
    """One process answers UNAVAILABLE at once (its Redis is gone), the other answers in 20 ms:
    fewest-in-flight alone would send most calls to the failing one, which always looks idle."""
    port = free_port()
    healthy, failing = StandIn("A", delay_s=0.02), StandIn("B", fail=grpc.StatusCode.UNAVAILABLE)
    servers = [serve(port, healthy), serve(port, failing)]
    client = Client(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while set(client.processes()) != {"A", "B"}:
            assert time.monotonic() < deadline, client.processes()
            call_many(client, 8)
        healthy.calls = failing.calls = 0
        outcomes = call_many(client, 400, threads=16)
        assert outcomes.get("OK", 0) == healthy.calls and outcomes.get("UNAVAILABLE", 0) == failing.calls
        assert failing.calls < 400 / 4, outcomes  # was ~70% before
    finally:
        client.close()
        for server in servers:
            server.stop(None)


def test_a_closed_client_refuses_calls_clearly():
    with Client("127.0.0.1:9") as client:
        pass
    with pytest.raises(ValueError, match="this tokq client is closed"):  # not grpc's closed-channel error
        client.embed(["hi"])


def test_tokq_embed_names_the_model_and_sends_the_api_key(monkeypatch):
    from click.testing import CliRunner

    from tokq.client_cli import embed_command

    port = free_port()
    process = StandIn("A")
    server = serve(port, process)
    try:
        monkeypatch.setenv("TOKQ_API_KEY", "k-123")
        result = CliRunner().invoke(embed_command, ["--target", f"127.0.0.1:{port}", "--model", "model-b",
                                                    "hello"])
        assert result.exit_code == 0, result.output
        [(model, metadata)] = process.embed_calls
        assert model == "model-b" and metadata["authorization"] == "Bearer k-123"
    finally:
        server.stop(None)
