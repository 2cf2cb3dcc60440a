"""Rewriting one generated section of profiling/RESULTS.md: the text between
``<!-- NAME: start -->`` and ``<!-- NAME: end -->`` is replaced (appended when missing), so a
benchmark's figures are always what its command, written above them, last printed."""

from __future__ import annotations

import os
from pathlib import Path

from tokq.profiling.results_md import write_block


def shared_machine_note() -> str:
    one, five, fifteen = os.getloadavg()
    return (f"Load average at the end {one:.1f} / {five:.1f} / {fifteen:.1f}: a shared 2-core "
            "machine, other processes competed for the CPU.")


def write_section(path: str | Path, name: str, title: str, command: str, body: list[str]) -> None:
    start, end = f"<!-- {name}: start (generated; edits here are overwritten) -->", f"<!-- {name}: end -->"
    block = "\n".join([start, f"## {title}", "", f"`{command}`", "", *body, "", end])
    write_block(Path(path), block, start, end)
