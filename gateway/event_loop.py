"""The gateway process's event loop: uvloop (libuv, in C) where installed, else Python's asyncio.

uvloop drives each call's callbacks for less CPU (profiling/results/gateway.md, "Gateway CPU per call").
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
