"""Every failure a caller can see, and its gRPC status: the one place errors are mapped.

Handlers raise ``ServiceError`` (or let queue/Redis exceptions through); ``to_status`` turns any
exception into (code, message) so the servicer aborts the call exactly once, the same way.
"""

from __future__ import annotations

import grpc
import redis.exceptions


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgument(ServiceError):
    """The request itself is wrong: fix the request (empty input, too long, bad dimensions...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Overloaded(ServiceError):
    """The queue is over its token cap: retry later with backoff."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


def from_result_code(name: str, message: str) -> ServiceError:
    """An error a worker or a Lua script wrote into a reply (gRPC status name + message)."""
    code = getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)
    return ServiceError(message, code)


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    from tokq.queue import QueueFull

    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"queue over its token cap, retry later: {exc}"
    if isinstance(exc, TimeoutError):  # before OSError: the builtin TimeoutError is one
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before all inputs were embedded"
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)):
        return grpc.StatusCode.UNAVAILABLE, f"queue backend (Redis) unreachable: {exc}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
