"""Every figure the user docs quote beside a link into profiling/results/ is in the section it links:
a ratio (2.33x), a share (76%), a time or a rate (33 ms, 986 requests/s), as written there or rounded.
A ratio may also be two backed figures of the same paragraph divided. A rerun that changes a figure
fails here until the docs quote the new one."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from markdown_support import sections

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS_LINK = re.compile(r"\]\(((?:\.\./)?profiling/results/[\w./-]+\.md)(?:#([\w-]+))?\)")
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")
FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(?:x\b|%| ?(?:ms|s|µs|tokens/s|requests/s|pairs/s|calls/s)\b)")
NOT_A_FIGURE = re.compile(r"(?:target|<|>|<=|>=|~)\s*$")  # a goal or a bound, not a measurement


def numbers(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in NUMBER.findall(text)]


def unbacked(block: str, source: str) -> list[str]:
    """The figures of ``block`` that ``source`` does not hold, as written or rounded to their places."""
    found = numbers(source)
    held = set(found) | {v * 100 for v in found if v <= 1}
    backed = [v for v in numbers(block) if v in held]
    missing = []
    for m in FIGURE.finditer(block):
        if NOT_A_FIGURE.search(block[:m.start()][-12:]):
            continue
        text = m.group(1)
        places = len(text.split(".")[1]) if "." in text else 0
        value = float(text.replace(",", ""))
        if not (any(round(v, places) == value for v in held)
                or any(b and round(a / b, places) == value for a, b in itertools.permutations(backed, 2))):
            missing.append(m.group(0))
    return missing


def quoting_blocks(page: Path):
    """(block, the text its results links point at) for each paragraph or table row linking profiling/results/."""
    for block in re.split(r"\n\s*\n|\n(?=\|)", page.read_text()):
        links = RESULTS_LINK.findall(block)
        if links:
            targets = []
            for path, anchor in links:
                text = (page.parent / path).resolve().read_text()
                held = sections(text) if anchor else {"": text}
                assert anchor in held, f"{page.name}: no section #{anchor} in {path}"
                targets.append(held[anchor])
            yield block, "\n".join(targets)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quoted_figure_is_in_the_section_it_links(page):
    stale = [(figures, block.strip()[:160]) for block, source in quoting_blocks(page)
             if (figures := unbacked(block, source))]
    assert not stale, f"{page.name}: figures not in the results they link: {stale}"


def test_a_stale_or_unlinked_figure_is_caught():
    source = "## Bulk\n| embed-file | 56.6 | **2.33x** |\nfill 0.996; p99 121 ms; 198 ms against 7.3 ms\n"
    assert unbacked("ran 2.33x, fill 99.6%, p99 121 ms", source) == []
    assert unbacked("ran 2.3x (rounded)", source) == []
    assert unbacked("198 ms on 2 threads against 7.3 ms on 1 (27x)", source) == []
    assert unbacked("ran 2.46x; p99 3.8x alone; 130 ms", source) == ["2.46x", "3.8x", "130 ms"]
    assert unbacked("target 2x; >= 5x; ~40 ms", source) == []
