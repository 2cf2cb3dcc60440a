"""A baseline as a gRPC server speaking tokq.v1.Embedder (plus standard health), so the load
generator drives it exactly as it drives tokq's gateway.

The baselines serve the model's own sentence-transformers output: unit-length vectors, inputs
cut at ``max_seq_length`` when ``truncate`` is set (and refused beyond it otherwise, as tokq
does). ``normalize=false`` is refused (UNIMPLEMENTED): the model's pipeline always normalizes.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tokq import __version__
from tokq.address import host_port
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class BaselineService(pb_grpc.EmbedderServicer):
    def __init__(self, name: str, model, runner) -> None:
        self.name = name
        self.model = model
        self.runner = runner
        self.dimensions = int(model.get_embedding_dimension())

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        try:
            return await self._embed(request)
        except _Abort as exc:
            await context.abort(exc.code, str(exc))

    async def _embed(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        start = time.perf_counter()
        texts = list(request.inputs)
        if not texts or any(not t for t in texts):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "inputs must be non-empty strings")
        if request.HasField("normalize") and not request.normalize:
            raise _Abort(grpc.StatusCode.UNIMPLEMENTED, "this baseline always normalizes")
        dims = request.dimensions if request.HasField("dimensions") else 0
        if not 0 <= dims <= self.dimensions:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"dimensions must be 1..{self.dimensions}")
        if not request.truncate:
            self._check_lengths(texts)
        encoded = await self.runner.embed(texts)
        vectors = encoded.vectors
        if dims and dims < self.dimensions:  # Matryoshka: keep the first dims, unit length again
            vectors = vectors[:, :dims]
            vectors = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        total_ms = (time.perf_counter() - start) * 1000
        return pb.EmbedResponse(
            embeddings=[pb.Embedding(values=v.tolist()) for v in vectors], model=self.name,
            usage=pb.Usage(prompt_tokens=encoded.num_tokens, total_tokens=encoded.num_tokens),
            timing=pb.Timing(queue_ms=encoded.queue_ms, inference_ms=encoded.inference_ms, total_ms=total_ms))

    def _check_lengths(self, texts: list[str]) -> None:
        limit = self.model.max_seq_length
        for i, ids in enumerate(self.model.tokenizer(texts, return_attention_mask=False)["input_ids"]):
            if len(ids) > limit:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"input {i} is {len(ids)} tokens long; the limit is {limit} (or set truncate)")

    async def Info(self, request, context) -> pb.InfoResponse:
        return pb.InfoResponse(model=self.name, dimensions=self.dimensions,
                               max_input_length=self.model.max_seq_length, pooling="mean",
                               version=f"{__version__}-baseline-{self.runner.kind}")

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        tok = self.model.tokenizer
        ids = tok(list(request.inputs), truncation=request.truncate, max_length=self.model.max_seq_length,
                  return_attention_mask=False)["input_ids"]
        return pb.TokenizeResponse(model=self.name, inputs=[
            pb.TokenizedInput(ids=seq, tokens=tok.convert_ids_to_tokens(seq)) for seq in ids])


def load_model(model_path: str | None = None, device: str = "cpu"):
    from sentence_transformers import SentenceTransformer

    from tokq.model.info import bundled_model_path

    return SentenceTransformer(str(model_path or bundled_model_path()), device=device)


async def serve(runner, model, *, port: int, host: str = "127.0.0.1", name: str = "all-MiniLM-L6-v2",
                stop: asyncio.Event | None = None, on_ready=None) -> None:
    """Serve until ``stop`` is set; ``on_ready(port)`` once the port answers health checks."""
    server = grpc.aio.server()
    pb_grpc.add_EmbedderServicer_to_server(BaselineService(name, model, runner), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = host_port(host, port)
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {address}")
    await runner.start()
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if on_ready:
        on_ready(bound)
    stop = stop or asyncio.Event()
    try:
        await stop.wait()
    finally:
        await server.stop(grace=1)
        await runner.stop()
