"""What this machine's CPU is, from /proc/cpuinfo (Linux; elsewhere the fallbacks): its model
name and vector extension for benchmark and profile reports, its feature flags for the CPU
dtype choice; and how many CPUs this process may use (affinity and cgroup quota), for the
thread and process counts chosen by default."""

from __future__ import annotations

import math
import os
import platform
import re
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


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


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """Where this process's CPU controller files may be: its own cgroup's folder (cgroup v2's
    unified tree, or v1's cpu hierarchy), then the mount's root (inside a container with its own
    cgroup namespace the root is the container's cgroup)."""
    found: list[Path] = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # v2: "0::/path"
            found.append(root / rel)
        elif "cpu" in controllers.split(","):  # v1: "4:cpu,cpuacct:/path"
            found += [root / controllers / rel, root / "cpu" / rel, root / "cpu,cpuacct" / rel]
    return found + [root, root / "cpu", root / "cpu,cpuacct"]


def cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPUs a cgroup CPU quota allows this process (Kubernetes' CPU limit, `docker --cpus`):
    cgroup v2's cpu.max, else v1's cpu.cfs_quota_us / cpu.cfs_period_us; None when there is no
    quota or none can be read. Affinity does not show it: a 2-CPU limit on a 64-CPU host
    leaves all 64 in the affinity mask."""
    for folder in _cgroup_dirs(root, proc_cgroup):
        try:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        except (OSError, ValueError):
            pass
        try:
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
            return quota / period if quota > 0 and period > 0 else None  # -1: no quota
        except (OSError, ValueError):
            continue
    return None


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """CPUs this process may keep busy: those its affinity allows (a taskset's or cpuset's
    share), at most its cgroup CPU quota rounded up; never less than 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cpu_quota(root, proc_cgroup)
    return max(1, min(cpus, math.ceil(quota)) if quota else cpus)
