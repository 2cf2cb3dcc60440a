"""Rewrite one generated block of profiling/RESULTS.md in place (between its start and end
markers), or append it when the file has none; the rest of the file is kept as it is."""

from __future__ import annotations

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
