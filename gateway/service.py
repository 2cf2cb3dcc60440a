"""The gRPC Embedder servicer: a thin adapter from tokq.v1 messages to the shared embedding path
(gateway/embedding.py) and from its exceptions to gRPC status codes (gateway/errors.py)."""

from __future__ import annotations

import asyncio

import grpc

from tokq.gateway.embedding import EmbedInput, Embedder
from tokq.gateway.errors import refuse, to_status
from tokq.gateway.priority import BY_ENUM, KEY_DEFAULT, from_enum, resolve
from tokq.gateway.wire import MAX_SEND_MESSAGE_BYTES, embed_response
from tokq.client import GATEWAY_ID_METADATA
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


def priority_of(request) -> str | None:
    """The class a request is queued in: its ``priority``, else its API key's default (set by
    gateway.auth's interceptor), else interactive; None for a value the enum does not define."""
    if request.priority and request.priority not in BY_ENUM:
        return None
    return resolve(from_enum(request.priority), KEY_DEFAULT.get())


class EmbedderService(pb_grpc.EmbedderServicer):
    def __init__(self, embedder: Embedder, gateway_id: str = "") -> None:
        self.embedder = embedder
        # Which process answered, in each response's trailing metadata: tokq.Client balances its
        # connections by it (SO_REUSEPORT spreads connections, not calls, over `--procs`).
        self._identity = ((GATEWAY_ID_METADATA, gateway_id),) if gateway_id else None

    def count_refused(self, rpc: str, code: str) -> None:
        """A call refused before any model was named (a request that does not parse, gateway/
        wire.py): counted under model "", as the embedder counts such calls."""
        if self.embedder.unrouted is not None:
            self.embedder.unrouted.count(rpc, code, 0.0)

    async def _call(self, rpc: str, model_name: str, operation, context: grpc.aio.ServicerContext,
                    priority: str = ""):
        if self._identity:
            context.set_trailing_metadata(self._identity)
        try:
            return await self.embedder.observed(rpc, model_name, operation, context, priority)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # mapped once, in gateway.errors
            code, message = to_status(exc)
        refuse(context, code, message)
        return None

    async def refuse_priority(self, rpc: str, request, context: grpc.aio.ServicerContext):
        """Refuse a request whose priority names no class (INVALID_ARGUMENT, raised inside the
        call as other bad fields are), counted as its model's calls are."""
        async def refuse_call(model):
            from_enum(request.priority)
        return await self._call(rpc, request.model, refuse_call, context)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> bytes:
        """Returns the EmbedResponse's wire bytes (gateway/wire.py registers it so)."""
        priority = priority_of(request)
        if priority is None:
            return await self.refuse_priority("Embed", request, context)
        params = EmbedInput(
            texts=list(request.inputs), token_ids=[list(t.ids) for t in request.token_inputs],
            model=request.model, truncate=request.truncate,
            normalize=_optional(request, "normalize"), dimensions=_optional(request, "dimensions"),
            prompt_name=_optional(request, "prompt_name"), max_reply_bytes=MAX_SEND_MESSAGE_BYTES,
            priority=priority)

        async def embed(model):
            out = await model.embed(params, context)
            return embed_response(out.vectors, out.model, out.num_tokens, out.timing)
        return await self._call("Embed", request.model, embed, context, priority)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        async def info(model):
            return pb.InfoResponse(**await model.describe(), models=sorted(self.embedder.models))
        # No model named: the first one served (the others are listed in `models`).
        return await self._call("Info", request.model or next(iter(self.embedder.models)),
                                info, context)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        async def tokenize(model):
            ids = await model.tokenize(request.inputs, truncate=request.truncate,
                                       prompt_name=_optional(request, "prompt_name"))
            return pb.TokenizeResponse(
                model=model.info.name,
                inputs=[pb.TokenizedInput(ids=seq, tokens=model.tokenizer.tokens(seq)) for seq in ids])
        return await self._call("Tokenize", request.model, tokenize, context)
