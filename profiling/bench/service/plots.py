"""The two `tokq bench service` figures. Each names the machine and the SLO in its title, carries units
on its axes and a legend, so it reads without the JSON."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt  # noqa: E402


def _title(report: dict, what: str) -> str:
    m = report["meta"]["machine"]
    cpu = m["cpu"][:40] + (f", {m['vector_extension']}" if m.get("vector_extension") else "")
    return f"{what}\nall-MiniLM-L6-v2 on {m['num_cpus']} CPU cores ({cpu}), whole service on one box"


def _steps(system: dict) -> list[dict]:
    return sorted(system["steps"], key=lambda s: s["offered_rps"])


def plot_latency(report: dict, path: str | Path) -> None:
    """p50 (dashed) and p99 (solid) latency against offered rate, one colour per system."""
    slo_ms = report["meta"]["options"]["slo_ms"]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, system in enumerate(report["systems"]):
        steps = _steps(system)
        rates = [s["offered_rps"] for s in steps]
        color = f"C{i}"
        ax.plot(rates, [s["latency_ms"]["p99"] for s in steps], "o-", color=color, label=f"{system['name']} p99")
        ax.plot(rates, [s["latency_ms"]["p50"] for s in steps], "--", color=color, alpha=0.6,
                label=f"{system['name']} p50")
    ax.axhline(slo_ms, color="black", linestyle=":", label=f"SLO: p99 {slo_ms:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (requests/s, open loop)")
    ax.set_ylabel("latency from intended send time (ms, log)")
    ax.set_title(_title(report, "Latency vs offered load"), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(report: dict, path: str | Path) -> None:
    """Left: highest rate each system sustains within the SLO. Right: completed vs offered rate."""
    slo_ms = report["meta"]["options"]["slo_ms"]
    systems = report["systems"]
    ref = next((s["sustainable_rps"] for s in systems if s["kind"] == "one-at-a-time"), 0.0)
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [1, 1.2]})
    names = [s["name"] for s in systems]
    values = [s["sustainable_rps"] for s in systems]
    ypos = range(len(systems))
    bars.barh(ypos, values, color=[f"C{i}" for i in ypos])
    bars.set_yticks(list(ypos), names, fontsize=8)
    bars.invert_yaxis()
    for y, v, system in zip(ypos, values, systems):
        label = f"{v:.0f}" + (f"  ({v / ref:.1f}x one-at-a-time)" if ref else "")
        if not (system.get("vectors") or {}).get("counts", True):
            label = "not counted: vectors differ from sentence-transformers"
        bars.text(v, y, " " + label, va="center", fontsize=8)
    bars.set_xlim(0, max(values + [1]) * 1.6)
    bars.set_xlabel(f"highest offered requests/s with p99 <= {slo_ms:g} ms")
    bars.set_title("Sustainable throughput at equal p99", fontsize=10)
    top = 0.0
    for i, system in enumerate(systems):
        steps = _steps(system)
        offered = [s["offered_rps"] for s in steps]
        top = max([top, *offered])
        curves.plot(offered, [s["throughput_rps"] for s in steps], "o-", color=f"C{i}", label=system["name"])
    curves.plot([0, top], [0, top], ":", color="grey", label="completed = offered")
    curves.set_xlabel("offered load (requests/s)")
    curves.set_ylabel("completed requests/s (OK only)")
    curves.set_title("Completed vs offered: where each system saturates", fontsize=10)
    curves.grid(True, alpha=0.3)
    curves.legend(fontsize=7)
    fig.suptitle(_title(report, "Throughput per system"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
