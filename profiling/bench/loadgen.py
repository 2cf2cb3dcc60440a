"""Load drivers. Open loop: requests leave at their *intended* times whether or not earlier ones have
been answered, and each latency counts from the intended time (no coordinated omission: a server
that stalls makes every request scheduled during the stall late, as real users would be). A
schedule (``Arrival``s) comes from a workload's own timestamps rescaled to a mean rate, or from a
Poisson process. Closed loop: a fixed number of calls in flight, each lane sending its next call
when its last is answered. ``summarize`` turns samples into a report's figures, and says whether
the generator itself kept up rather than report a lower rate.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tokq.profiling.workload import Query, load_or_generate

# The generator counts as keeping up when p99 of (actual - intended) send time stays under this
# and it sent at >= MIN_SEND_RATIO of the offered rate; otherwise the run is flagged.
MAX_SEND_LAG_P99_MS = 25.0
MIN_SEND_RATIO = 0.95


@dataclass(frozen=True)
class Arrival:
    t_s: float  # intended send time, seconds after the run starts
    texts: tuple[str, ...]
    num_tokens: int  # with special tokens, as the workload states it


@dataclass(frozen=True)
class Reply:
    """What a sender reports for one request: a gRPC status name and the server's timings."""

    status: str  # "OK" or a grpc.StatusCode name
    queue_ms: float | None = None  # None: the server does not report it
    inference_ms: float | None = None


@dataclass(frozen=True)
class Sample:
    intended_s: float  # all three relative to the run's start
    sent_s: float
    done_s: float
    status: str
    num_tokens: int
    queue_ms: float | None
    inference_ms: float | None

    @property
    def latency_ms(self) -> float:
        return (self.done_s - self.intended_s) * 1000

    @property
    def send_lag_ms(self) -> float:
        return (self.sent_s - self.intended_s) * 1000


Send = Callable[[Sequence[str]], Awaitable[Reply]]


# -- schedules ---------------------------------------------------------------------------------

def replay_schedule(queries: Sequence[Query], rate_per_s: float, duration_s: float) -> list[Arrival]:
    """The workload's own arrival times, compressed or stretched to ``rate_per_s`` on average,
    for ``duration_s`` seconds (the workload repeats from its start when it runs out)."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError("rate_per_s and duration_s must be positive")
    times = np.array([q.t_s for q in queries], dtype=np.float64)
    times -= times[0]
    native_span_s = float(times[-1]) * len(queries) / max(len(queries) - 1, 1)  # one mean gap past the last
    native_rate = len(queries) / native_span_s if native_span_s > 0 else rate_per_s
    scale = native_rate / rate_per_s
    arrivals: list[Arrival] = []
    lap = 0
    while True:
        for q, t in zip(queries, times):
            t_s = (lap * native_span_s + float(t)) * scale
            if t_s >= duration_s:
                return arrivals
            arrivals.append(Arrival(t_s, (_text(q),), q.num_tokens))
        lap += 1


def poisson_schedule(queries: Sequence[Query], rate_per_s: float, duration_s: float,
                     seed: int = 1) -> list[Arrival]:
    """Exponential gaps at ``rate_per_s``; requests take the workload's queries in order."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError("rate_per_s and duration_s must be positive")
    rng = np.random.default_rng(seed)
    arrivals: list[Arrival] = []
    t_s = float(rng.exponential(1 / rate_per_s))
    while t_s < duration_s:
        q = queries[len(arrivals) % len(queries)]
        arrivals.append(Arrival(t_s, (_text(q),), q.num_tokens))
        t_s += float(rng.exponential(1 / rate_per_s))
    return arrivals


def _text(q: Query) -> str:
    if q.text is None:
        raise ValueError(f"query {q.id} has no text; give the workload texts (texts_for_lengths)")
    return q.text


def texts_for_lengths(queries: Sequence[Query], vocab_words: Sequence[str], seed: int = 1) -> list[Query]:
    """Queries with texts of exactly their token count for a WordPiece model: ``num_tokens - 2``
    whole words from the vocabulary (each one token), plus [CLS] and [SEP]."""
    rng = np.random.default_rng(seed)
    words = np.asarray(vocab_words)
    return [Query(q.id, q.num_tokens, q.t_s,
                  q.text if q.text is not None else
                  " ".join(rng.choice(words, size=max(1, q.num_tokens - 2)).tolist()))
            for q in queries]


MODEL_MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length: longer queries are truncated


def load_queries(workload_path: str | None, num_queries: int, seed: int) -> tuple[list[Query], str]:
    """The workload (``workload.load_or_generate``) with texts, lengths capped at the bundled
    model's limit; and where it came from."""
    from tokq.profiling.harness import vocab_words

    queries, source = load_or_generate(workload_path, num_queries, seed)
    if any(q.text is None for q in queries):
        queries = texts_for_lengths(queries, vocab_words(lowercase=True), seed=seed)
    return [Query(q.id, min(q.num_tokens, MODEL_MAX_TOKENS), q.t_s, q.text) for q in queries], source


# -- the open loop -----------------------------------------------------------------------------

async def run_open_loop(send: Send, arrivals: Sequence[Arrival], *,
                        on_done: Callable[[Sample], None] | None = None,
                        lead_s: float = 0.02, start_at: float | None = None) -> list[Sample]:
    """Send every arrival at its intended time without waiting for replies; wait for all
    replies (the sender enforces any deadline) and return the samples in schedule order.
    ``start_at``: the run's start on ``time.monotonic()``'s clock (shared by every process of
    the machine) instead of ``lead_s`` from now, for a run split over processes."""
    loop = asyncio.get_running_loop()
    start = loop.time() + (lead_s if start_at is None else start_at - time.monotonic())
    samples: list[Sample | None] = [None] * len(arrivals)

    async def one(i: int, arrival: Arrival) -> None:
        sent = loop.time() - start
        try:
            reply = await send(arrival.texts)
        except Exception as exc:  # a sender's error must show as an error, not kill the run
            reply = Reply(f"CLIENT_{type(exc).__name__}")
        sample = Sample(arrival.t_s, sent, loop.time() - start, reply.status, arrival.num_tokens,
                        reply.queue_ms, reply.inference_ms)
        samples[i] = sample
        if on_done:
            on_done(sample)

    tasks = []
    # No cyclic-GC pauses while sending: a full collection over the run's objects can hold the
    # loop for tens of ms, which would show as the generator's own lag. Collected once after.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i, arrival in enumerate(arrivals):
            delay = start + arrival.t_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, arrival)))
        await asyncio.gather(*tasks)
    finally:
        if gc_was_enabled:
            gc.enable()
        gc.collect()
    return [s for s in samples if s is not None]


async def closed_loop(call: Callable[[object], Awaitable], items: Iterable, concurrency: int) -> None:
    """``call`` each of ``items`` (an endless iterator too) with ``concurrency`` calls in flight."""
    pending = iter(items)

    async def lane() -> None:
        for item in pending:
            await call(item)
    await asyncio.gather(*(lane() for _ in range(concurrency)))


async def run_closed_loop(send: Send, arrivals: Sequence[Arrival], concurrency: int) -> list[Sample]:
    """Send ``arrivals`` (their times ignored) closed-loop; the samples, as run_open_loop's."""
    loop = asyncio.get_running_loop()
    start, samples = loop.time(), []

    async def one(arrival: Arrival) -> None:
        sent = loop.time() - start
        try:
            reply = await send(arrival.texts)
        except Exception as exc:  # a sender's error must show as an error, not kill the run
            reply = Reply(f"CLIENT_{type(exc).__name__}")
        samples.append(Sample(sent, sent, loop.time() - start, reply.status, arrival.num_tokens, reply.queue_ms,
                              reply.inference_ms))
    await closed_loop(one, arrivals, concurrency)
    return samples


class GeneratorProcs:
    """Load from ``n`` processes, each with its own sender (``make_sender``, picklable: a
    module-level class or a partial of one) and event loop, each sending its share of a run's
    arrivals (every n-th) at their intended times on one shared clock. One Python process sends
    ~3,000 calls a second before it falls behind (its send lag fails the run as not really
    offered): a GPU-served tokq needs more to find its limit. The processes start once and serve
    every run; their senders stay connected between runs."""

    def __init__(self, make_sender: Callable[[], Send], n: int) -> None:
        if n < 1:
            raise ValueError("need at least one generator process")
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding gRPC threads
        self._conns, self._procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_generator_main, args=(child, make_sender), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            for conn in self._conns:  # started and connected: the first run's lead need not cover it
                if (said := conn.recv()) != "ready":
                    raise RuntimeError(f"a load-generator process could not make its sender: {said}")
        except (EOFError, OSError) as exc:  # it died before a word (killed, out of memory)
            self.close()
            raise RuntimeError("a load-generator process died at start") from exc
        except RuntimeError:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    async def run(self, arrivals: Sequence[Arrival], lead_s: float = 0.25) -> list[Sample]:
        """``run_open_loop`` over the processes: the samples of every arrival, in schedule order."""
        start_at = time.monotonic() + lead_s
        n = len(self._conns)
        for i, conn in enumerate(self._conns):
            conn.send((list(arrivals[i::n]), start_at))
        parts = await asyncio.gather(*(asyncio.to_thread(conn.recv) for conn in self._conns))
        return sorted((s for part in parts for s in part), key=lambda s: s.intended_s)

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the processes: each ends after its run in progress, if any; past ``wait_s`` in
        all (a run cut short by Ctrl-C goes on to its end) they are terminated."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for conn in self._conns:
            conn.close()


def _generator_main(conn, make_sender: Callable[[], Send]) -> None:
    """A GeneratorProcs process: one loop and sender for its life; runs until told None (or its
    parent is gone). Ctrl-C is the parent's to handle: it closes the processes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loop = asyncio.new_event_loop()

    async def made() -> Send:  # inside the loop: a gRPC channel binds to the loop it is made on
        return make_sender()

    try:
        send = loop.run_until_complete(made())
    except Exception as exc:  # said to the parent, which raises it: not a bare EOFError there
        conn.send(f"{type(exc).__name__}: {exc}")
        loop.close()
        return
    conn.send("ready")
    try:
        while (job := conn.recv()) is not None:
            arrivals, start_at = job
            conn.send(loop.run_until_complete(run_open_loop(send, arrivals, start_at=start_at)))
    except (EOFError, BrokenPipeError):  # the parent ended without a word
        pass
    finally:
        if close := getattr(send, "close", None):
            loop.run_until_complete(close())
        loop.close()


# -- figures -----------------------------------------------------------------------------------

def _pct(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values.size else None


def summarize(samples: Sequence[Sample], offered_rate_per_s: float, duration_s: float | None = None) -> dict:
    """The figures of one run. Latency percentiles cover every request, failed ones included
    (at the time their error came back), so timeouts cannot make a run look faster. With the
    schedule's ``duration_s``, rates are over [0, max(duration, last reply)] and the rate the
    random schedule really held (``scheduled_rps``) is reported beside the nominal one."""
    if not samples:
        raise ValueError("no samples to summarize")
    lat = np.array([s.latency_ms for s in samples])
    lag = np.array([s.send_lag_ms for s in samples])
    ok = [s for s in samples if s.status == "OK"]
    intended = np.array([s.intended_s for s in samples])
    sent = np.array([s.sent_s for s in samples])
    last_done_s = max(s.done_s for s in samples)
    if duration_s:
        span_s = max(duration_s, last_done_s)
    else:
        span_s = max(last_done_s - float(intended.min()), 1e-9)
    intended_span_s = float(intended.max() - intended.min())
    sent_span_s = float(sent.max() - sent.min())
    send_ratio = (intended_span_s / sent_span_s) if sent_span_s > 0 else 1.0
    lag_p99 = _pct(lag, 99)
    kept_up = bool(lag_p99 <= MAX_SEND_LAG_P99_MS and send_ratio >= MIN_SEND_RATIO)
    queue_ms = np.array([s.queue_ms for s in ok if s.queue_ms is not None])
    inference_ms = np.array([s.inference_ms for s in ok if s.inference_ms is not None])
    return {
        "offered_rps": round(offered_rate_per_s, 3),
        "scheduled_rps": round(len(samples) / duration_s, 3) if duration_s else None,
        "num_requests": len(samples),
        "num_ok": len(ok),
        "errors": dict(sorted(Counter(s.status for s in samples if s.status != "OK").items())),
        "throughput_rps": round(len(ok) / span_s, 3),
        "tokens_per_s": round(sum(s.num_tokens for s in ok) / span_s, 1),
        "latency_ms": {"p50": _pct(lat, 50), "p90": _pct(lat, 90), "p99": _pct(lat, 99),
                       "max": round(float(lat.max()), 3)},
        "server_queue_ms": {"p50": _pct(queue_ms, 50), "p99": _pct(queue_ms, 99)},
        "server_inference_ms": {"p50": _pct(inference_ms, 50), "p99": _pct(inference_ms, 99)},
        "send_lag_ms": {"p50": _pct(lag, 50), "p99": lag_p99, "max": round(float(lag.max()), 3)},
        "generator_kept_up": kept_up,
    }


def within_slo(summary: dict, slo_ms: float, max_error_ratio: float = 0.01) -> bool:
    """A run is sustainable when p99 meets the SLO, at most ``max_error_ratio`` of requests
    failed, and the load generator really offered the load."""
    error_ratio = 1 - summary["num_ok"] / summary["num_requests"]
    return (summary["latency_ms"]["p99"] <= slo_ms and error_ratio <= max_error_ratio
            and summary["generator_kept_up"])


def failure_reason(summary: dict, slo_ms: float, max_error_ratio: float = 0.01) -> str:
    if not summary["generator_kept_up"]:
        return (f"load generator fell behind (send lag p99 {summary['send_lag_ms']['p99']:.0f} ms): "
                "this rate was not really offered")
    error_ratio = 1 - summary["num_ok"] / summary["num_requests"]
    if error_ratio > max_error_ratio:
        return f"{error_ratio:.1%} errors {summary['errors']}"
    if summary["latency_ms"]["p99"] > slo_ms:
        return f"p99 {summary['latency_ms']['p99']:.0f} ms > SLO {slo_ms:.0f} ms"
    return ""


# -- step mode ---------------------------------------------------------------------------------

async def step_search(run_at: Callable[[float], Awaitable[dict]], *, start_rate_per_s: float,
                      slo_ms: float, factor: float = 1.5, max_steps: int = 12,
                      num_refinements: int = 1, generator_retries: int = 1,
                      min_rate_per_s: float = 0.0) -> dict:
    """Raise the offered rate by ``factor`` from ``start_rate_per_s`` until a run breaks the SLO
    (``within_slo``), then bisect (geometrically) between the last good and the first bad rate
    ``num_refinements`` times. If the first rate already fails, come down by ``factor`` until one
    meets the SLO (a slow system would otherwise score 0: one start rate serves systems 100x
    apart, as a GPU's baselines are), not below ``min_rate_per_s`` (a step must hold enough
    requests for its p99 to mean something). A run where the generator itself fell behind says nothing
    about the server: it is kept in ``steps`` but run again (``generator_retries`` times per
    rate); if it still falls behind, the result is ``generator_limited`` (the server sustained at
    least the rate found). Returns the highest sustainable rate (0 if no rate within
    ``max_steps`` met the SLO), why the next failed, and every run's summary in the order run."""
    if start_rate_per_s <= 0 or factor <= 1:
        raise ValueError("need start_rate_per_s > 0 and factor > 1")
    steps: list[dict] = []

    async def measure(rate: float) -> dict:
        for _ in range(generator_retries + 1):
            summary = await run_at(rate)
            steps.append(summary)
            if summary["generator_kept_up"]:
                break
        return summary

    good: dict | None = None
    bad: dict | None = None
    rate = start_rate_per_s
    while len(steps) < max_steps:
        summary = await measure(rate)
        if within_slo(summary, slo_ms):
            good = summary
            if bad:  # came down to it
                break
            rate *= factor
            continue
        bad = summary
        if good or not summary["generator_kept_up"] or rate / factor < min_rate_per_s:
            break
        rate /= factor  # even the first rate failed
    for _ in range(num_refinements if good and bad and bad["generator_kept_up"] else 0):
        summary = await measure((good["offered_rps"] * bad["offered_rps"]) ** 0.5)
        if within_slo(summary, slo_ms):
            good = summary
        else:
            bad = summary
    return {
        "slo_ms": slo_ms,
        "sustainable_rps": good["offered_rps"] if good else 0.0,
        "sustainable": good,
        "generator_limited": bool(bad and not bad["generator_kept_up"]),
        "limit": failure_reason(bad, slo_ms) if bad else f"no step failed up to {steps[-1]['offered_rps']:.0f} req/s",
        "steps": steps,
    }
