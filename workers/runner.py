"""One claimed batch -> one result per item, whatever goes wrong in between: bad inputs are
refused alone, a failed forward is bisected down to the poison input, a sticky device error
exits for the supervisor, and non-finite vectors are never returned (docs/internals.md).
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokq.batch import PackedBatch
from tokq.queue.wire import Body, decode_body, encode_error, encode_ok
from tokq.workers.errors import Fault, classify, release_memory

log = logging.getLogger("tokq.worker")

EXIT_DEVICE_ERROR = 3  # the worker's exit status after a sticky device error
_MAX_MESSAGE = 300


_NO_IDS = Body(np.zeros(0, dtype=np.int64), normalize=True, dimensions=0)


def _decoded(raw: bytes) -> tuple[Body, str | None]:
    """``raw``'s body, or a stand-in and why it cannot be read: a malformed entry is answered
    INTERNAL alone rather than taking down each worker its lease's redo reaches."""
    try:
        return decode_body(raw), None
    except (struct.error, ValueError) as exc:
        return _NO_IDS, f"malformed queue entry body ({len(raw)} bytes): {exc}"


class DeviceUnhealthy(RuntimeError):
    """The device failed in a way no retry fixes; the worker must be restarted."""


def exit_for_supervisor(code: int) -> None:
    logging.shutdown()
    os._exit(code)  # from the forward's thread: no cleanup that could touch the broken device


@dataclass
class BatchOutcome:
    results: list  # (Entry, result bytes)
    # Tokens of each item whose forward completed, in batch order ([] when none did): what the
    # worker's forward metrics (tokens, FLOPs, MFU) count.
    seqlens: list[int]
    # Its forward's seconds, less any light batches nested in it (they have their own).
    forward_s: float
    num_failed: int
    graphed: bool = False  # its (last) forward replayed a CUDA graph
    nested: int = 0  # light batches run nested in this (heavy) forward: pre-emptions
    nested_s: float = 0.0  # their seconds, left out of forward_s


class BatchRunner:
    """Runs claimed batches on ``engine``. ``exit(code)`` ends the process after a sticky
    device error; ``release()`` frees device memory after a failed forward (both injectable
    for tests)."""

    def __init__(self, engine, *, observer=None, exit: Callable[[int], None] = exit_for_supervisor,
                 release: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self.exit = exit
        self.release = release or (lambda: release_memory(engine.device))
        self.healthy = True
        self.vocab_size = int(engine.info.config.get("vocab_size") or 0)
        self.max_length = engine.info.max_length

    def run(self, claim) -> BatchOutcome:
        if not self.healthy:
            raise DeviceUnhealthy("the worker's device failed earlier; it must be restarted")
        entries = claim.entries
        start = time.perf_counter()
        failures: dict[int, tuple[str, str]] = {}  # item -> (gRPC code name, message)
        bodies = []
        for i, entry in enumerate(entries):
            body, malformed = _decoded(entry.body)
            bodies.append(body)
            if malformed:  # the service's fault (a writer of another version), not the caller's
                failures[i] = ("INTERNAL", malformed)
            elif reason := self._invalid(body):
                failures[i] = ("INVALID_ARGUMENT", reason)
        vectors = np.zeros((len(bodies), self.engine.info.hidden_size), dtype=np.float32)
        todo = [i for i in range(len(bodies)) if i not in failures]
        graphed = bool(todo) and self._embed_into(bodies, todo, vectors, failures)
        forwarded = [i for i in todo if i not in failures]  # before non-finite refusals: those ran
        nonfinite = [i for i in todo if i not in failures and not np.isfinite(vectors[i]).all()]
        for i in nonfinite:
            failures[i] = ("INTERNAL", f"the model gave a non-finite (NaN/inf) vector for this input "
                                       f"in {str(self.engine.dtype).removeprefix('torch.')} (an "
                                       "overflow); it was not returned")
        if nonfinite:
            log.error("batch %s: %d non-finite vector(s) refused", claim.batch_id, len(nonfinite))
            if self.observer:
                self.observer.observe_nonfinite(len(nonfinite))
        forward_s = time.perf_counter() - start
        forward_ms = forward_s * 1000
        results = []
        for i, (entry, body) in enumerate(zip(entries, bodies)):
            if i in failures:
                results.append((entry, encode_error(*failures[i])))
                continue
            dims = body.dimensions or vectors.shape[1]
            queue_ms = max(0.0, float(claim.now_ms - entry.ts_ms))
            results.append((entry, encode_ok(vectors[i, :dims], queue_ms, forward_ms)))
        # The queued tokens (a shared prompt's are not: the engine computes it once, from cache)
        return BatchOutcome(results, [entries[i].num_tokens for i in forwarded], forward_s,
                            len(failures), graphed)

    def _invalid(self, body: Body) -> str | None:
        ids = body.token_ids
        if ids.size == 0:
            return "an input needs at least one token"
        if ids.size > self.max_length:
            return f"input of {ids.size} tokens exceeds the model's max length {self.max_length}"
        if self.vocab_size and int(ids.max()) >= self.vocab_size:
            return (f"token id {int(ids.max())} is out of range: the model's vocabulary has "
                    f"{self.vocab_size} ids (0..{self.vocab_size - 1})")
        return None

    def _embed(self, bodies: list[Body]) -> np.ndarray:
        batch = PackedBatch.pack([b.token_ids for b in bodies],
                                 normalize=[b.normalize for b in bodies],
                                 dimensions=[b.dimensions for b in bodies],
                                 prompt_lens=[b.prompt_len for b in bodies],
                                 segment_starts=[b.segment_start for b in bodies])
        return self.engine.embed(batch)

    def _embed_into(self, bodies: list[Body], items: list[int], vectors: np.ndarray,
                    failures: dict[int, tuple[str, str]]) -> bool:
        """Embed ``items`` into ``vectors``; on failure bisect until each bad item fails alone.
        True if a forward that succeeded replayed a CUDA graph. (Returned, not kept on the
        runner: a light batch nested in this forward runs through this runner too.)"""
        try:
            vectors[items] = self._embed([bodies[i] for i in items])
            return self.engine.last_graphed  # set by that forward, after any batch nested in it
        except Exception as exc:  # noqa: BLE001 - classified below, after the exception is gone
            fault, message = classify(exc), f"{type(exc).__name__}: {exc}".splitlines()[0][:_MAX_MESSAGE]
        # Out of the except block: the traceback (the forward's activations) is released, so
        # the memory can be handed back.
        if fault is Fault.DEVICE:
            self._device_failed(message)
        self.release()
        if len(items) == 1:
            failures[items[0]] = ("INTERNAL", f"the worker failed on this input: {message}")
            return False
        log.warning("%d-item forward failed (%s: %s); splitting it in two", len(items), fault.value, message)
        half = len(items) // 2
        first = self._embed_into(bodies, items[:half], vectors, failures)
        return self._embed_into(bodies, items[half:], vectors, failures) or first

    def _device_failed(self, message: str) -> None:
        self.healthy = False
        log.critical("device error, worker unhealthy, exiting (status %d) for its supervisor to "
                     "restart it; the batch is redone after its lease: %s", EXIT_DEVICE_ERROR, message)
        if self.observer:
            self.observer.observe_error("device")
        self.exit(EXIT_DEVICE_ERROR)
        raise DeviceUnhealthy(message)  # only reached when exit() returns (tests)
