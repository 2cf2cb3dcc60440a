"""Markdown as GitHub reads it, for the docs tests: prose outside fenced code, headings and
their anchors, and the text each heading holds."""

from __future__ import annotations

import re

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(text: str) -> list[tuple[int, int, str]]:
    """(offset, level, anchor) of each heading outside fenced code; a repeated anchor is
    numbered as GitHub numbers it (-1, -2, ...)."""
    found, seen, fenced, offset = [], {}, False, 0
    for line in text.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line.rstrip("\n"))):
            anchor = slug(m.group(2))
            n = seen.get(anchor, 0)
            seen[anchor] = n + 1
            found.append((offset, len(m.group(1)), anchor if n == 0 else f"{anchor}-{n}"))
        offset += len(line)
    return found


def sections(text: str) -> dict[str, str]:
    """Each heading's anchor and its text, up to the next heading of its level or above."""
    heads = headings(text)
    return {anchor: text[start:next((s for s, lvl, _ in heads[i + 1:] if lvl <= level), len(text))]
            for i, (start, level, anchor) in enumerate(heads)}
