"""The embedding path every transport shares: look the model up -> validate -> tokenize (or take
the caller's token ids) -> enqueue -> wait for the reply -> results.

gRPC (gateway/service.py) and HTTP (gateway/http.py) are thin adapters over ``Embedder``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tokq import __version__
from tokq.tasks import stop_tasks
from tokq.config import GatewayConfig
from tokq.queue.wire import decode_result, encode_body
from tokq.gateway.prompt_boundary import PromptBoundary
from tokq.gateway.errors import (DeadlineExceeded, InvalidArgument, ModelNotFound, ServiceError,
                                 Unavailable, from_result_code, status_name)
from tokq.gateway.replies import ReplyRouter
from tokq.gateway.tokenize import Tokenizer
from tokq.gateway.validate import Limits, check_text_sizes, check_token_ids
from tokq.gateway.wire import embed_response_max_bytes
from tokq.model.info import ModelInfo
from tokq.queue.priority import DEFAULT_PRIORITY
from tokq.queue.shard import QueueFull, RequestCancelled
from tokq.queue.sharded import ShardedQueue


class Deadline(Protocol):
    """What is left of a call's time: grpc.aio's ServicerContext is one, ``Timer`` another."""

    def time_remaining(self) -> float | None: ...


class Timer:
    """A deadline for transports that carry none of their own (HTTP): None = the default."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self._end = None if timeout_s is None else time.monotonic() + timeout_s

    def time_remaining(self) -> float | None:
        return None if self._end is None else self._end - time.monotonic()


@dataclass(frozen=True)
class EmbedInput:
    """One embedding request, whatever it came over. Exactly one of ``texts``/``token_ids``."""

    texts: list[str] | list[bytes] = field(default_factory=list)  # bytes: UTF-8 (gateway/wire.py)
    token_ids: list[list[int]] = field(default_factory=list)
    model: str = ""
    truncate: bool = False
    normalize: bool | None = None  # None: true (unit length)
    dimensions: int | None = None  # None: the model's full dimension
    prompt_name: str | None = None  # None: the model's default prompt, if any
    max_reply_bytes: int | None = None  # the transport's message limit (gRPC's), None: none
    priority: str = DEFAULT_PRIORITY  # the queue class, resolved by the transport (gateway/priority.py)


@dataclass(frozen=True)
class EmbedOutput:
    vectors: list[np.ndarray]  # float32, one per input, in input order
    model: str
    num_tokens: int
    timing: dict[str, float]  # tokenize_ms, queue_ms, inference_ms, total_ms


class ServedModel:
    """One model this gateway serves: its tokenizer, its queue and the calls waiting on it."""

    def __init__(self, info: ModelInfo, tokenizer: Tokenizer, queue: ShardedQueue, router: ReplyRouter,
                 config: GatewayConfig, gateway_id: str, observer=None) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.queue = queue
        self.router = router
        self.config = config
        self.gateway_id = gateway_id
        self.observer = observer  # metrics hooks (tokq.metrics.GatewayMetrics), optional
        self._ids = itertools.count()
        self._cancels: set[asyncio.Task] = set()  # cancel scripts still running
        self._enqueuing = 0  # enqueues awaiting their answer: a stopped call cancels after it
        self.limits = Limits.resolve(info, config)  # byte caps, checked before tokenizing
        self._prompt_boundary = PromptBoundary(info, tokenizer)

    # -- validation ---------------------------------------------------------------------------

    def _prompt(self, prompt_name: str | None) -> str:
        try:
            return self.info.prompt(prompt_name)
        except KeyError:
            known = ", ".join(sorted(self.info.prompts)) or "none"
            raise InvalidArgument(f"unknown prompt_name {prompt_name!r}; {self.info.name} defines: {known}",
                                  param="prompt_name") from None

    def _check_count(self, num_inputs: int) -> None:
        if not num_inputs:
            raise InvalidArgument("inputs is empty: send at least one string to embed", param="input")
        if num_inputs > self.config.max_inputs:
            raise InvalidArgument(f"{num_inputs} inputs in one request; the limit is "
                                  f"{self.config.max_inputs}: split the request", param="input")

    def _check_reply_size(self, num_inputs: int, dims: int, max_bytes: int | None) -> None:
        """Refuse before any work a request whose response could not be sent: computed in full, it
        would fail RESOURCE_EXHAUSTED, which callers retry."""
        dims = dims or self.info.hidden_size
        if max_bytes is None or embed_response_max_bytes(num_inputs, dims) <= max_bytes:
            return
        fit = (max_bytes - embed_response_max_bytes(0, dims)) // (dims * 4 + 8)
        raise InvalidArgument(f"{num_inputs:,} inputs of {dims} dimensions do not fit one reply (at most "
                              f"{max_bytes >> 20} MiB): send at most {fit:,} inputs a request", param="input")

    def _check_texts(self, inputs) -> list[str] | list[bytes]:
        texts = list(inputs)
        self._check_count(len(texts))
        for i, text in enumerate(texts):
            if not text:
                raise InvalidArgument(f"input {i} is an empty string: every input needs text", param="input")
        return texts

    def _check_token_ids(self, inputs, truncate: bool) -> list[list[int]]:
        """Caller-tokenized inputs, used as given (special tokens included, as Tokenize returns
        them): every id must be in the vocabulary; over-long ones are cut or refused like text."""
        seqs = [list(seq) for seq in inputs]
        self._check_count(len(seqs))
        max_len = self.info.max_length
        for i, seq in enumerate(seqs):
            if not seq:
                raise InvalidArgument(f"input {i} has no token ids: every input needs at least one",
                                      param="input")
        check_token_ids(seqs, self.info)  # ids past the embedding table crash a forward
        for i, seq in enumerate(seqs):
            if len(seq) > max_len:
                if not truncate:
                    raise InvalidArgument(
                        f"input {i} is {len(seq)} tokens long; {self.info.name} takes at most "
                        f"{max_len} tokens per input. Shorten it or set truncate=true to cut it "
                        f"to {max_len}.", param="input")
                seqs[i] = seq[:max_len]
        return seqs

    def _dimensions(self, dims: int | None) -> int:
        if dims is None:
            return 0
        if not 1 <= dims <= self.info.hidden_size:
            raise InvalidArgument(f"dimensions={dims} is out of range: {self.info.name} gives 1.."
                                  f"{self.info.hidden_size} dimensions", param="dimensions")
        return 0 if dims == self.info.hidden_size else dims

    def _timeout_ms(self, context: Deadline) -> int:
        """What is left of the call's own deadline (longer or shorter than the default, up to
        max_timeout_ms), or the default for a call that set none."""
        remaining = context.time_remaining()
        if remaining is None:
            return min(self.config.default_timeout_ms, self.config.max_timeout_ms)
        if remaining <= 0:
            raise DeadlineExceeded("the call's deadline passed before it was queued")
        return max(1, min(self.config.max_timeout_ms, int(remaining * 1000)))

    # -- operations ---------------------------------------------------------------------------

    async def embed(self, request: EmbedInput, context: Deadline) -> EmbedOutput:
        t_start = time.perf_counter()
        if request.texts and request.token_ids:
            raise InvalidArgument("send either text inputs or token-id inputs, not both", param="input")
        dims = self._dimensions(request.dimensions)
        normalize = True if request.normalize is None else request.normalize
        if request.token_ids:
            if request.prompt_name is not None:
                raise InvalidArgument("prompt_name applies to text inputs only: token-id inputs are "
                                      "used as given", param="prompt_name")
            ids = self._check_token_ids(request.token_ids, request.truncate)
            self._check_reply_size(len(ids), dims, request.max_reply_bytes)
            prompt = ""
            self._timeout_ms(context)
        else:
            texts = self._check_texts(request.texts)
            self._check_reply_size(len(texts), dims, request.max_reply_bytes)
            sizes = check_text_sizes(texts, self.limits)  # bytes (gRPC) are decoded by the tokenizer
            prompt = self._prompt(request.prompt_name)
            self._timeout_ms(context)  # a call already past its deadline is not tokenized
            ids = await self.tokenizer.encode(
                texts, prompt=prompt, truncate=request.truncate,
                cost_bytes=self.tokenizer.cost_bytes(sizes, request.truncate))
        tokenize_ms = (time.perf_counter() - t_start) * 1000
        # A shared prompt is computed once by the worker: the queue counts only the rest.
        prompt_lens = self._prompt_boundary.prompt_lens(prompt, ids)
        items = [(len(seq) - p, encode_body(seq, normalize=normalize, dimensions=dims, prompt_len=p))
                 for seq, p in zip(ids, prompt_lens)]
        num_tokens = sum(len(seq) for seq in ids)
        if self.observer:
            self.observer.embed_tokenized(tokenize_ms, num_tokens)

        request_id = f"{self.gateway_id}-{next(self._ids)}"
        raw = await self._submit_and_wait(request_id, items, context, request.priority)

        results = [decode_result(raw[i]) for i in range(len(items))]
        failed = next((r for r in results if not r.ok), None)
        if failed is not None:
            raise from_result_code(failed.code, failed.message)
        queue_ms = max(r.queue_ms for r in results)
        inference_ms = max(r.inference_ms for r in results)
        total_ms = (time.perf_counter() - t_start) * 1000
        if self.observer:
            self.observer.embed_done(queue_ms, inference_ms, request.priority)
        return EmbedOutput(
            vectors=[r.vector for r in results], model=self.info.name, num_tokens=num_tokens,
            timing={"tokenize_ms": tokenize_ms, "queue_ms": queue_ms,
                    "inference_ms": inference_ms, "total_ms": total_ms})

    async def _submit_and_wait(self, request_id: str, items, context,
                               priority: str = DEFAULT_PRIORITY) -> dict[int, bytes]:
        """Enqueue ``items`` in class ``priority`` and wait for every result."""
        done = self.router.expect(request_id, len(items))
        collected = False
        sent = answered = False  # the enqueue started; its answer came (it ran, and cannot later)
        try:
            timeout_ms = self._timeout_ms(context)  # what is left after tokenizing
            self._enqueuing += 1
            sent = True
            try:
                await self.queue.producer.enqueue(request_id, items, timeout_ms=timeout_ms,
                                                  gateway_id=self.gateway_id, priority=priority)
                answered = True
            finally:
                self._enqueuing -= 1
            self.router.enqueued(request_id)
            # A timer on the reply's own future, not asyncio.wait_for (a waiter future, a
            # callback and a handle more per call).
            timer = done.get_loop().call_later(timeout_ms / 1000, _time_out, done, timeout_ms)
            try:
                raw = await done
            finally:
                timer.cancel()
            if raw is None:  # the notice did not carry the results (large, or a poll found them)
                raw = await self.queue.producer.collect(request_id)  # safe to repeat: see tokq.queue.shard
            else:  # delivered in the notice: Redis drops the reply by itself after a short grace
                self.queue.producer.forget(request_id)
            collected = True
            if len(raw) < len(items):  # Redis restarted or flushed between notice and collect
                raise Unavailable("the request's state vanished from Redis; retry it")
            return raw
        except QueueFull:
            collected = True  # a rejected enqueue queues nothing (a repeat is never rejected)
            raise
        except RequestCancelled:  # already cancelled while its enqueue was out
            collected = True
            raise Unavailable("the request was cancelled before it was queued; retry it") from None
        finally:
            self.router.forget(request_id)
            if sent and not collected:
                # Cancel the request so no worker computes it; the caller is not kept waiting
                # for that (docs/internals.md, "Cancelling a call's request").
                loop = asyncio.get_running_loop()
                self._track_cancel(loop.create_task(self._cancel_quietly(request_id, answered)))

    def _track_cancel(self, task: asyncio.Task) -> None:
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _cancel_quietly(self, request_id: str, enqueue_answered: bool = True) -> None:
        try:
            await self.queue.producer.cancel(request_id, enqueue_answered=enqueue_answered)
        except Exception:  # Redis gone: the reply key expires by its TTL anyway
            pass

    async def finish_cancels(self, timeout_s: float) -> None:
        """At shutdown, before the Redis clients close: wait up to ``timeout_s`` for the cancels
        running and those started meanwhile, then stop the rest (reply keys expire by their TTL)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (left := deadline - loop.time()) > 0:
            if running := {t for t in self._cancels if not t.done()}:
                await asyncio.wait(running, timeout=left)
            elif self._enqueuing:  # a stopped call's cancel starts when its enqueue answers
                await asyncio.sleep(min(left, 0.01))
            else:
                break
        await stop_tasks(list(self._cancels))

    async def tokenize(self, texts, *, truncate: bool = False, prompt_name: str | None = None) -> list[list[int]]:
        texts = self._check_texts(texts)
        sizes = check_text_sizes(texts, self.limits)
        return await self.tokenizer.encode(texts, prompt=self._prompt(prompt_name), truncate=truncate,
                                           cost_bytes=self.tokenizer.cost_bytes(sizes, truncate))

    async def describe(self) -> dict:
        """What a client may want to know before calling: limits, prompts, the published budget."""
        budget = await self.queue.shard(0).get_budget()
        return {"model": self.info.name, "dimensions": self.info.hidden_size,
                "max_input_length": self.info.max_length, "token_budget": budget or 0,
                "max_inputs": self.config.max_inputs, "prompt_names": sorted(self.info.prompts),
                "default_prompt_name": self.info.default_prompt_name or "",
                "pooling": self.info.pooling, "version": __version__}


def _time_out(done: asyncio.Future, timeout_ms: int) -> None:
    if not done.done():
        done.set_exception(DeadlineExceeded(f"no answer within the deadline ({timeout_ms} ms); "
                                            "the service is overloaded or no worker is running"))


class Embedder:
    """The models this gateway serves, looked up per request by name (or queue name)."""

    def __init__(self, models: Mapping[str, ServedModel], unrouted=None) -> None:
        """``unrouted``: where calls refused before they named a served model are counted
        (tokq.metrics.RequestCounts, model label ""); None: not counted."""
        if not models:
            raise ValueError("a gateway serves at least one model")
        self.models = dict(models)
        self._aliases = {m.info.queue_name: m for m in self.models.values()}
        self.unrouted = unrouted

    def lookup(self, name: str) -> ServedModel:
        """'' picks the only model; an unknown name is ModelNotFound (INVALID_ARGUMENT / HTTP 404)."""
        if not name:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise InvalidArgument(f"this gateway serves several models: name one of "
                                  f"{', '.join(sorted(self.models))}", param="model")
        model = self.models.get(name) or self._aliases.get(name)
        if model is None:
            raise ModelNotFound(f"unknown model {name!r}; this gateway serves "
                                f"{', '.join(repr(n) for n in sorted(self.models))}", param="model")
        return model

    async def observed(self, rpc: str, model_name: str, operation, deadline: Deadline | None = None,
                       priority: str = ""):
        """Run ``operation(model)``, counted in that model's metrics under ``rpc``, its gRPC status
        name and ``priority`` (the call's class, "" where none applies); an unserved name counts as
        refused. ``deadline`` tells expiry from a hang-up: gRPC stops the handler when the deadline
        passes, often before the gateway's own timer."""
        start = time.perf_counter()
        try:
            model = self.lookup(model_name)
        except ServiceError as exc:
            self.refused(rpc, exc, start, priority)
            raise
        if model.observer:
            model.observer.request_started(rpc)
        code = "OK"
        try:
            return await operation(model)
        except asyncio.CancelledError:
            code = "DEADLINE_EXCEEDED" if _expired(deadline) else "CANCELLED"
            raise
        except BaseException as exc:
            code = status_name(exc)
            raise
        finally:
            if model.observer:
                model.observer.request_finished(rpc, code, time.perf_counter() - start, priority)

    def refused(self, rpc: str, exc: BaseException, start: float, priority: str = "") -> None:
        """Count a call refused before it reached a served model (``start``: its perf_counter)."""
        if self.unrouted is not None:
            self.unrouted.count(rpc, status_name(exc), time.perf_counter() - start, priority)


def _expired(deadline: Deadline | None) -> bool:
    remaining = deadline.time_remaining() if deadline is not None else None
    return remaining is not None and remaining <= 0
