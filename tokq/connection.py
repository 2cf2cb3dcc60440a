"""Redis connections for the gateway and workers: any redis:// or rediss:// URL (TLS, password,
db), a bounded pool, and fail-fast timeouts so an unreachable Redis is reported within a second
instead of hanging a caller."""

from __future__ import annotations

import redis.asyncio as aioredis
import redis.exceptions
from redis.backoff import ExponentialBackoff
from redis.asyncio.retry import Retry

CONNECT_TIMEOUT_S = 0.5
SOCKET_TIMEOUT_S = 5.0


def _retry() -> Retry:
    # redis-py's default retry backs off for seconds; a refused connection must surface fast.
    # Connection errors are retried (a stale pooled connection after a Redis restart, a reset
    # by a proxy or a failover): the command may already have run with only its answer lost,
    # which is why every queue script is idempotent (tokq.queue). Timeouts are not retried: a
    # Redis silent for SOCKET_TIMEOUT_S is failed to the caller, not waited on three times.
    return Retry(ExponentialBackoff(cap=0.1, base=0.02), retries=2,
                 supported_errors=(redis.exceptions.ConnectionError,))


def connect(url: str, *, max_connections: int = 32, pool_timeout_s: float = 5.0) -> aioredis.Redis:
    """A binary-safe asyncio client over a pool of at most ``max_connections`` connections."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_keepalive=True,
        retry=_retry(),
        decode_responses=False,
    )
    return aioredis.Redis(connection_pool=pool)


def connect_pubsub(url: str) -> aioredis.Redis:
    """A separate client for a long-lived SUBSCRIBE (it holds its connection for good)."""
    return aioredis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                   socket_keepalive=True, retry=_retry(), decode_responses=False)
