"""Every failure a caller can see, and its status on each transport: the one place errors are
mapped.

Handlers raise ``ServiceError`` (or let queue/Redis exceptions through); ``to_status`` turns any
exception into (gRPC code, message) so the servicer aborts the call exactly once, the same way, and
``to_http`` turns the same exception into the HTTP status and OpenAI-style error object.
"""

from __future__ import annotations

import grpc
import redis.exceptions

# gRPC code -> (HTTP status, OpenAI error "type"). Codes not listed are 500 server_error.
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL
    http_status: int | None = None  # None: from HTTP_STATUS by ``code``

    def __init__(self, message: str, code: grpc.StatusCode | None = None, *, param: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.param = param  # the request field at fault, when one is (OpenAI's error "param")

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgument(ServiceError):
    """The request itself is wrong: fix the request (empty input, too long, bad dimensions...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(ServiceError):
    """The request names a model this gateway does not serve."""

    code = grpc.StatusCode.NOT_FOUND


class PayloadTooLarge(ServiceError):
    """The request body is over the size limit (gRPC enforces its own message limit the same way)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


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


def status_name(exc: BaseException) -> str:
    """The gRPC status name an exception ends a call with (for metrics labels)."""
    return to_status(exc)[0].name


def to_http(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, body) for any exception: OpenAI's {"error": {message, type, param, code}},
    ``code`` being the gRPC status name so both transports' errors read alike."""
    code, message = to_status(exc)
    status, kind = HTTP_STATUS.get(code, (500, "server_error"))
    status = getattr(exc, "http_status", None) or status
    return status, {"error": {"message": message, "type": kind, "param": getattr(exc, "param", None),
                              "code": code.name.lower()}}
