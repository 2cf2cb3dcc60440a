"""The reranking path every transport shares: look the model up -> validate -> tokenize each
(query, document) pair -> enqueue one item per pair -> wait -> scores, best first.

Each pair is a queue item counted by its own tokens, so candidates spread over every worker by
compute; a worker's result is the raw score, and the activation is applied here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from tokq.gateway.embedding import Deadline, ServedModel
from tokq.gateway.errors import InvalidArgument, from_result_code
from tokq.gateway.prompt_boundary import shared_prompt_len
from tokq.gateway.service import EmbedderService, priority_of
from tokq.gateway.validate import check_pair_sizes
from tokq.gateway.wire import MAX_SEND_MESSAGE_BYTES
from tokq.model.info import ModelInfo
from tokq.queue.priority import DEFAULT_PRIORITY
from tokq.queue.wire import decode_result, encode_body
from tokq.v1 import embedder_pb2 as pb

_REPLY_OVERHEAD_BYTES = 4096
_RESULT_BYTES = 16  # one result without its document: tags, index, score


@dataclass(frozen=True)
class RerankInput:
    """One rerank request, whatever it came over."""

    query: str
    documents: list[str] = field(default_factory=list)
    model: str = ""
    top_n: int | None = None  # None: every document
    raw_scores: bool = False
    return_documents: bool = False
    truncate: bool = False
    priority: str = DEFAULT_PRIORITY  # the queue class, resolved by the transport (gateway/priority.py)


@dataclass(frozen=True)
class RerankOutput:
    results: list[tuple[int, float]]  # (document index, score), best first
    documents: list[str]  # the request's, for return_documents
    model: str
    num_tokens: int
    timing: dict[str, float]  # tokenize_ms, queue_ms, inference_ms, total_ms


def wrong_task(info: ModelInfo, wanted: str) -> InvalidArgument:
    """Asking an embedding model to rerank, or a reranker to embed."""
    if wanted == "rerank":
        return InvalidArgument(f"{info.name} is an embedding model (task: embed): it cannot rerank; "
                               "call Embed, or name a reranker", param="model")
    return InvalidArgument(f"{info.name} is a reranker (task: rerank): it cannot embed; call Rerank, "
                           "or name an embedding model", param="model")


def _check(model: ServedModel, request: RerankInput) -> None:
    if not request.query:
        raise InvalidArgument("query is empty: send the text to score the documents against", param="query")
    if not request.documents:
        raise InvalidArgument("documents is empty: send at least one document to score", param="documents")
    if len(request.documents) > model.config.max_inputs:
        raise InvalidArgument(f"{len(request.documents)} documents in one request; the limit is "
                              f"{model.config.max_inputs}: split the request", param="documents")
    for i, doc in enumerate(request.documents):
        if not doc:
            raise InvalidArgument(f"document {i} is an empty string: every document needs text",
                                  param="documents")
    if request.top_n is not None and (type(request.top_n) is not int or request.top_n < 1):
        raise InvalidArgument(f"top_n must be an integer >= 1, got {request.top_n!r}", param="top_n")


async def rerank(model: ServedModel, request: RerankInput, context: Deadline) -> RerankOutput:
    t_start = time.perf_counter()
    info = model.info
    if not info.is_reranker:
        raise wrong_task(info, "rerank")
    _check(model, request)
    sizes = check_pair_sizes(request.query, request.documents, model.limits)
    if request.return_documents and sum(sizes) + len(sizes) * _RESULT_BYTES + _REPLY_OVERHEAD_BYTES > \
            MAX_SEND_MESSAGE_BYTES:
        raise InvalidArgument(f"the documents do not fit one reply (at most {MAX_SEND_MESSAGE_BYTES >> 20} "
                              "MiB) with return_documents: send fewer, or leave it off", param="documents")
    prompt = info.prompt(None)  # the model's default prompt, as CrossEncoder applies it
    model._timeout_ms(context)  # a call already past its deadline is not tokenized
    cost = model.tokenizer.cost_bytes([sizes[0] + s for s in sizes[1:]], request.truncate)
    pairs = await model.tokenizer.encode_pairs(request.query, request.documents, truncate=request.truncate,
                                               prompt=prompt, cost_bytes=cost)
    tokenize_ms = (time.perf_counter() - t_start) * 1000
    # a causal model's text before the document is computed once by the worker (encoders: none)
    prefix = pairs.prefix_ids if info.is_decoder else None
    items = []
    for seq, segment in zip(pairs.ids, pairs.segment_starts):
        p = shared_prompt_len(seq, prefix) if prefix else 0
        # dimensions=1: the worker answers the first (only) value of its [1] score row
        items.append((len(seq) - p, encode_body(seq, normalize=False, dimensions=1, prompt_len=p,
                                                segment_start=segment)))
    num_tokens = sum(len(seq) for seq in pairs.ids)
    if model.observer:
        model.observer.embed_tokenized(tokenize_ms, num_tokens)

    request_id = f"{model.gateway_id}-{next(model._ids)}"
    raw = await model._submit_and_wait(request_id, items, context, request.priority)
    results = [decode_result(raw[i]) for i in range(len(items))]
    failed = next((r for r in results if not r.ok), None)
    if failed is not None:
        raise from_result_code(failed.code, failed.message)
    scores = np.array([r.vector[0] for r in results], dtype=np.float32)
    if not request.raw_scores:
        scores = info.scoring.activate(scores)
    order = np.argsort(-scores, kind="stable")  # best first; ties keep document order
    if request.top_n is not None:
        order = order[:request.top_n]
    queue_ms = max(r.queue_ms for r in results)
    inference_ms = max(r.inference_ms for r in results)
    if model.observer:
        model.observer.embed_done(queue_ms, inference_ms, request.priority)
    return RerankOutput(
        results=[(int(i), float(scores[i])) for i in order], documents=request.documents,
        model=info.name, num_tokens=num_tokens,
        timing={"tokenize_ms": tokenize_ms, "queue_ms": queue_ms, "inference_ms": inference_ms,
                "total_ms": (time.perf_counter() - t_start) * 1000})


def rerank_response(out: RerankOutput, return_documents: bool) -> pb.RerankResponse:
    resp = pb.RerankResponse(model=out.model, usage=pb.Usage(prompt_tokens=out.num_tokens,
                                                           total_tokens=out.num_tokens),
                             timing=pb.Timing(**out.timing))
    for index, score in out.results:
        result = resp.results.add(index=index, score=score)
        if return_documents:
            result.document = out.documents[index]
    return resp


class RerankingService(EmbedderService):
    """The Embedder service with Rerank, Info naming each model's task, and Embed refusing a
    reranker by name."""

    async def Rerank(self, request: pb.RerankRequest, context: grpc.aio.ServicerContext) -> pb.RerankResponse:
        priority = priority_of(request)
        if priority is None:
            return await self.refuse_priority("Rerank", request, context)
        params = RerankInput(
            query=request.query, documents=list(request.documents), model=request.model,
            top_n=request.top_n if request.HasField("top_n") else None, raw_scores=request.raw_scores,
            return_documents=request.return_documents, truncate=request.truncate, priority=priority)

        async def run(model):
            return rerank_response(await rerank(model, params, context), params.return_documents)
        return await self._call("Rerank", request.model, run, context, priority)

    async def Embed(self, request, context: grpc.aio.ServicerContext):
        try:
            model = self.embedder.lookup(request.model)
        except Exception:  # refused by the embedding path itself, counted there
            model = None
        if model is None or not model.info.is_reranker:
            return await super().Embed(request, context)

        async def refuse_task(model):
            raise wrong_task(model.info, "embed")
        return await self._call("Embed", request.model, refuse_task, context)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        models = self.embedder.models

        async def info(model):
            return pb.InfoResponse(**await model.describe(), models=sorted(models), task=model.info.task,
                                   tasks={name: m.info.task for name, m in models.items()})
        return await self._call("Info", request.model or next(iter(models)), info, context)
