"""What this machine's CPU is, from /proc/cpuinfo (Linux; elsewhere the fallbacks): its model
name for benchmark and profile reports, its feature flags for the CPU dtype choice."""

from __future__ import annotations

import platform
import re
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_field(name: str, cpuinfo: Path = CPUINFO) -> str | None:
    """The first CPU's ``name`` line ("model name", "flags", ...), or None."""
    try:
        text = cpuinfo.read_text(encoding="utf-8")
    except OSError:
        return None
    match = re.search(rf"^{re.escape(name)}\s*:(.*)$", text, re.MULTILINE)
    return match[1].strip() if match else None


def cpu_name(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name ("AMD EPYC 7763 64-Core Processor"), else what platform knows."""
    return cpuinfo_field("model name", cpuinfo) or platform.processor() or platform.machine()


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU feature flags Linux reports (empty elsewhere)."""
    return set((cpuinfo_field("flags", cpuinfo) or "").split())
