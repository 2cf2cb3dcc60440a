"""The workload tokq measures itself with: seeded short queries (lognormal lengths, median 10 tokens, a 0.5%
long tail) arriving in Poisson bursts, or a JSONL file of ``{"id", "text", "tokens", "t"}`` lines."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The recorded search workload beside the repository; without it the benches use the generator, and say so.
SHARED_PATH = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "short_queries.jsonl"
# A line's limits: longer than any model takes (each is cut), an id that fits int64, arrivals within a year.
LINE_MAX_TOKENS, LINE_MAX_ID, LINE_MAX_T_S = 1 << 20, (1 << 63) - 1, 365 * 86_400
MEDIAN_TOKENS = 10.0
SIGMA = 0.857  # lognormal sigma: p90 = median * exp(1.2816 * sigma) ~= 30 tokens
TAIL_FRACTION = 0.005
TAIL_RANGE_TOKENS = (100, 512)
MIN_TOKENS = 3  # [CLS] word [SEP]: the shortest real query
MAX_TOKENS = 512


@dataclass(frozen=True)
class Query:
    id: int
    num_tokens: int  # with the model's special tokens
    t_s: float  # arrival, seconds since the workload started
    text: str | None = None

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "text": self.text, "tokens": self.num_tokens, "t": self.t_s})


def query_lengths(num_queries: int, seed: int = 1, *, rng: np.random.Generator | None = None
                  ) -> np.ndarray:
    """Token lengths (int64): a lognormal body, a log-uniform tail, drawn in make_queries.py's order, so
    seed 1 gives ../shared/workloads' lengths."""
    rng = rng if rng is not None else np.random.default_rng(seed)
    lens = np.exp(rng.normal(np.log(MEDIAN_TOKENS), SIGMA, size=num_queries))
    tail = rng.random(num_queries) < TAIL_FRACTION
    lo, hi = TAIL_RANGE_TOKENS
    lens[tail] = np.exp(rng.uniform(np.log(lo), np.log(hi), size=int(tail.sum())))
    return np.clip(np.rint(lens).astype(np.int64), MIN_TOKENS, MAX_TOKENS)


def arrival_times_s(num_queries: int, rate_per_s: float, seed: int = 1, *, burst_factor: float = 4.0,
                    burst_s: float = 1.0, period_s: float = 5.0,
                    rng: np.random.Generator | None = None) -> np.ndarray:
    """Poisson arrival times (s) at ``rate_per_s``, ``burst_factor`` times faster in the first ``burst_s``
    of every ``period_s``."""
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    rng = rng if rng is not None else np.random.default_rng(seed)
    # Unit-rate exponential gaps, each scaled by the rate in force where the gap starts.
    unit_gaps = rng.exponential(1.0, size=num_queries)
    times = np.empty(num_queries)
    t = 0.0
    for i, gap in enumerate(unit_gaps):
        in_burst = (t % period_s) < burst_s
        t += gap / (rate_per_s * (burst_factor if in_burst else 1.0))
        times[i] = t
    return times


def generate(num_queries: int, *, seed: int = 1, rate_per_s: float = 200.0,
             burst_factor: float = 4.0, burst_s: float = 1.0, period_s: float = 5.0) -> list[Query]:
    """A seeded synthetic workload (lengths and arrival times; no texts)."""
    lens = query_lengths(num_queries, seed)
    # Arrivals use their own stream so changing the rate never changes the lengths.
    times = arrival_times_s(num_queries, rate_per_s, rng=np.random.default_rng([seed, 1]),
                            burst_factor=burst_factor, burst_s=burst_s, period_s=period_s)
    return [Query(id=i, num_tokens=int(n), t_s=round(float(t), 6)) for i, (n, t) in
            enumerate(zip(lens, times))]


def load_jsonl(path: str | Path) -> list[Query]:
    """Read a JSONL workload; a malformed line raises ValueError naming the file and line."""
    path, queries = Path(path), []
    # surrogateescape: bytes that are not UTF-8 reach the line they sit on, which names them.
    with path.open(encoding="utf-8-sig", errors="surrogateescape") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                queries.append(_parse_line(line, default_id=len(queries)))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: not a workload line "
                                 f'({{"id", "text", "tokens", "t"}}): {exc!r}') from None
    if not queries:
        raise ValueError(f"{path}: no queries")
    return queries


def _parse_line(line: str, default_id: int) -> Query:
    _check_utf8(line)
    row = json.loads(line)
    if not isinstance(row, dict):
        raise ValueError(f"a line must be a JSON object, got {type(row).__name__}")
    num_tokens = _number("tokens", row["tokens"], whole=True, minimum=1, maximum=LINE_MAX_TOKENS)
    text = row.get("text")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"text must be a string or null, got {type(text).__name__}")
    return Query(id=_number("id", row.get("id", default_id), whole=True, minimum=0, maximum=LINE_MAX_ID),
                 num_tokens=num_tokens, text=text,
                 t_s=_number("t", row.get("t", 0.0), whole=False, minimum=0, maximum=LINE_MAX_T_S))


def _check_utf8(line: str) -> None:
    """A byte that is not UTF-8 was read as a lone surrogate, which will not encode back."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = ord(line[exc.start]) - 0xDC00
        raise ValueError(f"not UTF-8: byte 0x{byte:02x} at character {exc.start + 1}") from None


def _number(key: str, value: object, *, whole: bool, minimum: int, maximum: int) -> int | float:
    """A field's value: a finite JSON number (not true/false, NaN or 1e400), whole where ``whole``, and
    in ``minimum..maximum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {json.dumps(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} must be finite, got {value}")
    if whole and value != int(value):
        raise ValueError(f"{key} must be a whole number, got {value}")
    if not minimum <= value <= maximum:
        big = isinstance(value, int) and abs(value) >= 10**30  # as a float it could overflow
        shown = f"a {len(str(value))}-digit number" if big else value
        raise ValueError(f"{key} must be in {minimum}..{maximum:,}, got {shown}")
    return int(value) if whole else float(value)


def load_or_generate(path: str | Path | None, num_queries: int, seed: int = 1) -> tuple[list[Query], str]:
    """``path``'s workload, else SHARED_PATH's, else ``generate``'s; and where it came from."""
    path = Path(path) if path else (SHARED_PATH if SHARED_PATH.is_file() else None)
    if path:
        return load_jsonl(path), str(path)
    return generate(num_queries, seed=seed), f"generated (n={num_queries}, seed={seed})"


def write_jsonl(queries: Iterable[Query], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for q in queries:
            f.write(q.to_json() + "\n")


def describe(queries: list[Query]) -> dict:
    """Summary figures of a workload (for reports and the profile JSON)."""
    lens = np.array([q.num_tokens for q in queries])
    span_s = max(q.t_s for q in queries) - min(q.t_s for q in queries)
    return {"num_queries": len(queries), "num_tokens": int(lens.sum()),
            **{f"p{q}_tokens": float(np.percentile(lens, q)) for q in (50, 90, 99)}, "max_tokens": int(lens.max()),
            "span_s": round(float(span_s), 3), "has_texts": all(q.text is not None for q in queries)}
