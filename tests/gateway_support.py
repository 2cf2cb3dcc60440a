"""A real gateway in this process (its own thread and event loop) on a loopback port: for tests
of what the gateway alone decides (limits, TLS, API keys), without starting a process."""

from __future__ import annotations

import asyncio
import gc
import threading
from contextlib import contextmanager

from tokq import config as cfg

_collector = {"gateways": 0, "threshold": None}  # in-process gateways running, the threshold before


@contextmanager
def running_gateway(redis_url: str, **settings):
    """Yields the gateway's port; ``settings`` are GatewayConfig fields (env vars ignored)."""
    from tokq.gateway.server import serve

    config = cfg.load(cfg.GatewayConfig, {"redis_url": redis_url, "host": "127.0.0.1", "port": 0,
                                          **settings}, env={})
    state: dict = {}
    ready = threading.Event()
    loop = asyncio.new_event_loop()

    def on_ready(port: int) -> None:
        state["port"] = port
        ready.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        state["stop"] = asyncio.Event()
        try:
            loop.run_until_complete(serve(config, cfg.QueueConfig(), stop=state["stop"], on_ready=on_ready))
        except BaseException as exc:  # start-up failed: say why instead of timing out
            state["error"] = exc
            ready.set()

    if not _collector["gateways"]:  # serve() tunes the process's collector: put back after the last
        _collector["threshold"] = gc.get_threshold()
    _collector["gateways"] += 1
    thread = threading.Thread(target=run, daemon=True, name="test-gateway")
    try:
        thread.start()
        assert ready.wait(120), "gateway did not start"
        if "error" in state:
            raise state["error"]
        yield state["port"]
    finally:
        try:
            if "stop" in state:
                loop.call_soon_threadsafe(state["stop"].set)
            thread.join(60)
            if thread.is_alive():  # say what it is still doing (loop.close() would say "running")
                stuck = [t for t in asyncio.all_tasks(loop) if not t.done()]
                raise AssertionError(f"the gateway did not stop within 60 s; its tasks: {stuck!r}")
            loop.close()
        finally:
            _collector["gateways"] -= 1
            if not _collector["gateways"]:
                gc.unfreeze()
                gc.set_threshold(*_collector["threshold"])


def left_for_the_gc(calls) -> list:
    """What ``calls()`` (refused calls to an in-process gateway) leaves on the gateway's side
    for the garbage collector: its requests, errors and frames. Expected: nothing (a refused
    call's request must be freed at once, not by a GC pass; see ``gateway.errors.refuse``)."""
    import gc
    import os

    import tokq.gateway
    from tokq.gateway.wire import EmbedRequestUtf8

    gateway_dir = os.path.dirname(tokq.gateway.__file__) + os.sep  # not tests/gateway/'s frames
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        calls()
        gc.collect()
        # The gateway's side only: a client in this process keeps its own (pytest's raises).
        return [o for o in gc.garbage if isinstance(o, EmbedRequestUtf8)
                or type(o).__name__ in ("AbortError", "InvalidArgument", "Unauthenticated")
                or (type(o).__name__ == "frame" and o.f_code.co_filename.startswith(gateway_dir))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def record_enqueues(monkeypatch) -> list[str | None]:
    """Makes every ``Producer.enqueue`` record the ``priority=`` it is given (None: not passed)
    and answer "queue full" (RESOURCE_EXHAUSTED / 429), so nothing is queued."""
    from tokq.queue.producer import Producer
    from tokq.queue.shard import QueueFull

    seen: list[str | None] = []

    async def record(self, request_id, items, *, timeout_ms, gateway_id, priority=None):
        seen.append(priority)
        raise QueueFull(0, sum(t for t, _ in items), 0, priority or "interactive")
    monkeypatch.setattr(Producer, "enqueue", record)
    return seen
