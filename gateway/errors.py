"""Every failure a caller can see, and its gRPC status: the one place errors are mapped.

Handlers raise ``ServiceError`` (or let queue/Redis exceptions through); ``to_status`` turns any
exception into (code, message) so the servicer aborts the call exactly once, the same way.
What a caller reads never holds internal detail (a Redis host:port, exception text, a worker's
traceback): that goes to the log under a short correlation id, and the id goes in the message,
so an operator can find the cause of the one call a user reports.

Retryable means UNAVAILABLE: the queue backend is down, read-only (a failover), out of memory,
loading, busy running a script, or an answer was lost on the wire. A client retries those with
backoff; INTERNAL is a bug, not something to retry.
"""

from __future__ import annotations

import logging
import secrets

import grpc
import redis.exceptions

log = logging.getLogger("tokq.gateway.errors")

UNAVAILABLE_MESSAGE = "queue backend unavailable, retry"

# Redis error prefixes that mean "not now": a replica being promoted, memory full, a restart
# loading its data, a script running too long, a cluster resharding. All of them pass.
RETRYABLE_REDIS_PREFIXES = ("READONLY", "OOM", "LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN",
                            "CLUSTERDOWN", "NOREPLICAS", "UNBLOCKED")


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


class Unauthenticated(ServiceError):
    """No or an unknown API key."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Overloaded(ServiceError):
    """The queue is over its token cap: retry later with backoff."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServiceError):
    """Retryable: raise it (with a caller-safe message) when an answer was lost or the backend
    refused for a passing reason."""

    code = grpc.StatusCode.UNAVAILABLE


def correlation_id() -> str:
    return secrets.token_hex(4)


def _internal(detail: str, exc: BaseException | None = None) -> tuple[grpc.StatusCode, str]:
    cid = correlation_id()
    log.error("internal error [%s]: %s", cid, detail, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error [{cid}]; the gateway log has the details"


def _unavailable(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    cid = correlation_id()
    log.warning("queue backend unavailable [%s]: %s: %s", cid, type(exc).__name__, exc)
    return grpc.StatusCode.UNAVAILABLE, f"{UNAVAILABLE_MESSAGE} [{cid}]"


def is_retryable_redis_error(exc: BaseException) -> bool:
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        redis.exceptions.ReadOnlyError, redis.exceptions.OutOfMemoryError,
                        redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
                        redis.exceptions.MasterDownError, redis.exceptions.AuthenticationError)):
        return True  # AuthenticationError: misconfigured; the caller can only wait for a fix
    if isinstance(exc, redis.exceptions.ResponseError):
        # A script's redis.call error arrives as its own prefix (OOM ...) or inside
        # "ERR Error running script ...: BUSY ..."-style text on older servers.
        text = str(exc)
        return text.startswith(RETRYABLE_REDIS_PREFIXES) or any(
            f" {p} " in text or f": {p}" in text for p in RETRYABLE_REDIS_PREFIXES)
    return False


def from_result_code(name: str, message: str) -> ServiceError:
    """An error a worker or a Lua script wrote into a reply (gRPC status name + message).

    Statuses the worker chose for the caller (INVALID_ARGUMENT, DEADLINE_EXCEEDED, ...) keep
    their message; an INTERNAL one may hold a worker's exception text, so it is logged here and
    the caller gets the correlation id."""
    code = getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)
    if code == grpc.StatusCode.INTERNAL:
        _, safe = _internal(f"a worker answered {name}: {message}")
        return ServiceError(safe, code)
    return ServiceError(message, code)


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    from tokq.queue import QueueFull

    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"queue over its token cap, retry later with backoff: {exc}"
    if is_retryable_redis_error(exc):
        return _unavailable(exc)
    if isinstance(exc, TimeoutError):  # asyncio's: our own wait; before OSError (it is one)
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before all inputs were embedded"
    if isinstance(exc, (ConnectionError, OSError)):  # a socket error below redis-py
        return _unavailable(exc)
    return _internal(f"{type(exc).__name__}: {exc}", exc)
