"""The OpenAI-compatible HTTP API: Starlette on uvicorn, on the gateway's own asyncio loop, over
the same embedding and reranking paths as gRPC (gateway/embedding.py, gateway/rerank.py). Routes:
POST /v1/embeddings (with TEI's truncate, normalize and prompt_name, and tokq's priority), POST /v1/rerank, /v2/rerank
(Cohere's and Jina's shape) and /rerank (TEI's; gateway/http_rerank.py), GET /v1/models, /health
(live) and /ready (503 until a live worker serves the model)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import time

import numpy as np
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from tokq.address import bind_address
from tokq.gateway.auth import ApiKeys
from tokq.gateway.embedding import EmbedInput, Embedder, Timer
from tokq.gateway.errors import InvalidArgument, PayloadTooLarge, ServiceError, UnsupportedMediaType, to_http
from tokq.gateway.http_rerank import cohere_reply, parse_cohere, parse_tei, tei_reply
from tokq.gateway.priority import from_json, resolve
from tokq.gateway.rerank import rerank, wrong_task

EMBEDDINGS_RPC = "http.Embeddings"  # the rpc label of POST /v1/embeddings in the gateway's metrics
RERANK_RPC = "http.Rerank"  # POST /v1/rerank, /v2/rerank and /rerank
# Body fields: OpenAI's, then TEI's extras and tokq's priority class. Anything else is a 400 naming
# it (a typo is not ignored).
FIELDS = {"input", "model", "encoding_format", "dimensions", "user", "truncate", "normalize", "prompt_name",
          "priority"}


def _json(body, status: int = 200, headers: dict | None = None) -> Response:
    # orjson writes numpy float32 arrays directly (see profiling/results/gateway.md, "HTTP API").
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json", headers=headers)


RETRY_AFTER_S = 1  # sent with 429 (queue full) and 503: the SDKs wait this long, not their own backoff


def _error(exc: BaseException) -> Response:
    status, body = to_http(exc)
    response = _json(body, status)
    if status in (429, 503):
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def _typed(body: dict, name: str, types: tuple[type, ...], what: str):
    value = body.get(name)
    # bool is an int in Python; JSON true is not a dimension.
    if value is not None and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
        raise InvalidArgument(f"{name} must be {what}, got {value!r}", param=name)
    return value


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)  # JSON true is no id


def _inputs(value) -> tuple[list[str], list[list[int]]]:
    """OpenAI's four input shapes: string, list of strings, token-id array, list of those."""
    if isinstance(value, str):
        return [value], []
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return value, []
        if _is_ids(value):
            return [], [value]
        if all(isinstance(v, list) for v in value):
            bad = next((i for i, v in enumerate(value) if not _is_ids(v)), None)
            if bad is not None:
                raise InvalidArgument(f"input {bad} is a list, but not of integer token ids", param="input")
            return [], value  # ids are checked against the vocabulary by the embedding path
    raise InvalidArgument("input must be a string, a list of strings, a token-id array or a list "
                          "of token-id arrays", param="input")


def _check_json(request: Request) -> None:
    """A body declared as anything but JSON is refused (415): a web page can make a browser send
    text/plain and form posts without a CORS preflight. A body with no declared type still passes
    (curl), so only an API key shuts such pages out."""
    coding = request.headers.get("content-encoding", "identity").strip().lower()
    if coding != "identity":  # not decompressed here: else a 400 "not valid JSON" hides the cause
        raise UnsupportedMediaType(f"Content-Encoding {coding!r} is not supported: send the body "
                                   "uncompressed")
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media not in ("application/json", "text/json") and not media.endswith("+json"):
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {declared!r}")


async def _body(request: Request, max_bytes: int) -> bytes:
    """The body, refused (413) as soon as it passes ``max_bytes``, before all of it is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"request body is over the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _cancel_on_hang_up(call: asyncio.Future):
    def done(hangup: asyncio.Future) -> None:
        # Only a hang-up: not the watcher stopped (the answer is out) or failing (logged, not
        # taken for one: the caller may be there still).
        if not hangup.cancelled() and hangup.exception() is None:
            call.cancel()
    return done


async def _hung_up(request: Request) -> None:
    """Returns once the client has gone. Called after the body is read: the server answers
    receive() then only when the connection is lost (or the response is sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def parse_request(raw: bytes, key_priority: str | None = None) -> tuple[EmbedInput, str]:
    """(the embedding request, encoding_format) from a POST /v1/embeddings body; ``key_priority``:
    the caller's API key's default class, for a body that names none."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise InvalidArgument(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(FIELDS))}",
                              param=unknown[0])
    if "input" not in body:
        raise InvalidArgument("input is required", param="input")
    texts, token_ids = _inputs(body["input"])
    encoding = _typed(body, "encoding_format", (str,), '"float" or "base64"')
    encoding = "float" if encoding is None else encoding
    if encoding not in ("float", "base64"):
        raise InvalidArgument(f'encoding_format must be "float" or "base64", got {encoding!r}',
                              param="encoding_format")
    _typed(body, "user", (str,), "a string")
    return EmbedInput(
        texts=texts, token_ids=token_ids,
        model=_typed(body, "model", (str,), "a string") or "",
        truncate=bool(_typed(body, "truncate", (bool,), "a boolean")),
        normalize=_typed(body, "normalize", (bool,), "a boolean"),
        dimensions=_typed(body, "dimensions", (int,), "an integer"),
        prompt_name=_typed(body, "prompt_name", (str,), "a string"),
        priority=resolve(from_json(body.get("priority")), key_priority),
    ), encoding


def _named(params):
    """(the model a parsed request names, its priority class, the request): an EmbedInput with its
    encoding, or a RerankInput."""
    request = params[0] if isinstance(params, tuple) else params
    return request.model, request.priority, params


def _encode(vector: np.ndarray, encoding: str):
    if encoding == "base64":  # little-endian float32, what the openai SDK decodes
        return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector


def build_app(embedder: Embedder, readiness=None, *, max_body_bytes: int = 64 * 1024 * 1024,
              api_keys: ApiKeys | None = None) -> Starlette:
    """``readiness``: an object with ``ready`` (bool) and ``reason`` (str); None = always ready.
    ``api_keys``: when given, every route but /health and /ready needs ``Authorization: Bearer``."""

    def authorize(request: Request) -> str | None:
        """The caller's key's default priority class (None: none); Unauthenticated -> 401."""
        if api_keys is not None:
            return api_keys.check(request.headers.get("authorization"))
        return None

    async def answer(request: Request, rpc: str, parse, operation, reply) -> Response:
        """``parse(body, key_priority)``: (the model named, the priority class, params); then
        ``operation(model, params)`` on that model and ``reply(out, params)`` as JSON; every failure
        mapped once (gateway.errors)."""
        start = time.perf_counter()
        try:
            try:
                key_priority = authorize(request)
                _check_json(request)
                model_name, priority, params = parse(await _body(request, max_body_bytes), key_priority)
            except ServiceError as exc:  # refused before it named a model: counted as such
                embedder.refused(rpc, exc, start)
                raise

            async def run(model):
                return await operation(model, params)
            call = asyncio.ensure_future(embedder.observed(rpc, model_name, run, priority=priority))
            # A caller that hangs up (an SDK's timeout, then its retry) stops the call, which
            # cancels its queued request, as gRPC does: else a worker embeds it for nobody.
            hangup = asyncio.ensure_future(_hung_up(request))
            hangup.add_done_callback(_cancel_on_hang_up(call))
            try:
                out = await call
            except asyncio.CancelledError:
                if call.cancelled() and hangup.done() and not hangup.cancelled():
                    return Response(status_code=499)  # nobody reads it
                raise
            finally:
                hangup.cancel()
        except ClientDisconnect:  # gone while sending its body: no one to answer, nothing wrong here
            return Response(status_code=499)
        except Exception as exc:  # mapped once, in gateway.errors
            return _error(exc)
        return _json(reply(out, params))

    async def embed(model, parsed):
        if model.info.is_reranker:
            raise wrong_task(model.info, "embed")
        return await model.embed(parsed[0], Timer())

    def embedded(out, parsed) -> dict:
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, parsed[1])}
                     for i, v in enumerate(out.vectors)],
            "model": out.model,
            "usage": {"prompt_tokens": out.num_tokens, "total_tokens": out.num_tokens},
        }

    async def embeddings(request: Request) -> Response:
        return await answer(request, EMBEDDINGS_RPC, lambda raw, key: _named(parse_request(raw, key)), embed,
                            embedded)

    async def score(model, params):
        return await rerank(model, params, Timer())

    async def rerank_v1(request: Request) -> Response:
        return await answer(request, RERANK_RPC, lambda raw, key: _named(parse_cohere(raw, key)), score,
                            lambda out, params: cohere_reply(out, params, "1"))

    async def rerank_v2(request: Request) -> Response:
        return await answer(request, RERANK_RPC, lambda raw, key: _named(parse_cohere(raw, key)), score,
                            lambda out, params: cohere_reply(out, params, "2"))

    async def rerank_tei(request: Request) -> Response:
        return await answer(request, RERANK_RPC, lambda raw, key: _named(parse_tei(raw, key)), score,
                            tei_reply)

    def _model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "tokq"}

    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except Exception as exc:
            return _error(exc)
        return _json({"object": "list", "data": [_model_card(n) for n in embedder.models]})

    async def model(request: Request) -> Response:
        try:
            authorize(request)
            name = request.path_params["name"]
            if not name:  # /v1/models/: the list, not the one model lookup("") would pick
                return await models(request)
            return _json(_model_card(embedder.lookup(name).info.name))
        except Exception as exc:
            return _error(exc)

    async def health(request: Request) -> Response:
        return _json({"status": "ok"})

    async def ready(request: Request) -> Response:
        if readiness is None or readiness.ready:
            return _json({"status": "ready"})
        return _json({"status": "not ready", "reason": readiness.reason}, 503)

    async def no_route(request: Request, exc: HTTPException) -> Response:
        # Starlette's own 404 and 405 answer in plain text: OpenAI's error object instead (405
        # keeps its Allow header).
        return _json({"error": {"message": f"{request.method} {request.url.path}: {exc.detail}",
                                "type": "invalid_request_error", "param": None, "code": None}},
                     exc.status_code, exc.headers)

    return Starlette(exception_handlers={404: no_route, 405: no_route}, routes=[
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/rerank", rerank_v1, methods=["POST"]),
        Route("/v2/rerank", rerank_v2, methods=["POST"]),
        Route("/rerank", rerank_tei, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
    ])


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The gateway's own SIGTERM/SIGINT handlers stop gRPC and HTTP together, in order.
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening socket with SO_REUSEPORT, so `--procs` gateway processes share the HTTP port
    as they share the gRPC one. Port 0 picks a free port (read it from getsockname())."""
    family, address = bind_address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def server(app: Starlette, **uvicorn_options) -> _Server:
    """A uvicorn server to run as a task on the running loop: ``await server.serve([sock])``;
    set ``should_exit`` to stop it."""
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, **uvicorn_options)
    return _Server(config)
