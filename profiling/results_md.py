"""Generated blocks of profiling/RESULTS.md: rewrite one in place (between its start and end
markers), or append it when the file has none; the rest of the file is kept as it is."""

from __future__ import annotations

import os
from pathlib import Path


def write_block(path: Path, block: str, start: str, end: str) -> None:
    """``block`` begins with ``start`` and ends with ``end``."""
    text = path.read_text() if path.is_file() else "# Results\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def shared_machine_note() -> str:
    one, five, fifteen = os.getloadavg()
    return (f"Load average at the end {one:.1f} / {five:.1f} / {fifteen:.1f}: a shared 2-core "
            "machine, other processes competed for the CPU.")


def write_section(path: str | Path, name: str, title: str, command: str, body: list[str]) -> None:
    """The block ``<!-- NAME: start ... -->`` .. ``<!-- NAME: end -->``: a title, the command, the body."""
    start, end = f"<!-- {name}: start (generated; edits here are overwritten) -->", f"<!-- {name}: end -->"
    block = "\n".join([start, f"## {title}", "", f"`{command}`", "", *body, "", end])
    write_block(Path(path), block, start, end)
