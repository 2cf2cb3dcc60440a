"""The Embedder servicer: validate -> tokenize -> enqueue -> wait for the reply -> respond."""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc

from tokq.gateway.errors import DeadlineExceeded, InvalidArgument, Unavailable, from_result_code, to_status
from tokq.gateway.replies import ReplyRouter
from tokq.gateway.tokenize import Tokenizer
from tokq import __version__
from tokq.config import GatewayConfig
from tokq.entry import decode_result, encode_body
from tokq.model_info import ModelInfo
from tokq.queue import Queue, QueueFull
from tokq.v1 import embedder_pb2 as pb
from tokq.v1 import embedder_pb2_grpc as pb_grpc


class EmbedderService(pb_grpc.EmbedderServicer):
    def __init__(self, info: ModelInfo, tokenizer: Tokenizer, queue: Queue, router: ReplyRouter,
                 config: GatewayConfig, gateway_id: str, observer=None) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.queue = queue
        self.router = router
        self.config = config
        self.gateway_id = gateway_id
        self._ids = itertools.count()
        self._observer = observer  # metrics hooks (gateway.observe), optional

    # -- RPCs ---------------------------------------------------------------------------------

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        return await self._call("Embed", self._embed, request, context)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return await self._call("Info", self._info, request, context)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        return await self._call("Tokenize", self._tokenize, request, context)

    async def _call(self, rpc: str, handler, request, context):
        start = time.perf_counter()
        if self._observer:
            self._observer.request_started(rpc)
        code = grpc.StatusCode.OK
        try:
            return await handler(request, context)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # mapped once, in gateway.errors
            code, message = to_status(exc)
        finally:
            if self._observer:
                self._observer.request_finished(rpc, code.name, time.perf_counter() - start)
        await context.abort(code, message)

    # -- handlers -----------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model and model not in (self.info.name, self.info.queue_name):
            raise InvalidArgument(f"unknown model {model!r}; this gateway serves {self.info.name!r}")

    def _prompt(self, request) -> str:
        name = request.prompt_name if request.HasField("prompt_name") else None
        try:
            return self.info.prompt(name)
        except KeyError:
            known = ", ".join(sorted(self.info.prompts)) or "none"
            raise InvalidArgument(f"unknown prompt_name {name!r}; {self.info.name} defines: {known}") from None

    def _check_inputs(self, inputs) -> list[str]:
        texts = list(inputs)
        if not texts:
            raise InvalidArgument("inputs is empty: send at least one string to embed")
        if len(texts) > self.config.max_inputs:
            raise InvalidArgument(f"{len(texts)} inputs in one request; the limit is "
                                  f"{self.config.max_inputs}: split the request")
        for i, text in enumerate(texts):
            if not text:
                raise InvalidArgument(f"input {i} is an empty string: every input needs text")
        return texts

    def _dimensions(self, request: pb.EmbedRequest) -> int:
        if not request.HasField("dimensions"):
            return 0
        dims = request.dimensions
        if not 1 <= dims <= self.info.hidden_size:
            raise InvalidArgument(f"dimensions={dims} is out of range: {self.info.name} gives 1.."
                                  f"{self.info.hidden_size} dimensions")
        return 0 if dims == self.info.hidden_size else dims

    def _timeout_ms(self, context) -> int:
        remaining = context.time_remaining()
        default = self.config.default_timeout_ms
        if remaining is None:
            return default
        if remaining <= 0:
            raise DeadlineExceeded("the call's deadline passed before it was queued")
        return max(1, min(default, int(remaining * 1000)))

    async def _embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        t_start = time.perf_counter()
        self._check_model(request.model)
        texts = self._check_inputs(request.inputs)
        dims = self._dimensions(request)
        prompt = self._prompt(request)
        normalize = request.normalize if request.HasField("normalize") else True
        self._timeout_ms(context)  # a call already past its deadline is not tokenized

        ids = await self.tokenizer.encode(texts, prompt=prompt, truncate=request.truncate)
        tokenize_ms = (time.perf_counter() - t_start) * 1000
        items = [(len(seq), encode_body(seq, normalize=normalize, dimensions=dims)) for seq in ids]
        num_tokens = sum(n for n, _ in items)
        if self._observer:
            self._observer.embed_tokenized(tokenize_ms, num_tokens)

        request_id = f"{self.gateway_id}-{next(self._ids)}"
        raw = await self._submit_and_wait(request_id, items, context)

        results = [decode_result(raw[i]) for i in range(len(items))]
        failed = next((r for r in results if not r.ok), None)
        if failed is not None:
            raise from_result_code(failed.code, failed.message)
        queue_ms = max(r.queue_ms for r in results)
        inference_ms = max(r.inference_ms for r in results)
        total_ms = (time.perf_counter() - t_start) * 1000
        if self._observer:
            self._observer.embed_done(queue_ms, inference_ms)
        return pb.EmbedResponse(
            embeddings=[pb.Embedding(values=r.vector.tolist()) for r in results],
            model=self.info.name,
            usage=pb.Usage(prompt_tokens=num_tokens, total_tokens=num_tokens),
            timing=pb.Timing(tokenize_ms=tokenize_ms, queue_ms=queue_ms,
                             inference_ms=inference_ms, total_ms=total_ms),
        )

    async def _submit_and_wait(self, request_id: str, items, context) -> dict[int, bytes]:
        done = self.router.expect(request_id, len(items))
        collected = False
        try:
            timeout_ms = self._timeout_ms(context)  # what is left after tokenizing
            await self.queue.enqueue(request_id, items, timeout_ms=timeout_ms,
                                     channel=self.router.channel)
            self.router.enqueued(request_id)
            try:
                await asyncio.wait_for(done, timeout=timeout_ms / 1000)
            except TimeoutError:
                raise DeadlineExceeded(f"no answer within the deadline ({timeout_ms} ms); "
                                       "the service is overloaded or no worker is running") from None
            raw = await self.queue.collect(request_id)  # safe to repeat: see tokq.queue
            collected = True
            if len(raw) < len(items):  # Redis restarted or flushed between notice and collect
                raise Unavailable("the request's state vanished from Redis; retry it")
            return raw
        except QueueFull:
            collected = True  # a rejected enqueue queues nothing (a repeat is never rejected)
            raise
        finally:
            self.router.forget(request_id)
            if not collected:
                # Cancelled, timed out or failed, possibly while the enqueue was in flight or
                # with its answer lost (LostAnswer: queued or not, we cannot tell): withdraw it
                # (O(1)) so no worker spends time on it and nothing stays behind.
                await asyncio.shield(self._cancel_quietly(request_id))

    async def _cancel_quietly(self, request_id: str) -> None:
        try:
            await self.queue.cancel(request_id)
        except Exception:  # Redis gone: the reply key expires by its TTL anyway
            pass

    async def _info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        budget = await self.queue.get_budget()
        return pb.InfoResponse(
            model=self.info.name, dimensions=self.info.hidden_size,
            max_input_length=self.info.max_length, token_budget=budget or 0,
            max_inputs=self.config.max_inputs, prompt_names=sorted(self.info.prompts),
            default_prompt_name=self.info.default_prompt_name or "", pooling=self.info.pooling,
            version=__version__)

    async def _tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        self._check_model(request.model)
        texts = self._check_inputs(request.inputs)
        ids = await self.tokenizer.encode(texts, prompt=self._prompt(request), truncate=request.truncate)
        return pb.TokenizeResponse(
            model=self.info.name,
            inputs=[pb.TokenizedInput(ids=seq, tokens=self.tokenizer.tokens(seq)) for seq in ids])

