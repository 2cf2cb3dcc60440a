"""A stand-in gateway for the bulk tests that need speed or failures on cue: Info and Embed over
real gRPC on loopback, each text's vector a pure function of the text (``vector_of``), so a
test knows every row's expected value exactly."""

from __future__ import annotations

import threading
import time
import zlib
from concurrent import futures

import grpc
import numpy as np

from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc

DIMS = 8
MAX_LENGTH = 64  # "tokens": a text's whitespace-separated words + 2


def vector_of(text: str, dims: int = DIMS) -> np.ndarray:
    b = text.encode()
    v = np.array([len(b), zlib.crc32(b) % 1000, b[0], b[-1], len(text.split()),
                  zlib.adler32(b) % 997, 1.0, 2.0], dtype=np.float32)[:dims]
    return v


def tokens_of(text: str) -> int:
    return len(text.split()) + 2


class FakeGateway(pb_grpc.EmbedderServicer):
    """``fail``: a callable (texts) -> (grpc.StatusCode, message) | None, asked before each Embed;
    ``delay_s``: each Embed's time. Texts holding TOOLONG are refused naming the input, BOOM
    fails INTERNAL, UNNAMED is refused without naming it."""

    def __init__(self, *, budget: int = 256, max_inputs: int = 64, delay_s: float = 0.0, fail=None,
                 model: str = "fake-model", prompts: tuple[str, ...] = ("query",),
                 workers: int | None = None, token_s: float = 1e-4, api_key: str | None = None,
                 tls: tuple[bytes, bytes] | None = None, also_serves: tuple[str, ...] = ()) -> None:
        """``workers``: that many simulated workers, each request holding one for ``token_s``
        a token; its wait for one is its queue time."""
        self.budget = budget
        self.api_key = api_key
        self.models = sorted([model, *also_serves])
        self.tls = tls  # (certificate chain, private key) PEM: served over TLS
        self.workers = threading.Semaphore(workers) if workers else None
        self.token_s = token_s
        self.in_flight = self.max_in_flight = 0
        self.max_inputs = max_inputs
        self.delay_s = delay_s
        self.fail = fail
        self.model = model
        self.prompts = prompts
        self.calls = 0
        self.inputs_seen = 0
        self.texts_seen: list[str] = []
        self.keep_texts = False
        self.priorities_seen: set[str] = set()  # each Embed's tokq.v1.Priority name
        self._lock = threading.Lock()
        self.server = None
        self.port = 0

    def _authorize(self, context) -> None:
        if self.api_key and ("authorization", f"Bearer {self.api_key}") not in context.invocation_metadata():
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key")

    def Info(self, request, context):
        self._authorize(context)
        return pb.InfoResponse(model=self.model, dimensions=DIMS, max_input_length=MAX_LENGTH,
                               token_budget=self.budget, max_inputs=self.max_inputs,
                               prompt_names=list(self.prompts), task="embed", models=self.models)

    def Embed(self, request, context):
        self._authorize(context)
        texts = list(request.inputs)
        with self._lock:
            self.calls += 1
            self.priorities_seen.add(pb.Priority.Name(request.priority))
        if self.fail is not None and (why := self.fail(texts)):
            context.abort(*why)
        if len(texts) > self.max_inputs:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(texts)} inputs in one request; the limit "
                          f"is {self.max_inputs}: split the request")
        for i, text in enumerate(texts):
            if "TOOLONG" in text and not request.truncate:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"input {i} is 999 tokens long; fake-model "
                              f"takes at most {MAX_LENGTH} tokens per input")
            if "UNNAMED" in text:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request's inputs are too big")
            if "BOOM" in text:
                context.abort(grpc.StatusCode.INTERNAL, "internal error [abcd]; the gateway log has the details")
        if self.delay_s:
            time.sleep(self.delay_s)
        tokens = sum(tokens_of(t) for t in texts)
        queue_ms, inference_ms = 1.0, 5.0
        if self.workers is not None:
            with self._lock:
                self.in_flight += tokens
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            t0 = time.perf_counter()
            with self.workers:
                t1 = time.perf_counter()
                time.sleep(tokens * self.token_s)
            queue_ms, inference_ms = (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000
            with self._lock:
                self.in_flight -= tokens
        dims = request.dimensions if request.HasField("dimensions") else DIMS
        with self._lock:
            self.inputs_seen += len(texts)
            if self.keep_texts:
                self.texts_seen.extend(texts)
        return pb.EmbedResponse(
            embeddings=[pb.Embedding(values=vector_of(t, dims).tolist()) for t in texts], model=self.model,
            usage=pb.Usage(prompt_tokens=tokens),
            timing=pb.Timing(queue_ms=queue_ms, inference_ms=inference_ms, total_ms=queue_ms + inference_ms))

    def start(self, port: int = 0) -> FakeGateway:
        self.server = grpc.server(futures.ThreadPoolExecutor(64))
        pb_grpc.add_EmbedderServicer_to_server(self, self.server)
        if self.tls:
            credentials = grpc.ssl_server_credentials([(self.tls[1], self.tls[0])])
            self.port = self.server.add_secure_port(f"127.0.0.1:{port}", credentials)
        else:
            self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0).wait()
            self.server = None

    def __enter__(self) -> FakeGateway:
        return self if self.server is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
