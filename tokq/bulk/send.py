"""Sending many rows to a tokq fleet: many inputs a request, tokens in flight bounded from the
published budget and grown while the workers take the work at once, retries on failures that
pass, and rows the gateway refuses isolated so that the others go through.

Every request leaves through ``Sender._call``, where request-wide settings such as the priority
class (batch by default) are added.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from tokq.client import AsyncClient, TokqError

# Failures that pass: a gateway restarting, Redis failing over, the queue over its token cap.
RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
                         grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN})
# An input's own fault (too long, bytes over a cap): that row fails, the others are resent.
ROW_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})
NAMED_INPUT = re.compile(r"^input (\d+) ")
DEFAULT_BUDGET = 1024  # assumed until a worker publishes its budget (the CPU default)
MIN_REQUEST_TOKENS = 256
MAX_REQUEST_CHARS = 256 * 1024  # well under the gateway's default request byte cap
START_UNITS = 3  # tokens in flight at first, in budgets: a batch running, one queued, one returning
MIN_UNITS = 2
MAX_UNITS = 256
# Per round of a window's worth of answers: mean queue time over mean inference time.
GROW_BELOW = 0.5  # workers took our work at once: there is room for more
SHRINK_ABOVE = 3.0  # work waited several forwards: less in flight serves as well
BACKOFF_FIRST_S = 0.25
BACKOFF_MAX_S = 10.0
INTERNAL_TRIES = 2  # a single input failing INTERNAL this often fails as a row
INTERNAL_RUN_LIMIT = 64  # this many INTERNAL answers in a row, none OK: the fleet is broken
INFO_REFRESH_S = 30.0


class BulkError(Exception):
    """Ends the job: the gateway refuses every request alike, or could not be reached."""


class TargetDown(BulkError):
    def __init__(self, seconds: float, last: TokqError) -> None:
        super().__init__(f"no answer for {seconds:.0f} s (last: {last.code.name}: {last.message})")
        self.last = last


@dataclass(frozen=True)
class EmbedOptions:
    dimensions: int | None = None
    prompt_name: str | None = None
    truncate: bool = False
    normalize: bool = True
    # The queue class: batch takes the room live queries leave. None: the API key's default.
    priority: str | None = "batch"
    timeout_s: float = 120.0  # each request's deadline
    retry_for_s: float = 300.0  # how long failures that pass are retried with no request answered


@dataclass
class FleetLimits:
    """What Info says of the served model."""

    model: str
    dimensions: int  # the vectors' (after --dimensions)
    max_length: int
    max_inputs: int
    budget: int  # the published token budget, or DEFAULT_BUDGET while none is

    @classmethod
    def from_info(cls, info, dimensions: int | None) -> FleetLimits:
        return cls(info.model, dimensions or info.dimensions, info.max_input_length or 512,
                   info.max_inputs or 512, info.token_budget or DEFAULT_BUDGET)


def check_options(info, options: EmbedOptions, model: str = "") -> None:
    """Refuse before any row is sent what the gateway would refuse for every request."""
    if not model and len(info.models) > 1:
        raise BulkError(f"this gateway serves several models ({', '.join(info.models)}): name one with --model")
    task = getattr(info, "task", "") or "embed"
    if task != "embed":
        raise BulkError(f"model {info.model!r} is a {task} model: it gives no embeddings")
    if options.dimensions is not None and not 1 <= options.dimensions <= info.dimensions:
        raise BulkError(f"dimensions={options.dimensions} is out of range: {info.model} gives "
                        f"1..{info.dimensions} dimensions")
    if options.prompt_name is not None and options.prompt_name not in info.prompt_names:
        known = ", ".join(info.prompt_names) or "none"
        raise BulkError(f"unknown prompt name {options.prompt_name!r}; {info.model} defines: {known}")


class Window:
    """Tokens in flight, judged once a round. A round is the requests sent in a window's worth of
    tokens from its start, judged on their answers' queue and inference times once all are back.
    It grows while that work was taken at once and requests waited for room, and shrinks while
    the work queued for several forwards or the queue was full. Slow start doubles it until the
    first round whose work was not taken at once; then it grows one budget a round."""

    def __init__(self, unit: int) -> None:
        self.unit = max(1, unit)
        self.limit = START_UNITS * self.unit
        self.peak = self.limit  # the largest limit so far: what in flight was ever bounded by
        self.in_flight = 0
        self.slow_start = True  # doubling until the first sign of queueing
        self._waiters: list[tuple[asyncio.Future, int]] = []
        self._tickets = 0  # one per request let in
        self._cut_at = 0  # the first ticket let in after the last halving
        self._new_round()

    def _new_round(self) -> None:
        # Members: requests let in from the round's start until it held a window's worth of tokens.
        self._members: set[int] = set()  # this round's tickets not yet released
        self._filled = 0  # tokens sent in this round
        self._times = [0, 0.0, 0.0]  # its answers: count, queue ms, inference ms
        self._waited = False

    def set_unit(self, unit: int) -> None:
        unit = max(1, unit)
        if unit != self.unit:
            self.limit = max(MIN_UNITS * unit, round(self.limit * unit / self.unit))
            self.peak = max(self.peak, self.limit)
            self.unit = unit
            self._new_round()
            self._wake()

    def _fits(self, n: int) -> bool:
        return self.in_flight == 0 or self.in_flight + n <= self.limit

    def _let_in(self, n: int) -> int:
        self.in_flight += n
        ticket = self._tickets
        self._tickets += 1
        if self._filled < self.limit:
            self._filled += n
            self._members.add(ticket)
        return ticket

    async def acquire(self, n: int) -> int:
        """Room for ``n`` tokens; returns the request's ticket for ``observe`` and ``release``."""
        if not self._waiters and self._fits(n):
            return self._let_in(n)
        self._waited = True
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((fut, n))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled: hand it back
                self.release(n, fut.result())
            else:
                self._waiters = [w for w in self._waiters if w[0] is not fut]
            raise

    def release(self, n: int, ticket: int | None = None) -> None:
        self.in_flight -= n
        if ticket in self._members:
            self._members.discard(ticket)
            if not self._members and self._filled >= self.limit:
                self._judge()
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            fut, n = self._waiters[0]
            if fut.done():
                self._waiters.pop(0)
            elif self._fits(n):
                self._waiters.pop(0)
                fut.set_result(self._let_in(n))
            else:
                break

    def observe(self, ticket: int, queue_ms: float, inference_ms: float) -> None:
        """An answer's times; counted when its request is in the round being measured."""
        if ticket in self._members:
            t = self._times
            t[0] += 1
            t[1] += queue_ms
            t[2] += inference_ms

    def _judge(self) -> None:
        answers, queue_ms, inference_ms = self._times
        if answers:
            ratio = queue_ms / max(inference_ms, 1e-3)
            if ratio >= GROW_BELOW:
                self.slow_start = False
            if ratio > SHRINK_ABOVE:
                self.limit = max(MIN_UNITS * self.unit, self.limit - self.unit)
            elif ratio < GROW_BELOW and self._waited:
                grown = 2 * self.limit if self.slow_start else self.limit + self.unit
                self.limit = min(MAX_UNITS * self.unit, grown)
                self.peak = max(self.peak, self.limit)
        self._new_round()

    def congested(self, ticket: int | None = None) -> None:
        """The queue refused work (over its token cap): half as much in flight. Once for the
        requests in flight at a halving: their refusals tell of the same full queue."""
        if ticket is not None and ticket < self._cut_at:
            return
        self._cut_at = self._tickets
        self.slow_start = False
        self.limit = max(MIN_UNITS * self.unit, self.limit // 2)
        self._new_round()


@contextlib.asynccontextmanager
async def first_error():
    """A task group's failure raised as its first error, not as an ExceptionGroup."""
    try:
        yield
    except BaseExceptionGroup as group:
        errors = [e for e in group.exceptions if not isinstance(e, asyncio.CancelledError)]
        raise (errors or group.exceptions)[0] from None


def _row_reason(exc: TokqError) -> str:
    return f"{exc.code.name}: {NAMED_INPUT.sub('the text ', exc.message, count=1)}"


class Sender:
    """Embeds lists of texts through ``client`` within one shared window of tokens in flight."""

    def __init__(self, client: AsyncClient, options: EmbedOptions, limits: FleetLimits, *,
                 on_retry: Callable[[TokqError], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.options = options
        self.limits = limits
        self.window = Window(limits.budget)
        self.on_retry = on_retry
        self._clock = clock
        self._last_ok = clock()
        self._last_info = clock()
        self._internal_run = 0
        self._refresh: asyncio.Task | None = None
        self.tokens_per_char = 0.3  # learned from each answer's token count
        self.tokens = 0  # the model's tokens in answered requests
        self.rows = 0  # rows embedded
        self.requests = 0

    # -- packing ------------------------------------------------------------------------------

    def estimate(self, text: str) -> int:
        return min(self.limits.max_length, int(len(text) * self.tokens_per_char) + 2)

    def pack(self, texts: Sequence[str | None]) -> list[tuple[list[int], int]]:
        """Requests as (positions in ``texts``, estimated tokens): consecutive rows up to half a
        budget of tokens, max_inputs and MAX_REQUEST_CHARS each; None rows are left out."""
        target = max(MIN_REQUEST_TOKENS, self.limits.budget // 2)
        out: list[tuple[list[int], int]] = []
        group: list[int] = []
        tokens = chars = 0
        for i, text in enumerate(texts):
            if text is None:
                continue
            est = self.estimate(text)
            if group and (tokens + est > target or len(group) >= self.limits.max_inputs
                          or chars + len(text) > MAX_REQUEST_CHARS):
                out.append((group, tokens))
                group, tokens, chars = [], 0, 0
            group.append(i)
            tokens += est
            chars += len(text)
        if group:
            out.append((group, tokens))
        return out

    # -- sending ------------------------------------------------------------------------------

    async def embed_rows(self, texts: Sequence[str | None],
                         on_dispatched: Callable[[], None] | None = None) -> tuple[np.ndarray, dict[int, str]]:
        """Vectors [len(texts), dimensions] and the reasons of the rows that failed (their
        vectors are zero); None rows are not sent (the caller holds their reason).
        ``on_dispatched``: called once every request was sent."""
        vectors = np.zeros((len(texts), self.limits.dimensions), dtype=np.float32)
        errors: dict[int, str] = {}
        async with first_error():
            async with asyncio.TaskGroup() as tasks:
                for positions, est in self.pack(texts):
                    ticket = await self.window.acquire(est)
                    tasks.create_task(self._send(positions, [texts[p] for p in positions], est, ticket,
                                                 vectors, errors))
                if on_dispatched is not None:
                    on_dispatched()
        return vectors, errors

    async def _send(self, positions, texts, est, ticket, vectors, errors) -> None:
        try:
            await self._embed(positions, texts, vectors, errors, ticket)
        finally:
            self.window.release(est, ticket)

    async def _call(self, texts: list[str]):
        """The one place a request leaves."""
        o = self.options
        return await self.client.embed_full(texts, truncate=o.truncate, normalize=o.normalize,
                                            dimensions=o.dimensions, prompt_name=o.prompt_name,
                                            timeout=o.timeout_s, priority=o.priority)

    async def _embed(self, positions: list[int], texts: list[str], vectors: np.ndarray,
                     errors: dict[int, str], ticket: int) -> None:
        attempt = internal = 0
        while True:
            self._maybe_refresh()
            try:
                out = await self._call(texts)
            except TokqError as exc:
                if exc.code in RETRY_CODES:
                    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        self.window.congested(ticket)
                    await self._pause(attempt, exc)
                    attempt += 1
                    continue
                if exc.code in ROW_CODES or exc.code == grpc.StatusCode.INTERNAL:
                    if exc.code == grpc.StatusCode.INTERNAL:
                        self._internal_run += 1
                        if self._internal_run >= INTERNAL_RUN_LIMIT:
                            raise BulkError(f"{INTERNAL_RUN_LIMIT} requests in a row failed "
                                            f"(last: INTERNAL: {exc.message})") from None
                    if len(texts) == 1:
                        internal += exc.code == grpc.StatusCode.INTERNAL
                        if exc.code == grpc.StatusCode.INTERNAL and internal < INTERNAL_TRIES:
                            continue
                        errors[positions[0]] = _row_reason(exc)
                        return
                    m = NAMED_INPUT.match(exc.message) if exc.code in ROW_CODES else None
                    if m and int(m[1]) < len(texts):
                        i = int(m[1])
                        errors[positions[i]] = _row_reason(exc)
                        positions, texts = positions[:i] + positions[i + 1:], texts[:i] + texts[i + 1:]
                        continue
                    half = len(texts) // 2  # which input is at fault is not said: halve
                    await self._embed(positions[:half], texts[:half], vectors, errors, ticket)
                    await self._embed(positions[half:], texts[half:], vectors, errors, ticket)
                    return
                raise BulkError(f"{exc.code.name}: {exc.message}") from None
            got = out.vectors
            if got.shape != (len(texts), self.limits.dimensions):
                raise BulkError(f"the gateway answered {got.shape[0]} vectors of {got.shape[1] if got.ndim == 2 else 0} "
                                f"dimensions for {len(texts)} inputs of {self.limits.dimensions}")
            vectors[positions] = got
            self._answered(texts, out, ticket)
            return

    def _answered(self, texts: list[str], out, ticket: int) -> None:
        self._last_ok = self._clock()
        self._internal_run = 0
        self.requests += 1
        self.rows += len(texts)
        self.tokens += out.prompt_tokens
        chars = sum(len(t) for t in texts)
        if chars:
            seen = max(0.0, out.prompt_tokens - 2 * len(texts)) / chars
            self.tokens_per_char = 0.8 * self.tokens_per_char + 0.2 * min(2.0, max(0.02, seen))
        self.window.observe(ticket, out.timing.get("queue_ms", 0.0), out.timing.get("inference_ms", 0.0))

    async def _pause(self, attempt: int, exc: TokqError) -> None:
        waited = self._clock() - self._last_ok
        if waited >= self.options.retry_for_s:
            raise TargetDown(waited, exc)
        if self.on_retry is not None:
            self.on_retry(exc)
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** attempt) * (0.5 + random.random())
        await asyncio.sleep(min(delay, max(0.05, self.options.retry_for_s - waited)))

    # -- the fleet's limits -------------------------------------------------------------------

    def _maybe_refresh(self) -> None:
        """Info again now and then: a worker may publish its budget after the job starts."""
        if self._clock() - self._last_info < INFO_REFRESH_S or (self._refresh and not self._refresh.done()):
            return
        self._last_info = self._clock()
        self._refresh = asyncio.get_running_loop().create_task(self._refresh_info())

    async def _refresh_info(self) -> None:
        try:
            info = await self.client.info(timeout=10)
        except TokqError:
            return
        if info.token_budget and info.token_budget != self.limits.budget:
            self.limits.budget = info.token_budget
            self.window.set_unit(info.token_budget)
        if info.max_inputs:
            self.limits.max_inputs = info.max_inputs

    async def close(self) -> None:
        if self._refresh is not None and not self._refresh.done():
            self._refresh.cancel()
            try:
                await self._refresh
            except (asyncio.CancelledError, Exception):
                pass


async def fetch_info(client: AsyncClient, options: EmbedOptions,
                     on_retry: Callable[[TokqError], None] | None = None,
                     clock: Callable[[], float] = time.monotonic):
    """Info, retried like a request while the gateway is down (at most ``retry_for_s``)."""
    start = clock()
    attempt = 0
    while True:
        try:
            return await client.info(timeout=min(30.0, options.timeout_s))
        except TokqError as exc:
            if exc.code not in RETRY_CODES:
                raise BulkError(f"{exc.code.name}: {exc.message}") from None
            waited = clock() - start
            if waited >= options.retry_for_s:
                raise TargetDown(waited, exc) from None
            if on_retry is not None:
                on_retry(exc)
            delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** attempt) * (0.5 + random.random())
            await asyncio.sleep(min(delay, max(0.05, options.retry_for_s - waited)))
            attempt += 1
