"""A baseline as a gRPC tokq.v1.Embedder (plus health), driven as tokq's gateway is: the model's own
sentence-transformers output, unit-length vectors, inputs cut at ``max_seq_length``."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tokq import __version__
from tokq.address import host_port
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc


class BaselineService(pb_grpc.EmbedderServicer):
    def __init__(self, name: str, model, runner) -> None:
        self.name, self.model, self.runner = name, model, runner

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        start, texts = time.perf_counter(), list(request.inputs)
        if not texts or any(not t for t in texts):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "inputs must be non-empty strings")
        encoded = await self.runner.embed(texts)
        return pb.EmbedResponse(
            embeddings=[pb.Embedding(values=v.tolist()) for v in encoded.vectors], model=self.name,
            usage=pb.Usage(prompt_tokens=encoded.num_tokens, total_tokens=encoded.num_tokens),
            timing=pb.Timing(queue_ms=encoded.queue_ms, inference_ms=encoded.inference_ms,
                             total_ms=(time.perf_counter() - start) * 1000))

    async def Info(self, request, context) -> pb.InfoResponse:
        return pb.InfoResponse(model=self.name, dimensions=int(self.model.get_embedding_dimension()),
                               max_input_length=self.model.max_seq_length, pooling="mean",
                               version=f"{__version__}-baseline-{self.runner.kind}")


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
    if (bound := server.add_insecure_port(host_port(host, port))) == 0:
        raise OSError(f"could not bind {host_port(host, port)}")
    await runner.start()
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if on_ready:
        on_ready(bound)
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await server.stop(grace=1)
        await runner.stop()
