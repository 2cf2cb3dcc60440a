"""Load drivers. Open loop: requests leave at their intended times and latency counts from then (no
coordinated omission); closed loop: a fixed number of calls in flight. ``summarize`` makes the figures."""

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

# The generator kept up when its send lag p99 stays under this and it sent >= MIN_SEND_RATIO of the rate.
MAX_SEND_LAG_P99_MS = 25.0
MIN_SEND_RATIO = 0.95


@dataclass(frozen=True)
class Arrival:
    t_s: float  # intended send time, seconds after the run starts
    texts: tuple[str, ...]
    num_tokens: int  # with special tokens, as the workload states it


@dataclass(frozen=True)
class Reply:
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
    """The workload's own arrival times scaled to ``rate_per_s`` on average, for ``duration_s`` seconds
    (the workload repeats when it runs out)."""
    _check_rate(rate_per_s, duration_s)
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
    _check_rate(rate_per_s, duration_s)
    rng = np.random.default_rng(seed)
    arrivals: list[Arrival] = []
    t_s = float(rng.exponential(1 / rate_per_s))
    while t_s < duration_s:
        q = queries[len(arrivals) % len(queries)]
        arrivals.append(Arrival(t_s, (_text(q),), q.num_tokens))
        t_s += float(rng.exponential(1 / rate_per_s))
    return arrivals


def _check_rate(rate_per_s: float, duration_s: float) -> None:
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError("rate_per_s and duration_s must be positive")


def _text(q: Query) -> str:
    if q.text is None:
        raise ValueError(f"query {q.id} has no text; give the workload texts (texts_for_lengths)")
    return q.text


def texts_for_lengths(queries: Sequence[Query], vocab_words: Sequence[str], seed: int = 1) -> list[Query]:
    """Queries with texts of exactly their token count for a WordPiece model: ``num_tokens - 2`` whole
    vocabulary words, plus [CLS] and [SEP]."""
    rng = np.random.default_rng(seed)
    words = np.asarray(vocab_words)
    return [Query(q.id, q.num_tokens, q.t_s,
                  q.text if q.text is not None else
                  " ".join(rng.choice(words, size=max(1, q.num_tokens - 2)).tolist()))
            for q in queries]


MODEL_MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length: longer queries are truncated


def load_queries(workload_path: str | None, num_queries: int, seed: int) -> tuple[list[Query], str]:
    """The workload with texts, lengths capped at the bundled model's limit; and where it came from."""
    from tokq.profiling.harness import vocab_words

    queries, source = load_or_generate(workload_path, num_queries, seed)
    if any(q.text is None for q in queries):
        queries = texts_for_lengths(queries, vocab_words(lowercase=True), seed=seed)
    return [Query(q.id, min(q.num_tokens, MODEL_MAX_TOKENS), q.t_s, q.text) for q in queries], source


# -- the open loop -----------------------------------------------------------------------------

async def run_open_loop(send: Send, arrivals: Sequence[Arrival], *,
                        on_done: Callable[[Sample], None] | None = None,
                        lead_s: float = 0.02, start_at: float | None = None) -> list[Sample]:
    """Send every arrival at its intended time; the samples in schedule order. ``start_at``: the start on
    ``time.monotonic()``'s clock (shared by the machine's processes), for a run split over processes."""
    loop = asyncio.get_running_loop()
    start = loop.time() + (lead_s if start_at is None else start_at - time.monotonic())
    samples: list[Sample | None] = [None] * len(arrivals)

    async def one(i: int, arrival: Arrival) -> None:
        samples[i] = await _sample(send, arrival, arrival.t_s, loop, start)
        if on_done:
            on_done(samples[i])

    tasks = []
    # No cyclic-GC pauses while sending (tens of ms, the generator's own lag): collected once after.
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


async def _sample(send: Send, arrival: Arrival, intended_s: float | None, loop, start: float) -> Sample:
    """One request's sample (times from ``start``; ``intended_s`` None: when it was sent)."""
    sent = loop.time() - start
    try:
        reply = await send(arrival.texts)
    except Exception as exc:  # a sender's error must show as an error, not kill the run
        reply = Reply(f"CLIENT_{type(exc).__name__}")
    return Sample(sent if intended_s is None else intended_s, sent, loop.time() - start, reply.status,
                  arrival.num_tokens, reply.queue_ms, reply.inference_ms)


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
        samples.append(await _sample(send, arrival, None, loop, start))
    await closed_loop(one, arrivals, concurrency)
    return samples


class GeneratorProcs:
    """Load from ``n`` processes (one sends ~3,000 calls/s), each with its own sender (``make_sender``,
    picklable) and loop, sending every n-th arrival on one shared clock; they serve every run."""

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
        """Stop the processes after their run in progress; past ``wait_s`` they are terminated."""
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
    """A GeneratorProcs process: one loop and sender until told None; Ctrl-C is the parent's to handle."""
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
    """The figures of one run; latency percentiles include failed requests, so timeouts cannot make a run
    look faster. With ``duration_s``, rates span [0, max(duration, last reply)]."""
    if not samples:
        raise ValueError("no samples to summarize")
    lat, lag = np.array([s.latency_ms for s in samples]), np.array([s.send_lag_ms for s in samples])
    ok = [s for s in samples if s.status == "OK"]
    intended, sent = np.array([s.intended_s for s in samples]), np.array([s.sent_s for s in samples])
    last_done_s = max(s.done_s for s in samples)
    span_s = max(duration_s, last_done_s) if duration_s else max(last_done_s - float(intended.min()), 1e-9)
    sent_span_s = float(sent.max() - sent.min())
    send_ratio = float(intended.max() - intended.min()) / sent_span_s if sent_span_s > 0 else 1.0
    server = {k: np.array([getattr(s, k) for s in ok if getattr(s, k) is not None]) for k in ("queue_ms", "inference_ms")}
    return {
        "offered_rps": round(offered_rate_per_s, 3),
        "scheduled_rps": round(len(samples) / duration_s, 3) if duration_s else None,
        "num_requests": len(samples), "num_ok": len(ok),
        "errors": dict(sorted(Counter(s.status for s in samples if s.status != "OK").items())),
        "throughput_rps": round(len(ok) / span_s, 3),
        "tokens_per_s": round(sum(s.num_tokens for s in ok) / span_s, 1),
        "latency_ms": {"p50": _pct(lat, 50), "p90": _pct(lat, 90), "p99": _pct(lat, 99), "max": round(float(lat.max()), 3)},
        **{f"server_{k}": {"p50": _pct(v, 50), "p99": _pct(v, 99)} for k, v in server.items()},
        "send_lag_ms": {"p50": _pct(lag, 50), "p99": _pct(lag, 99), "max": round(float(lag.max()), 3)},
        "generator_kept_up": bool(_pct(lag, 99) <= MAX_SEND_LAG_P99_MS and send_ratio >= MIN_SEND_RATIO),
    }


def within_slo(summary: dict, slo_ms: float, max_error_ratio: float = 0.01) -> bool:
    """p99 within the SLO, at most ``max_error_ratio`` failed, and the generator really offered the load."""
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
    """Raise the rate by ``factor`` until a run breaks the SLO, then bisect ``num_refinements`` times; if the
    first fails, come down (not below ``min_rate_per_s``). A run the generator fell behind on is run again
    (``generator_retries``), then ends the search as ``generator_limited``. Returns the highest
    sustainable rate, why the next failed, and every run's summary in order."""
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
    return {"slo_ms": slo_ms, "sustainable_rps": good["offered_rps"] if good else 0.0, "sustainable": good,
            "generator_limited": bool(bad and not bad["generator_kept_up"]),
            "limit": failure_reason(bad, slo_ms) if bad else f"no step failed up to {steps[-1]['offered_rps']:.0f} req/s",
            "steps": steps}
