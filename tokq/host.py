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
PROC_CGROUP = Path("/proc/self/cgroup")
MOUNTINFO = Path("/proc/self/mountinfo")


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


def _cpu_hierarchies(mountinfo: Path) -> list[tuple[int, str, Path]]:
    """(version, root within the hierarchy, mount point) of each mounted cgroup hierarchy that
    may limit CPU: cgroup2 (the unified tree, whatever it holds) and cgroup v1 mounted with the
    cpu controller (its name, "cpu,cpuacct" or "cpuacct,cpu", is the mount's business, not ours)."""
    found = []
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        # "ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER-OPTIONS"
        head, sep, tail = line.partition(" - ")
        fields, after = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(after) < 3:
            continue
        mount_point = Path(fields[4].replace("\\040", " "))  # mountinfo escapes a space
        if after[0] == "cgroup2":
            found.append((2, fields[3], mount_point))
        elif after[0] == "cgroup" and "cpu" in after[2].split(","):
            found.append((1, fields[3], mount_point))
    return found


def _own_cgroups(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup path in the unified (v2) tree and in v1's cpu hierarchy."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:  # not a cgroup line: skip it, never fail start-up over it
            continue
        _, controllers, path = parts
        if controllers == "":  # "0::/path"
            v2 = path
        elif "cpu" in controllers.split(","):  # "4:cpu,cpuacct:/path"
            v1 = path
    return v2, v1


def _quota_in(folder: Path) -> float | None:
    """The quota set in one cgroup folder (v2 cpu.max, else v1 cfs files); None if none."""
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
        return None


def cpu_quota(proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = MOUNTINFO) -> float | None:
    """The CPUs a cgroup CPU quota allows this process (a Kubernetes CPU limit, `docker --cpus`),
    which affinity does not show: the smallest quota on its cgroup or any parent up to the
    hierarchy's mount (v2 and v1); None when there is none or none can be read."""
    own_paths = dict(zip((2, 1), _own_cgroups(proc_cgroup)))
    quotas = []
    for version, mount_root, mount_point in _cpu_hierarchies(mountinfo):
        own = own_paths[version]
        if own is None:
            continue
        # A mount of a cgroup below the hierarchy's top (a container without its own cgroup
        # namespace sees its cgroup mounted at /sys/fs/cgroup) shows paths below that root.
        rel = Path(own).relative_to(mount_root) if Path(own).is_relative_to(mount_root) else Path(".")
        folder = mount_point / rel
        while True:
            quota = _quota_in(folder)
            if quota is not None:
                quotas.append(quota)
            if folder == mount_point or mount_point not in folder.parents:
                break
            folder = folder.parent
    return min(quotas) if quotas else None


def usable_cpus(proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = MOUNTINFO) -> int:
    """CPUs this process may keep busy: those its affinity allows (a taskset's or cpuset's
    share), at most its cgroup CPU quota rounded up; never less than 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cpu_quota(proc_cgroup, mountinfo)
    return max(1, min(cpus, math.ceil(quota)) if quota else cpus)
