"""The profile figure: latency and throughput against batch tokens (log x), the knee and budget marked."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
import numpy as np  # noqa: E402

from tokq.profiling.profile.knee import KneeFit, plain  # noqa: E402


def _fit_from(report: dict) -> KneeFit | None:
    fit = report.get("fit")
    if not fit:
        return None
    return KneeFit(**{k: fit[k] for k in KneeFit.__dataclass_fields__})


def plot_profile(report: dict, path: str | Path) -> Path:
    """Write the figure for a `tokq profile` report (the dict written to --out) to ``path``."""
    points = report["points"]
    if not points:
        raise ValueError("the profile has no measured points to plot")
    tokens = np.array([p["num_tokens"] for p in points], dtype=float)
    median_ms = np.array([p["median_ms"] for p in points])
    p10_ms = np.array([p["p10_ms"] for p in points])
    p90_ms = np.array([p["p90_ms"] for p in points])
    tokens_per_s = np.array([p["tokens_per_s"] for p in points])

    fig, (ax_ms, ax_tps) = plt.subplots(2, 1, sharex=True, figsize=(8, 7), constrained_layout=True)
    ax_ms.errorbar(tokens, median_ms, yerr=[median_ms - p10_ms, p90_ms - median_ms], fmt="o",
                   color="C0", capsize=3, label="median forward latency (p10-p90 bars)")
    fit = _fit_from(report)
    if fit is not None:
        dense = np.geomspace(tokens[0], tokens[-1], 200)
        ax_ms.plot(dense, fit.predict_ms(dense), "-", color="C1", alpha=0.8,
                   label=f"flat-then-linear fit ({fit.kind})")
    ax_tps.plot(tokens, tokens_per_s / 1000.0, "o-", color="C2", label="throughput")
    if fit is not None:  # the budget's throughput cap is read from the fitted curve
        ax_tps.plot(dense, dense / fit.predict_ms(dense), "-", color="C1", alpha=0.6, label="fitted throughput")

    rec = report.get("recommendation") or {}
    if rec.get("max_batch_ms"):
        ax_ms.axhline(rec["max_batch_ms"], color="grey", ls=":",
                      label=f"goal p99 <= {plain(rec['slo_p99_ms'])} ms: "
                            f"forward <= {plain(rec['max_batch_ms'])} ms")
    if rec.get("latency_cap_tokens"):
        ax_ms.axvline(rec["latency_cap_tokens"], color="grey", ls="-.", alpha=0.8,
                      label=f"largest batch within the goal: {rec['latency_cap_tokens']} tokens")
    for ax in (ax_ms, ax_tps):
        if report.get("knee_tokens"):
            ax.axvline(report["knee_tokens"], color="C3", ls="--",
                       label=f"knee ~{report['knee_tokens']:.0f} tokens" if ax is ax_ms else None)
        if rec.get("token_budget"):
            ax.axvline(rec["token_budget"], color="C4", ls="-", lw=2, alpha=0.7,
                       label=(f"recommended budget {rec['token_budget']} tokens (limited by {rec['limited_by']})"
                              if ax is ax_ms else None))
    sat = report.get("saturation")
    if sat:
        ax_tps.axvline(sat["tokens"], color="C2", ls=":",
                       label=f"{sat['fraction']:.0%} of peak throughput at {sat['tokens']} tokens")
    if rec.get("token_budget"):
        ax_tps.annotate(f"{rec['tokens_per_s']:,.0f} tokens/s", (rec["token_budget"], rec["tokens_per_s"] / 1000.0),
                        textcoords="offset points", xytext=(6, -14), color="C4")

    ax_ms.set_xscale("log", base=2)
    ax_ms.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    ax_ms.set_yscale("log")
    ax_ms.set_ylabel("latency per batch (ms)")
    ax_tps.set_ylabel("throughput (k tokens/s)")
    ax_tps.set_xlabel("tokens per batch (log scale)")
    ax_tps.set_ylim(bottom=0)
    for ax in (ax_ms, ax_tps):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    title = (f"tokq profile: {report['model']} on {report['device']} ({report['device_name']}), "
             f"{report['dtype']}")
    if rec.get("token_budget"):
        title += (f"\nbudget {rec['token_budget']} tokens for p99 <= {plain(rec['slo_p99_ms'])} ms, "
                  f"limited by {rec['limited_by']}")
    elif rec:
        title += f"\nno budget meets p99 <= {plain(rec['slo_p99_ms'])} ms"
    fig.suptitle(title, fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
