"""Who may call: TLS server credentials and optional API keys, one ``ApiKeys.check`` for gRPC
(UNAUTHENTICATED) and HTTP (401). Only keys' SHA-256 digests are kept and looked up, so a check's
time says nothing about how much of a key matched. Health checks stay open: probes carry no keys.
A key may carry a default priority class ('KEY priority=batch'), for its calls that set none.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import grpc

from tokq.config import ConfigError, GatewayConfig, api_key_entry
from tokq.gateway.errors import Unauthenticated, refuse
from tokq.gateway.priority import KEY_DEFAULT

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str], priorities: Mapping[str, str] | None = None) -> None:
        """``keys``: the accepted keys; ``priorities``: a key's default priority class, for those
        that have one."""
        priorities = priorities or {}
        self._digests = {_digest(k): priorities.get(k) for k in keys if k}
        if not self._digests:
            raise ConfigError("no API keys given (an empty --api-key-file?)")

    @classmethod
    def from_config(cls, config: GatewayConfig) -> ApiKeys | None:
        """The accepted keys, or None when the gateway takes calls without one. An entry is
        'KEY' or 'KEY priority=CLASS' (tokq.config.api_key_entry)."""
        entries = [(e, f"api_keys entry {i}") for i, e in enumerate(config.api_keys, 1)]
        if config.api_key_file:
            try:
                lines = Path(config.api_key_file).read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"api_key_file {config.api_key_file!r}: {exc.strerror}") from None
            entries += [(s, f"api_key_file {config.api_key_file!r} line {n}")
                        for n, s in enumerate((line.strip() for line in lines), 1) if s and not s.startswith("#")]
            if not entries:
                raise ConfigError(f"api_key_file {config.api_key_file!r} holds no key")
        keys: list[str] = []
        priorities: dict[str, str] = {}
        for entry, where in entries:
            key, priority = api_key_entry(entry, where)
            if key in keys and priorities.get(key) != priority:
                raise ConfigError(f"{where}: this key is listed before with another priority")
            keys.append(key)
            if priority:
                priorities[key] = priority
        return cls(keys, priorities) if keys else None

    @property
    def has_defaults(self) -> bool:
        """Whether any key carries a default priority class."""
        return any(p is not None for p in self._digests.values())

    def check(self, authorization: str | None) -> str | None:
        """Accept ``Bearer <key>`` for a known key, returning its default priority class (None:
        it has none); raise Unauthenticated otherwise."""
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("an API key is required: send 'authorization: Bearer <key>'")
        digest = _digest(key.strip())
        if digest not in self._digests:
            raise Unauthenticated("API key not accepted")
        return self._digests[digest]


CLIENT_KEY_ENV = "TOKQ_API_KEY"  # the client's (tokq embed --api-key), one letter from the gateway's


def client_key_warning(keyed: bool, env: Mapping[str, str] | None = None,
                       who: str = "the gateway") -> str | None:
    """The warning for a gateway started without keys from an environment holding the client's
    TOKQ_API_KEY, else None. Warned, not refused: a keyless dev gateway may start from such a shell."""
    env = os.environ if env is None else env
    if keyed or not env.get(CLIENT_KEY_ENV):
        return None
    return (f"warning: API keys are OFF: {who} takes calls without a key. {CLIENT_KEY_ENV} is set, "
            f"but it is the client's (tokq embed); {who} reads TOKQ_API_KEYS, --api-key or "
            "--api-key-file")


def _metadata_value(details: grpc.HandlerCallDetails, name: str) -> str | None:
    for key, value in details.invocation_metadata or ():
        if key == name:
            return value if isinstance(value, str) else value.decode()
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Checks the key before the call reaches a servicer; health stays open. ``on_refused(rpc,
    exc, start)`` counts a refused call of ``service`` (gateway.embedding.Embedder.refused). A key
    with a default priority class has its calls' handler run with it in gateway.priority.KEY_DEFAULT."""

    def __init__(self, keys: ApiKeys, on_refused: Callable | None = None, service: str = "") -> None:
        self.keys = keys
        self.on_refused = on_refused
        self._counted_prefix = f"/{service}/"

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        start = time.perf_counter()
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        try:
            priority = self.keys.check(_metadata_value(details, "authorization"))
        except Unauthenticated as exc:
            if self.on_refused is not None and details.method.startswith(self._counted_prefix):
                self.on_refused(details.method.removeprefix(self._counted_prefix), exc, start)
            return _refusing(handler, exc.message)
        if priority is not None and handler.unary_unary:
            return _with_key_default(handler, priority)
        return handler


def _with_key_default(handler: grpc.RpcMethodHandler, priority: str) -> grpc.RpcMethodHandler:
    """``handler`` run with ``priority`` as its key's default (gateway.priority.KEY_DEFAULT)."""
    inner = handler.unary_unary

    async def unary(request, context):
        KEY_DEFAULT.set(priority)  # the handler's own task: no other call sees it
        return await inner(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                               response_serializer=handler.response_serializer)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        refuse(context, grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request_or_iterator, context):
        refuse(context, grpc.StatusCode.UNAUTHENTICATED, message)
        return
        yield  # pragma: no cover (makes this an async generator, as streaming handlers are)

    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)


def server_credentials(config: GatewayConfig) -> grpc.ServerCredentials | None:
    """TLS from --tls-cert/--tls-key; with --tls-client-ca, clients must present a certificate
    signed by it (mutual TLS). None: plaintext."""
    if not config.tls_cert:
        return None

    def read(name: str) -> bytes:
        path = getattr(config, name)
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{name} {path!r}: {exc.strerror}") from None

    client_ca = read("tls_client_ca") if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(read("tls_key"), read("tls_cert"))],
                                       root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def http_tls_options(config: GatewayConfig) -> dict:
    """The same TLS (and client-certificate requirement) for the HTTP API, as uvicorn options."""
    if not config.tls_cert:
        return {}
    import ssl

    options = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
    if config.tls_client_ca:
        options |= {"ssl_ca_certs": config.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options
