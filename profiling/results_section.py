"""Rewriting one generated section of profiling/RESULTS.md: the text between
``<!-- NAME: start -->`` and ``<!-- NAME: end -->`` is replaced (appended when missing), so a
benchmark's figures are always what its command, written above them, last printed."""

from __future__ import annotations

import os
from pathlib import Path


def shared_machine_note() -> str:
    one, five, fifteen = os.getloadavg()
    return (f"Load average at the end {one:.1f} / {five:.1f} / {fifteen:.1f}: a shared 2-core "
            "machine, other processes competed for the CPU.")


def write_section(path: str | Path, name: str, title: str, command: str, body: list[str]) -> None:
    start, end = f"<!-- {name}: start (generated; edits here are overwritten) -->", f"<!-- {name}: end -->"
    block = "\n".join([start, f"## {title}", "", f"`{command}`", "", *body, "", end])
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    head, sep, rest = text.partition(start)
    if sep and end in rest:
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")
