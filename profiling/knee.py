"""Where forward latency stops being flat: a two-segment fit of latency against batch tokens.

Below some token count a forward pass costs about the same whatever it holds (kernel launches,
weight reads, Python); above it, cost grows linearly with tokens. The model fitted here is
``latency = flat_ms + slope * max(0, tokens - break_tokens)``, by least squares on *relative*
residuals (latencies span orders of magnitude; an absolute fit would ignore the flat part).

The break is searched on a fine log grid; for each candidate the fit is linear in
(flat_ms, slope), so each step is a 2x2 solve. The result says plainly when there is no knee:
``kind == "flat"`` (latency never rises meaningfully: the knee lies beyond the grid) or
``kind == "linear"`` (no flat stretch of two points or more: it lies below the grid).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUM_BREAK_CANDIDATES = 600
# A rise smaller than this fraction of the flat latency (or than 3x the fit's noise) is no knee.
MIN_RISE_FRACTION = 0.10


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
        return result("flat", f"latency stays within {rise:.0%} of {a_flat:.3g} ms up to "
                              f"{x[-1]:.0f} tokens: no knee on this grid; it lies beyond the largest "
                              "batch measured", a=a_flat, b=0.0, k=float(x[-1]))
    num_flat = int((x <= k).sum())
    if num_flat < 2:
        overhead_ms = a - b * k  # the line's latency at zero tokens: the fixed cost per batch
        return result("linear", f"latency grows with tokens from the smallest batch ({x[0]:.0f} tokens): "
                                "no flat stretch on this grid, so any knee lies below it (fixed "
                                f"overhead {overhead_ms:.3g} ms, {b * 1000:.3g} ms per 1k tokens)")
    return result("knee", f"latency is flat at {a:.3g} ms up to ~{k:.0f} tokens, then grows "
                          f"{b * 1000:.3g} ms per 1k tokens")


@dataclass(frozen=True)
class Recommendation:
    budget_tokens: int | None  # the token budget to serve at; None when no batch fits the ceiling
    max_batch_ms: float  # the latency ceiling it respects
    latency_ms: float | None
    tokens_per_s: float | None
    reason: str

    def to_dict(self) -> dict:
        return {"budget_tokens": self.budget_tokens, "max_batch_ms": self.max_batch_ms,
                "latency_ms": self.latency_ms, "tokens_per_s": self.tokens_per_s, "reason": self.reason}


def recommend_budget(num_tokens: np.ndarray, latency_ms: np.ndarray, fit: KneeFit,
                     max_batch_ms: float | None = None) -> Recommendation:
    """The measured batch size with the most tokens/s whose median latency is within the ceiling
    (default: twice the flat latency). Measured, not extrapolated: only grid points qualify."""
    x = np.asarray(num_tokens, dtype=float)
    y = np.asarray(latency_ms, dtype=float)
    ceiling_ms = float(max_batch_ms) if max_batch_ms is not None else 2.0 * fit.flat_ms
    ok = y <= ceiling_ms
    if not ok.any():
        return Recommendation(None, ceiling_ms, None, None,
                              f"no measured batch is within {ceiling_ms:.3g} ms (the fastest took "
                              f"{y.min():.3g} ms): raise --max-batch-ms or lower --min-tokens")
    tokens_per_s = x / (y / 1000.0)
    best = int(np.flatnonzero(ok)[np.argmax(tokens_per_s[ok])])
    note = ""
    if ok.all():
        note = "; every measured batch fits the ceiling, so a larger grid may find a bigger budget"
    return Recommendation(int(x[best]), ceiling_ms, float(y[best]), float(tokens_per_s[best]),
                          f"{int(x[best])} tokens gives the most throughput ({tokens_per_s[best]:,.0f} "
                          f"tokens/s) within {ceiling_ms:.3g} ms per batch{note}")


def throughput_saturation(num_tokens: np.ndarray, latency_ms: np.ndarray,
                          fraction: float = 0.9) -> tuple[int, float]:
    """The smallest measured batch reaching ``fraction`` of the peak tokens/s, and that peak.
    Where latency has no flat part (CPUs), this is where batching stops paying."""
    x = np.asarray(num_tokens, dtype=float)
    tokens_per_s = x / (np.asarray(latency_ms, dtype=float) / 1000.0)
    peak = float(tokens_per_s.max())
    return int(x[np.flatnonzero(tokens_per_s >= fraction * peak)[0]]), peak
