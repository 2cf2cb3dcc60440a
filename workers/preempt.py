"""Light work pre-empts a heavy forward between two steps of its layers.

While a worker runs a heavy batch (more tokens than ``tokq.queue.claim_rule.preempt_budget``, mostly
heavy-lane or batch-class work: workers/loop.py is_heavy) it is registered as pre-emptible; light work arriving then tells it 'light' (lua/enqueue.lua), and its
event loop claims that work light-only and leaves it in this slot. The forward thread looks at
the slot after each step of each layer (qkv, attention, out-proj, MLP up, MLP down: the models
call ``checkpoint``) and runs a waiting batch to completion right there, nested, then goes on: a
one-word call waits for one step of the heavy forward (one linear layer), not for all of it. On CUDA the nested
kernels queue behind the heavy ones already launched, in stream order, so this holds there too.
The nested forward shares no tensor with the heavy one: both batches' vectors are as if run alone.
Nesting is for light work that arrives a little at a time: a heavy forward takes nested batches
until they hold ``preempt_budget`` tokens, and a light lane longer than that goes in full batches.
A batch-class (bulk) forward has no cap: its nested claims take what fits, one per checkpoint at most.
The slot counts the batches that ran nested, and their seconds: the heavy batch's forward time
leaves those out (workers/loop.py), so the forward seconds of both add up to the device's.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_local = threading.local()  # the forward thread's checkpoint while it runs a heavy batch


def no_checkpoint() -> None:
    """The models' checkpoint when nothing may pre-empt them."""


def current_checkpoint() -> Callable[[], None]:
    """The checkpoint the models call between steps in this thread (Engine.embed passes it)."""
    return getattr(_local, "checkpoint", no_checkpoint)


def _resolve(future: asyncio.Future, outcome: Any, exc: BaseException | None) -> None:
    if future.done():  # the waiter was cancelled (the worker stopped)
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(outcome)


class Preemption:
    """The slot between a worker's event loop (``offer``) and its forward thread (``heavy``,
    ``checkpoint``). ``run(claim)`` runs one batch (BatchRunner.run)."""

    def __init__(self, run: Callable[[Any], Any]) -> None:
        self._run = run
        self._lock = threading.Lock()
        self._armed = False  # a heavy forward is handed to its thread (arm) and not at its end
        self._waiting: tuple[Any, asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self._inside = False  # a nested batch runs: no pre-emption inside it
        # Batches run nested in the heavy forward running (or the last one), and their seconds;
        # one offered too late, run after the forward, is in neither: it pre-empted nothing.
        self.nested_runs = 0
        self.nested_s = 0.0

    @property
    def waiting(self) -> Any:
        """The claim left in the slot, not yet taken by the forward thread (None: none)."""
        waiting = self._waiting
        return waiting[0] if waiting else None

    def arm(self) -> None:
        """From the event loop, as a heavy forward is handed to its thread: offers are taken
        from now on. The thread may start after the pre-empting claim (a busy executor, a
        loaded machine); its first checkpoint runs what waits. A claim left by a forward that
        never started (cancelled: its worker stops) is dropped; its lease expires."""
        with self._lock:
            self._armed = True
            self._waiting = None

    def heavy(self, run_heavy: Callable[[], T]) -> T:
        """In the forward thread: ``run_heavy()`` with pre-emption on (armed here too, if the
        caller did not ``arm`` first). A batch offered too late to nest (the heavy forward had
        passed its last block) runs right after it, here. ``nested_runs`` and ``nested_s`` are
        this forward's once it returns."""
        with self._lock:
            self._armed = True
        self.nested_runs, self.nested_s = 0, 0.0  # only this thread serves: no checkpoint yet
        _local.checkpoint = self.checkpoint
        try:
            return run_heavy()
        finally:
            _local.checkpoint = no_checkpoint
            with self._lock:
                self._armed = False
                waiting, self._waiting = self._waiting, None
            if waiting:
                self._serve(waiting, nested=False)

    def offer(self, claim: Any, loop: asyncio.AbstractEventLoop) -> asyncio.Future | None:
        """From the event loop: leave ``claim`` for the heavy forward to run; its outcome comes
        in the future. None when no heavy forward is armed, or it has ended (the caller runs
        it itself)."""
        with self._lock:
            if not self._armed or self._waiting is not None:
                return None
            future = loop.create_future()
            self._waiting = (claim, loop, future)
            return future

    def checkpoint(self) -> None:
        """In the forward thread, between steps: run the batch waiting in the slot, if any."""
        if self._waiting is None or self._inside:  # the usual case: one attribute read
            return
        with self._lock:
            waiting, self._waiting = self._waiting, None
        if waiting:
            self._serve(waiting, nested=True)

    def _serve(self, waiting: tuple[Any, asyncio.AbstractEventLoop, asyncio.Future], *,
               nested: bool) -> None:
        claim, loop, future = waiting
        start = time.perf_counter()
        self._inside = True
        # the nested batch has no checkpoint: nothing pre-empts it (and it may replay a CUDA graph)
        outer, _local.checkpoint = getattr(_local, "checkpoint", no_checkpoint), no_checkpoint
        try:
            outcome, exc = self._run(claim), None
        except BaseException as error:  # noqa: BLE001 - the light batch's failure is its own
            outcome, exc = None, error
        finally:
            self._inside = False
            _local.checkpoint = outer
            if nested:
                self.nested_runs += 1
                self.nested_s += time.perf_counter() - start
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(_resolve, future, outcome, exc)
