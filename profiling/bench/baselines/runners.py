"""How each baseline turns requests into ``encode`` calls, in a thread beside the gRPC loop, skipping
callers gone: ``OneAtATime`` (each request alone), ``PaddedBatching`` (Triton-style: N inputs or X ms)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Encoded:
    vectors: np.ndarray  # float32 [n, dim], unit length (the model ends in Normalize)
    num_tokens: int  # after truncation, special tokens included
    queue_ms: float  # waiting for the model
    inference_ms: float  # the encode call that served this request


def _encode(model, texts: list[str]) -> tuple[np.ndarray, list[int], float]:
    """One padded encode of ``texts`` (a single forward) -> vectors, token counts, ms."""
    start = time.perf_counter()
    vectors = model.encode(texts, batch_size=len(texts), normalize_embeddings=True,
                           convert_to_numpy=True, show_progress_bar=False)
    lengths = [len(ids) for ids in model.tokenizer(texts, truncation=True, max_length=model.max_seq_length,
                                                   return_attention_mask=False)["input_ids"]]
    return np.asarray(vectors, dtype=np.float32), lengths, (time.perf_counter() - start) * 1000


class OneAtATime:
    kind = "one-at-a-time"

    def __init__(self, model, kind: str = "one-at-a-time") -> None:
        self.model, self.kind = model, kind
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="encode")

    def describe(self) -> dict:
        return {"kind": self.kind}

    async def start(self) -> None:
        pass

    async def embed(self, texts: list[str]) -> Encoded:
        submitted = time.perf_counter()

        def run() -> tuple[np.ndarray, list[int], float, float]:
            queue_ms = (time.perf_counter() - submitted) * 1000
            return (*_encode(self.model, texts), queue_ms)

        # A cancelled call's work item is dropped if it has not started yet.
        vectors, lengths, inference_ms, queue_ms = await asyncio.get_running_loop().run_in_executor(
            self._pool, run)
        return Encoded(vectors, sum(lengths), queue_ms, inference_ms)

    async def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Pending:
    texts: list[str]
    future: asyncio.Future
    arrived: float  # perf_counter seconds


class PaddedBatching:
    kind = "padded-batching"

    def __init__(self, model, max_batch_size: int = 64, max_wait_ms: float = 10.0) -> None:
        if max_batch_size < 1 or max_wait_ms < 0:
            raise ValueError("need max_batch_size >= 1 and max_wait_ms >= 0")
        self.model, self.max_batch_size, self.max_wait_ms = model, max_batch_size, max_wait_ms
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="encode")
        self._pending: asyncio.Queue[_Pending] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.num_batches = 0
        self.num_inputs = 0  # inputs encoded (requests whose caller left are not)

    def describe(self) -> dict:
        return {"kind": self.kind, "max_batch_size": self.max_batch_size, "max_wait_ms": self.max_wait_ms}

    async def start(self) -> None:
        self._task = asyncio.create_task(self._batch_loop(), name="padded-batching")

    async def embed(self, texts: list[str]) -> Encoded:
        future = asyncio.get_running_loop().create_future()
        await self._pending.put(_Pending(list(texts), future, time.perf_counter()))
        return await future

    async def _next_batch(self) -> list[_Pending]:
        batch = [await self._pending.get()]
        deadline = batch[0].arrived + self.max_wait_ms / 1000
        while sum(len(p.texts) for p in batch) < self.max_batch_size:
            if not self._pending.empty():
                batch.append(self._pending.get_nowait())
                continue
            remaining_s = deadline - time.perf_counter()
            if remaining_s <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._pending.get(), remaining_s))
            except TimeoutError:
                break
        return batch

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [p for p in await self._next_batch() if not p.future.done()]  # callers gone
            if not batch:
                continue
            started = time.perf_counter()
            texts = [t for p in batch for t in p.texts]
            try:
                vectors, lengths, inference_ms = await loop.run_in_executor(
                    self._pool, _encode, self.model, texts)
            except Exception as exc:  # fail this batch's calls, keep serving
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            self.num_batches += 1
            self.num_inputs += len(texts)
            first = 0
            for p in batch:
                n = len(p.texts)
                if not p.future.done():
                    p.future.set_result(Encoded(vectors[first:first + n], sum(lengths[first:first + n]),
                                                (started - p.arrived) * 1000, inference_ms))
                first += n

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)


ONNX_ONE_AT_A_TIME = "onnx-one-at-a-time"
KINDS = (OneAtATime.kind, ONNX_ONE_AT_A_TIME, PaddedBatching.kind)


def make_runner(kind: str, model, *, max_batch_size: int = 64, max_wait_ms: float = 10.0):
    """``model``: a SentenceTransformer, or an OnnxSentenceEncoder for the onnx kind."""
    if kind in (OneAtATime.kind, ONNX_ONE_AT_A_TIME):
        return OneAtATime(model, kind)
    if kind == PaddedBatching.kind:
        return PaddedBatching(model, max_batch_size, max_wait_ms)
    raise ValueError(f"unknown baseline {kind!r}; known: {', '.join(KINDS)}")
