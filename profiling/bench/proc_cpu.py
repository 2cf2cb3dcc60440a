"""CPU time of processes, read from /proc (Linux): what each part of a running service costs,
so a benchmark can say which process saturates first (a Python process near 1.0 core is)."""

from __future__ import annotations

import os
from pathlib import Path


def proc_cpu_s(pid: int) -> float:
    """User + system CPU-seconds of every thread of process ``pid`` so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def proc_wakeups(pid: int) -> int:
    """Context switches of every live thread of process ``pid`` so far, voluntary (it waited,
    then was woken) and involuntary (preempted): how often its threads were put back on a CPU.
    At a low call rate each call wakes the event loop and gRPC's threads on its own, and each
    wake-up costs CPU (the kernel, the loop's dispatch, cold caches) whatever the call does."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if "ctxt_switches:" in line:  # voluntary_ and nonvoluntary_
                total += int(line.split(":")[1])
    return total


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (from any of its threads); none if it is gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # gone meanwhile
        return []
    kids: list[int] = []
    for task in tasks:
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: its children, theirs, and so on."""
    found: list[int] = []
    todo = [pid]
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
    """Each role's CPU use between two ``cpu_by_role`` readings, in cores (CPU-s per second of
    ``wall_s``): all its processes and their threads together. A process that appeared in
    between counts from zero; one that ended in between is lost (its /proc entry is gone)."""
    if wall_s <= 0:
        return {}
    return {role: round(sum(max(0.0, cpu - before.get(role, {}).get(pid, 0.0)) for pid, cpu in pids.items())
                        / wall_s, 3)
            for role, pids in after.items()}
