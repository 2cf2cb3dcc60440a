"""Where forward latency stops being flat: ``latency = flat_ms + slope * max(0, tokens - break)`` fitted by
least squares on relative residuals; ``kind`` "flat" or "linear" says the knee lies beyond or below the grid."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from tokq.latency_goal import DEFAULT_SLO_P99_MS, max_forward_ms

NUM_BREAK_CANDIDATES = 600
# A rise smaller than this fraction of the flat latency (or than 3x the fit's noise) is no knee.
MIN_RISE_FRACTION = 0.10


def plain(value: float, digits: int = 4) -> str:
    """``value`` to ``digits`` significant figures with thousands separators, 10000 -> '10,000' (not 1e+04)."""
    text = f"{value:,.{digits}g}"
    return f"{value:,.0f}" if "e+" in text else text


@dataclass(frozen=True)
class KneeFit:
    kind: str  # "knee" | "flat" | "linear"
    knee_tokens: float | None  # None unless kind == "knee"
    break_tokens: float  # the fitted breakpoint, whatever the kind
    flat_ms: float  # fitted latency of the smallest batch measured (the flat level, for a knee)
    level_ms: float  # fitted latency at and below the break
    slope_ms_per_token: float  # marginal cost above the break
    noise_fraction: float  # rms relative residual of the fit
    reason: str

    def predict_ms(self, num_tokens: np.ndarray | float) -> np.ndarray:
        x = np.asarray(num_tokens, dtype=float)
        return self.level_ms + self.slope_ms_per_token * np.maximum(0.0, x - self.break_tokens)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "knee_tokens": self.knee_tokens, "break_tokens": self.break_tokens,
                "flat_ms": self.flat_ms, "level_ms": self.level_ms, "slope_ms_per_token": self.slope_ms_per_token,
                "noise_fraction": self.noise_fraction, "reason": self.reason}


def _fit_at(x: np.ndarray, y: np.ndarray, w: np.ndarray, k: float) -> tuple[float, float, float]:
    """Weighted least squares of y ~ a + b*max(0, x-k) with b >= 0; returns (a, b, sse)."""
    f = np.maximum(0.0, x - k)
    sw, swf, swff = w.sum(), (w * f).sum(), (w * f * f).sum()
    swy, swfy = (w * y).sum(), (w * f * y).sum()
    det = sw * swff - swf * swf
    b = (sw * swfy - swf * swy) / det if det > 0 else 0.0
    if b <= 0.0:
        b = 0.0
    a = (swy - b * swf) / sw
    sse = float((w * (y - a - b * f) ** 2).sum())
    return float(a), float(b), sse


def fit_knee(num_tokens: np.ndarray, latency_ms: np.ndarray) -> KneeFit:
    """Fit flat-then-linear to (tokens, latency) points; at least 3, all positive."""
    x = np.asarray(num_tokens, dtype=float)
    y = np.asarray(latency_ms, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or x.size < 3:
        raise ValueError(f"need >= 3 (tokens, latency) points, got {x.size} and {y.size}")
    if (x <= 0).any() or (y <= 0).any() or not np.isfinite(y).all():
        raise ValueError("tokens and latencies must be positive and finite")
    order = np.argsort(x)
    x, y = x[order], y[order]
    w = 1.0 / (y * y)  # relative residuals

    # Candidates below x[0] stand for "no flat part" (an affine line); x[-1] for "all flat".
    candidates = np.unique(np.concatenate([
        np.geomspace(x[0] / 4, x[-1], NUM_BREAK_CANDIDATES), x]))
    fits = [_fit_at(x, y, w, k) for k in candidates]
    sses = np.array([sse for _, _, sse in fits])
    # With few points past the break, a range of breaks fits equally well: take the earliest.
    best = int(np.flatnonzero(sses <= sses.min() * (1 + 1e-6) + 1e-12 * x.size)[0])
    (a, b, sse), k = fits[best], float(candidates[best])
    noise = float(np.sqrt(sse / max(1, x.size - 3)))

    def result(kind: str, reason: str, *, a: float = a, b: float = b, k: float = k) -> KneeFit:
        flat_ms = a + b * max(0.0, x[0] - k)
        return KneeFit(kind=kind, knee_tokens=float(k) if kind == "knee" else None,
                       break_tokens=float(k), flat_ms=float(flat_ms), level_ms=float(a),
                       slope_ms_per_token=float(b), noise_fraction=noise, reason=reason)

    rise = b * max(0.0, x[-1] - k) / a
    if rise < max(MIN_RISE_FRACTION, 3.0 * noise):
        a_flat, _, _ = _fit_at(x, y, w, x[-1])
        return result("flat", f"latency stays within {rise:.0%} of {plain(a_flat, 3)} ms up to "
                              f"{x[-1]:.0f} tokens: no knee on this grid; it lies beyond the largest "
                              "batch measured", a=a_flat, b=0.0, k=float(x[-1]))
    num_flat = int((x <= k).sum())
    if num_flat < 2:
        overhead_ms = a - b * k  # the line's latency at zero tokens: the fixed cost per batch
        return result("linear", f"latency grows with tokens from the smallest batch ({x[0]:.0f} tokens): "
                                "no flat stretch on this grid, so any knee lies below it (fixed overhead "
                                f"{plain(overhead_ms, 3)} ms, {plain(b * 1000, 3)} ms per 1k tokens)")
    return result("knee", f"latency is flat at {plain(a, 3)} ms up to ~{k:.0f} tokens, then grows "
                          f"{plain(b * 1000, 3)} ms per 1k tokens")


# The latency model behind the budget: tokq/latency_goal.py.
# Past this share of the peak tokens/s, a bigger batch buys almost no throughput, only latency.
SATURATION_FRACTION = 0.95


@dataclass(frozen=True)
class Recommendation:
    token_budget: int | None  # the token budget to serve at; None when no batch fits the goal
    slo_p99_ms: float  # the latency goal
    max_batch_ms: float  # the forward time the goal allows: max_forward_ms(slo_p99_ms)
    latency_ms: float | None  # median forward time at the budget
    tokens_per_s: float | None  # forward throughput at the budget
    limited_by: str | None  # "throughput" | "latency goal" | "grid"; None when nothing fits
    throughput_cap_tokens: int  # smallest batch reaching SATURATION_FRACTION of the peak
    latency_cap_tokens: int | None  # largest batch (and all below it) within max_batch_ms
    peak_tokens_per_s: float  # of the fitted curve when a fit was given, else measured
    saturation_fraction: float
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def throughput_saturation(num_tokens: np.ndarray, latency_ms: np.ndarray,
                          fraction: float = SATURATION_FRACTION) -> tuple[int, float]:
    """The smallest measured batch reaching ``fraction`` of the peak tokens/s, and that peak."""
    x = np.asarray(num_tokens, dtype=float)
    tokens_per_s = x / (np.asarray(latency_ms, dtype=float) / 1000.0)
    peak = float(tokens_per_s.max())
    return int(x[np.flatnonzero(tokens_per_s >= fraction * peak)[0]]), peak


def recommend_budget(num_tokens: np.ndarray, latency_ms: np.ndarray, fit: KneeFit | None = None,
                     slo_p99_ms: float = DEFAULT_SLO_P99_MS, fraction: float = SATURATION_FRACTION,
                     stopped_reason: str | None = None) -> Recommendation:
    """The largest measured batch whose forward keeps the p99 goal reachable, but no larger than where
    throughput (from ``fit`` when given: noise averaged) reaches ``fraction`` of its peak."""
    order = np.argsort(np.asarray(num_tokens, dtype=float))
    x = np.asarray(num_tokens, dtype=float)[order]
    y = np.asarray(latency_ms, dtype=float)[order]
    if slo_p99_ms <= 0:
        raise ValueError(f"the latency goal must be positive, got {slo_p99_ms} ms")
    ceiling_ms = max_forward_ms(slo_p99_ms)
    sat_tokens, peak = throughput_saturation(x, fit.predict_ms(x) if fit else y, fraction)
    within = np.cumprod(y <= ceiling_ms).astype(bool)  # a slow point caps everything above it
    common = dict(slo_p99_ms=float(slo_p99_ms), max_batch_ms=ceiling_ms, throughput_cap_tokens=sat_tokens,
                  peak_tokens_per_s=peak, saturation_fraction=fraction)
    goal = f"p99 <= {plain(slo_p99_ms)} ms allows {plain(ceiling_ms)} ms per forward"
    if not within.any():
        return Recommendation(None, latency_ms=None, tokens_per_s=None, limited_by=None, latency_cap_tokens=None,
                              reason=f"no budget meets the goal: {goal}, and the smallest batch measured "
                                     f"({x[0]:.0f} tokens) took {plain(y[0], 3)} ms: raise --slo-p99-ms or "
                                     "lower --min-tokens", **common)
    lat_tokens = int(x[np.flatnonzero(within)[-1]])
    budget = min(lat_tokens, sat_tokens)
    at = int(np.flatnonzero(x == budget)[0])
    tokens_per_s = float(x[at] / (y[at] / 1000.0))
    if budget == x[-1]:
        limited_by = "grid"
        # what would measure larger batches: the sweep's end, or what cut it short
        if stopped_reason is None:
            larger = "a larger --max-tokens may find a bigger budget"
        elif stopped_reason.startswith("out of memory"):
            larger = f"larger batches ran out of memory ({stopped_reason})"
        else:
            larger = (f"the sweep stopped there ({stopped_reason}): a larger --stop-ms may find a "
                      "bigger budget")
        why = (f"every batch measured fits the goal ({goal}) and throughput still grows at the largest, "
               f"{budget} tokens: {larger}")
    elif sat_tokens <= lat_tokens:
        limited_by = "throughput"
        why = (f"{budget} tokens reaches {fraction:.0%} of the peak throughput ({peak:,.0f} tokens/s); larger "
               f"batches add latency, not throughput ({goal}: up to {lat_tokens} tokens would fit)")
    else:
        limited_by = "latency goal"
        why = (f"{goal}: {budget} tokens is the largest batch within it (throughput would keep growing to "
               f"{sat_tokens} tokens)")
    return Recommendation(budget, latency_ms=float(y[at]), tokens_per_s=tokens_per_s, limited_by=limited_by,
                          latency_cap_tokens=lat_tokens, reason=why, **common)
