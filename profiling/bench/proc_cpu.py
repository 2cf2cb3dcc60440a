"""CPU time of processes, read from /proc (Linux): what each part of a running service costs, so
a benchmark can say which process saturates first (a Python process near 1.0 core is)."""

from __future__ import annotations

import os
from pathlib import Path


def proc_cpu_s(pid: int) -> float:
    """User + system CPU-seconds of every thread of process ``pid`` so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def proc_wakeups(pid: int) -> int:
    """Context switches so far of every live thread of ``pid``, voluntary and involuntary: how
    often its threads were put back on a CPU (each wake-up costs CPU, whatever the call does)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        total += sum(int(line.split(":")[1]) for line in status.splitlines() if "ctxt_switches:" in line)
    return total


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (from any of its threads); none if it is gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    kids: list[int] = []
    for task in tasks:
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def cpu_by_role(roles: dict[str, list[int]]) -> dict[str, dict[int, float]]:
    """CPU-seconds so far of each role's processes, by pid (a process gone is left out)."""
    out: dict[str, dict[int, float]] = {}
    for role, pids in roles.items():
        out[role] = {}
        for pid in pids:
            try:
                out[role][pid] = proc_cpu_s(pid)
            except (OSError, ValueError, IndexError):
                pass
    return out


def cores_between(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]],
                  wall_s: float) -> dict[str, float]:
    """Each role's cores between two ``cpu_by_role`` readings (CPU-s per second of ``wall_s``); a
    process that appeared in between counts from zero, one that ended in between is lost."""
    if wall_s <= 0:
        return {}
    return {role: round(sum(max(0.0, cpu - before.get(role, {}).get(pid, 0.0)) for pid, cpu in pids.items())
                        / wall_s, 3) for role, pids in after.items()}


def machine_busy_s() -> float | None:
    """CPU-seconds every process on the machine has used since boot (/proc/stat), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
