"""Every failure a caller can see and its status on gRPC and HTTP: the one place errors are mapped.

Internal detail goes to the log under a correlation id that the caller's message carries.
UNAVAILABLE means retry with backoff; INTERNAL is a bug (docs/internals.md).
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
    http_type: str | None = None  # OpenAI's error "type"; None: from HTTP_STATUS by ``code``
    http_code: str | None = None  # OpenAI's error "code"; None: the gRPC status name

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
    """The request names a model this gateway does not serve: INVALID_ARGUMENT on gRPC, and
    OpenAI's 404 model_not_found on HTTP (the SDKs raise it as NotFoundError)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 404
    http_type = "invalid_request_error"
    http_code = "model_not_found"


class PayloadTooLarge(ServiceError):
    """The request body is over the size limit (gRPC enforces its own message limit the same way).
    On HTTP a 413 of type invalid_request_error, not rate_limit_error: resending it cannot help."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413
    http_type = "invalid_request_error"


class UnsupportedMediaType(ServiceError):
    """HTTP only: a body sent as something other than JSON."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 415


class Unauthenticated(ServiceError):
    """No API key, or one the gateway does not accept."""

    code = grpc.StatusCode.UNAUTHENTICATED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServiceError):
    """Retryable: raise it (with a caller-safe message) when an answer was lost or the backend
    refused for a passing reason."""

    code = grpc.StatusCode.UNAVAILABLE


def correlation_id() -> str:
    return secrets.token_hex(4)


def is_retryable_redis_error(exc: BaseException) -> bool:
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        redis.exceptions.ReadOnlyError, redis.exceptions.OutOfMemoryError,
                        redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
                        redis.exceptions.MasterDownError, redis.exceptions.AuthenticationError,
                        # Redis Cluster mid-failover or resharding. ClusterError is redis-py's
                        # "TTL exhausted.": it gave up following a migrating slot's redirections.
                        redis.exceptions.SlotNotCoveredError, redis.exceptions.AskError,
                        redis.exceptions.ClusterError)):
        return True  # AuthenticationError: misconfigured; the caller can only wait for a fix
    if isinstance(exc, redis.exceptions.RedisClusterException) and exc.__cause__ is not None:
        # "Redis Cluster cannot be connected": no node of the slot map answered; the error
        # that stopped the last one says whether waiting can help (a refused connect can).
        return is_retryable_redis_error(exc.__cause__)
    # "non local key in a cluster node script" is not retryable: the gateway's scripts declare
    # every key, so meeting it means a key outside the queue's slot, a bug (INTERNAL).
    if isinstance(exc, redis.exceptions.ResponseError):
        # A script's redis.call error arrives with its own prefix (OOM ...), or inside
        # "ERR Error running script ...: BUSY ..."-style text on older servers.
        text = str(exc)
        return text.startswith(RETRYABLE_REDIS_PREFIXES) or any(
            f" {p} " in text or f": {p}" in text for p in RETRYABLE_REDIS_PREFIXES)
    return False


def code_of(exc: BaseException) -> grpc.StatusCode:
    """The status an exception ends a call with (no logging: safe for metrics)."""
    from tokq.queue.shard import QueueFull

    if isinstance(exc, ServiceError):
        return exc.code
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if is_retryable_redis_error(exc):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, TimeoutError):  # asyncio's: our own wait; before OSError (it is one)
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, (ConnectionError, OSError)):  # a socket error below redis-py
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def from_result_code(name: str, message: str) -> ServiceError:
    """An error a worker or a Lua script wrote into a reply (gRPC status name + message).
    INTERNAL may hold a worker's exception text: it is logged and the caller gets a correlation id;
    other statuses keep their message."""
    code = getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)
    if code == grpc.StatusCode.INTERNAL:
        cid = correlation_id()
        log.error("internal error [%s]: a worker answered %s: %s", cid, name, message)
        return ServiceError(_internal_message(cid), code)
    return ServiceError(message, code)


def _internal_message(cid: str) -> str:
    return f"internal error [{cid}]; the gateway log has the details"


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(gRPC code, caller-safe message); internal detail is logged with a correlation id."""
    from tokq.queue.shard import QueueFull

    code = code_of(exc)
    if isinstance(exc, ServiceError):
        return code, exc.message
    if isinstance(exc, QueueFull):
        return code, f"queue over its token cap, retry later with backoff: {exc}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return code, "deadline exceeded before all inputs were embedded"
    cid = correlation_id()
    if code == grpc.StatusCode.UNAVAILABLE:
        log.warning("queue backend unavailable [%s]: %s: %s", cid, type(exc).__name__, exc)
        return code, f"{UNAVAILABLE_MESSAGE} [{cid}]"
    log.error("internal error [%s]: %s: %s", cid, type(exc).__name__, exc, exc_info=exc)
    return code, _internal_message(cid)


def refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """Ends a gRPC call with ``code``: the handler sets it and returns no response message.
    Not ``context.abort()``, whose kept AbortError holds the request in a cycle only the GC frees."""
    context.set_code(code)
    context.set_details(message)


def status_name(exc: BaseException) -> str:
    """The gRPC status name an exception ends a call with (for metrics labels)."""
    return code_of(exc).name


def to_http(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, body) for any exception: OpenAI's {"error": {message, type, param, code}},
    ``code`` being the gRPC status name so both transports' errors read alike, except where
    OpenAI has its own (model_not_found)."""
    code, message = to_status(exc)
    status, kind = HTTP_STATUS.get(code, (500, "server_error"))
    status = getattr(exc, "http_status", None) or status
    kind = getattr(exc, "http_type", None) or kind
    return status, {"error": {"message": message, "type": kind, "param": getattr(exc, "param", None),
                              "code": getattr(exc, "http_code", None) or code.name.lower()}}
