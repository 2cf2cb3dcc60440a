"""What this machine's CPU is, from /proc/cpuinfo (Linux; elsewhere the fallbacks): its model
name and vector extension for benchmark and profile reports, its feature flags for the CPU
dtype choice."""

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


def vector_extension(flags: set[str] | None = None) -> str:
    """The widest x86 vector extension the CPU has ("AVX-512", "AVX2", "SSE"), else the machine
    (aarch64, ...): CPU results differ by it more than by model name (both "AMD EPYC" here)."""
    flags = cpu_flags() if flags is None else flags
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return "SSE" if "sse2" in flags else platform.machine()
