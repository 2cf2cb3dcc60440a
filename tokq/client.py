"""Python client for search backends.

    from tokq import Client
    vectors = Client("localhost:50051").embed(["red shoes", "blue shoes"])   # float32 [2, dim]

Errors raise ``TokqError`` carrying the gRPC status code and the server's message. A gateway
with TLS takes ``credentials=grpc.ssl_channel_credentials(...)``; one with API keys, ``api_key=``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc


class TokqError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Embeddings:
    """Everything an Embed call returns; ``embed`` returns just ``vectors``."""

    vectors: np.ndarray  # float32 [n, dim]
    model: str
    prompt_tokens: int
    timing: dict[str, float]


def _request(texts: Sequence[str], truncate: bool, normalize: bool, dimensions: int | None,
             prompt_name: str | None, model: str) -> pb.EmbedRequest:
    if isinstance(texts, str):
        raise TypeError("embed() takes a list of strings; wrap a single text in a list")
    req = pb.EmbedRequest(inputs=list(texts), truncate=truncate, normalize=normalize, model=model)
    if dimensions is not None:
        req.dimensions = dimensions
    if prompt_name is not None:
        req.prompt_name = prompt_name
    return req


def _unpack(resp: pb.EmbedResponse) -> Embeddings:
    dim = len(resp.embeddings[0].values) if resp.embeddings else 0
    vectors = np.empty((len(resp.embeddings), dim), dtype=np.float32)
    for i, emb in enumerate(resp.embeddings):
        vectors[i] = emb.values
    t = resp.timing
    return Embeddings(vectors, resp.model, resp.usage.prompt_tokens,
                      {"tokenize_ms": t.tokenize_ms, "queue_ms": t.queue_ms,
                       "inference_ms": t.inference_ms, "total_ms": t.total_ms})


def _error(exc: grpc.RpcError) -> TokqError:
    return TokqError(exc.code(), exc.details() or "")


_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                    ("grpc.max_send_message_length", 64 * 1024 * 1024)]


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class Client:
    def __init__(self, target: str = "localhost:50051", *, credentials: grpc.ChannelCredentials | None = None,
                 model: str = "", api_key: str | None = None) -> None:
        self._channel = (grpc.secure_channel(target, credentials, _CHANNEL_OPTIONS) if credentials
                         else grpc.insecure_channel(target, _CHANNEL_OPTIONS))
        self._stub = pb_grpc.EmbedderStub(self._channel)
        self.model = model
        self._metadata = _auth_metadata(api_key)

    def embed(self, texts: Sequence[str], *, truncate: bool = False, normalize: bool = True,
              dimensions: int | None = None, prompt_name: str | None = None,
              timeout: float | None = None) -> np.ndarray:
        return self.embed_full(texts, truncate=truncate, normalize=normalize, dimensions=dimensions,
                               prompt_name=prompt_name, timeout=timeout).vectors

    def embed_full(self, texts: Sequence[str], *, truncate: bool = False, normalize: bool = True,
                   dimensions: int | None = None, prompt_name: str | None = None,
                   timeout: float | None = None) -> Embeddings:
        req = _request(texts, truncate, normalize, dimensions, prompt_name, self.model)
        try:
            return _unpack(self._stub.Embed(req, timeout=timeout, metadata=self._metadata))
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def info(self, timeout: float | None = None) -> pb.InfoResponse:
        try:
            return self._stub.Info(pb.InfoRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def tokenize(self, texts: Sequence[str], *, truncate: bool = False, prompt_name: str | None = None,
                 timeout: float | None = None) -> list[list[int]]:
        req = pb.TokenizeRequest(inputs=list(texts), truncate=truncate, model=self.model)
        if prompt_name is not None:
            req.prompt_name = prompt_name
        try:
            return [list(t.ids) for t in self._stub.Tokenize(req, timeout=timeout, metadata=self._metadata).inputs]
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The asyncio variant (grpc.aio); create it inside a running event loop."""

    def __init__(self, target: str = "localhost:50051", *, credentials: grpc.ChannelCredentials | None = None,
                 model: str = "", api_key: str | None = None) -> None:
        self._channel = (grpc.aio.secure_channel(target, credentials, _CHANNEL_OPTIONS) if credentials
                         else grpc.aio.insecure_channel(target, _CHANNEL_OPTIONS))
        self._stub = pb_grpc.EmbedderStub(self._channel)
        self.model = model
        self._metadata = _auth_metadata(api_key)

    async def embed(self, texts: Sequence[str], *, truncate: bool = False, normalize: bool = True,
                    dimensions: int | None = None, prompt_name: str | None = None,
                    timeout: float | None = None) -> np.ndarray:
        return (await self.embed_full(texts, truncate=truncate, normalize=normalize,
                                      dimensions=dimensions, prompt_name=prompt_name,
                                      timeout=timeout)).vectors

    async def embed_full(self, texts: Sequence[str], *, truncate: bool = False, normalize: bool = True,
                         dimensions: int | None = None, prompt_name: str | None = None,
                         timeout: float | None = None) -> Embeddings:
        req = _request(texts, truncate, normalize, dimensions, prompt_name, self.model)
        try:
            return _unpack(await self._stub.Embed(req, timeout=timeout, metadata=self._metadata))
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def info(self, timeout: float | None = None) -> pb.InfoResponse:
        try:
            return await self._stub.Info(pb.InfoRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
