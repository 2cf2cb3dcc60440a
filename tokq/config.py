"""Typed configuration. Every field has a default, a ``TOKQ_<FIELD>`` environment override
and (in the CLI) a flag; unknown keys are an error, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class QueueConfig:
    """How one model's queue behaves. Times are milliseconds."""

    # Cap on queued tokens: an enqueue that would pass it is rejected whole (RESOURCE_EXHAUSTED).
    max_queued_tokens: int = 2_000_000
    # A claimed batch's lease; the worker renews it while the forward runs.
    lease_ms: int = 10_000
    # Claims that may end in an expired lease before an item is answered with an error.
    max_attempts: int = 3
    # Entries the claim may pass over to fill the budget (0 = strict FIFO) ...
    lookahead: int = 4
    # ... but never one that has waited this long: nothing starves.
    max_skip_age_ms: int = 50
    # Shards of each model's queue, each its own hash tag (a Redis Cluster spreads them over
    # its nodes); a request goes whole to one shard, workers claim from every shard.
    queue_shards: int = 1
    # Replies nobody collects expire this long after the request's deadline.
    reply_ttl_ms: int = 60_000


@dataclass(frozen=True)
class WorkerConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: str = "auto"  # auto (ask the server) | yes | no
    model: str = ""  # local model directory; "" = the bundled all-MiniLM-L6-v2
    model_name: str = ""  # name served and queue name; "" = derived from the model directory
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    attn_backend: str = "auto"
    token_budget: int = 0  # 0 = published budget in Redis, else the device default
    # torch CPU threads; 0 = torch's default (all cores). Workers sharing a host with each other
    # or with a gateway want fewer: oversubscribed OpenMP threads spin and stall each other.
    threads: int = 0
    heartbeat_ms: int = 2_000
    metrics_port: int = 0  # 0 = no metrics endpoint


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: str = "auto"  # auto (ask the server) | yes | no
    model: str = ""
    model_name: str = ""
    host: str = "0.0.0.0"
    port: int = 50051
    max_inputs: int = 512  # inputs per request
    default_timeout_ms: int = 30_000  # when the client sets no deadline
    redis_max_connections: int = 32
    max_pending_rpcs: int = 20_000  # calls accepted but not yet picked up, before gRPC rejects
    metrics_port: int = 0


def _coerce(value: Any, typ: Any, name: str) -> Any:
    if isinstance(typ, str):  # postponed annotations
        typ = {"int": int, "str": str, "float": float, "bool": bool}[typ]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
    try:
        return typ(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected {typ.__name__}, got {value!r}") from None


def load(cls: type[T], values: Mapping[str, Any] | None = None,
         env: Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from defaults, then ``TOKQ_<FIELD>`` env vars, then ``values`` (CLI/file).

    ``values`` entries that are None are ignored (an unset CLI flag); unknown keys raise.
    """
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values = dict(values or {})
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s): {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(fields))}")
    out: dict[str, Any] = {}
    for name in fields:
        env_value = env.get(f"TOKQ_{name.upper()}")
        if env_value is not None:
            out[name] = _coerce(env_value, hints[name], f"TOKQ_{name.upper()}")
        if values.get(name) is not None:
            out[name] = _coerce(values[name], hints[name], name)
    return cls(**out)
