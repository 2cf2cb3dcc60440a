"""A call's priority class (tokq.queue.PRIORITIES): the request's own (gRPC's Priority enum, HTTP's
"priority" string), else its API key's default, else interactive. The class goes with every item
the call enqueues.

A gRPC call's key default is set by the API-key interceptor (gateway/auth.py) in ``KEY_DEFAULT``,
a context variable the servicer reads in the same task.
"""

from __future__ import annotations

from contextvars import ContextVar

from tokq.gateway.errors import InvalidArgument
from tokq.queue.priority import DEFAULT_PRIORITY, PRIORITIES
from tokq.v1 import embedder_pb2 as pb

# The class each Priority value names: INTERACTIVE -> "interactive" (a class without one fails here).
BY_ENUM = {pb.Priority.Value(name.upper()): name for name in PRIORITIES}
_ENUM_CHOICES = " or ".join(f"{pb.Priority.Name(v)} ({v})" for v in BY_ENUM)
_JSON_CHOICES = " or ".join(f'"{name}"' for name in PRIORITIES)

# The default class of the API key a gRPC call came with; None: no key, or one without a default.
KEY_DEFAULT: ContextVar[str | None] = ContextVar("tokq_key_priority", default=None)


def from_enum(value: int) -> str | None:
    """A request's Priority as a class; None for PRIORITY_UNSPECIFIED. A value the enum does not
    name (a newer client's, or a stray number) is INVALID_ARGUMENT."""
    if value == pb.PRIORITY_UNSPECIFIED:
        return None
    name = BY_ENUM.get(value)
    if name is None:
        raise InvalidArgument(f"priority {value} is not a tokq.v1.Priority: send {_ENUM_CHOICES}, or "
                              "leave it unset for the API key's default", param="priority")
    return name


def from_json(value) -> str | None:
    """An HTTP body's "priority" as a class; None when absent or null."""
    if value is None:
        return None
    if isinstance(value, str) and value in PRIORITIES:
        return value
    raise InvalidArgument(f"priority must be {_JSON_CHOICES}, got {value!r:.60}", param="priority")


def resolve(requested: str | None, key_default: str | None) -> str:
    """The class a call is queued in: its own, else its key's default, else interactive."""
    return requested or key_default or DEFAULT_PRIORITY
