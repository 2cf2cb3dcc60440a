"""The gateway process's event loop: uvloop (libuv, in C) where installed, else Python's asyncio.

Every call's work is driven by the loop (gRPC's completions, the Redis round trips, the reply
messages: ~6 loop iterations and ~15 callbacks a call), and uvloop runs them for less: in A/B runs
of one gateway on each loop (one Redis and worker, alternating rounds), 0.96x the gateway's CPU
per call with 64 calls in flight and 0.93x with 8 (RESULTS.md, "Gateway CPU per call").
gRPC's asyncio server and redis-py run on any asyncio loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tokq.config import EVENT_LOOPS, ConfigError


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory of the event loop ``name`` picks (one of ``EVENT_LOOPS``; auto: uvloop if it
    can be imported). ConfigError when uvloop is asked for and missing."""
    if name not in EVENT_LOOPS:
        raise ConfigError(f"event_loop={name!r} is not one of {', '.join(EVENT_LOOPS)}")
    if name == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise ConfigError("event_loop=uvloop, but uvloop is not installed (pip install uvloop)") from None
        return asyncio.new_event_loop
    return uvloop.new_event_loop
