"""The gateway process's event loop (gateway/event_loop.py): uvloop by default where installed
(it is a dependency on Linux), Python's asyncio on request or without uvloop; asking for a
missing uvloop is a config error, not a silent fallback. A real gateway process's loop is
checked in test_service_end_to_end.py."""

from __future__ import annotations

import asyncio
import sys

import pytest

from tokq.config import ConfigError
from tokq.gateway.event_loop import loop_factory


def _loop_module(name: str) -> str:
    loop = loop_factory(name)()
    try:
        return type(loop).__module__
    finally:
        loop.close()


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is not a dependency on Windows")
def test_auto_and_uvloop_give_uvloop_and_asyncio_gives_asyncio_s_own():
    assert _loop_module("auto").startswith("uvloop")
    assert _loop_module("uvloop").startswith("uvloop")
    assert _loop_module("asyncio").startswith("asyncio")


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert _loop_module("auto").startswith("asyncio")
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        loop_factory("uvloop")
    with pytest.raises(ConfigError, match="not one of"):
        loop_factory("trio")


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is not a dependency on Windows")
def test_a_grpc_aio_server_and_client_talk_on_uvloop():
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def main():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                replies = await asyncio.gather(*(stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                                                 for _ in range(50)))
            return type(asyncio.get_running_loop()).__module__, {r.status for r in replies}
        finally:
            await server.stop(None)

    with asyncio.Runner(loop_factory=loop_factory("uvloop")) as runner:
        module, statuses = runner.run(main())
    assert module.startswith("uvloop") and statuses == {health_pb2.HealthCheckResponse.SERVING}
