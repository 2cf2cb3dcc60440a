"""The user docs: README.md stays a short front page, every relative link in it and in docs/
resolves, and docs/configuration.md is what tokq.config_doc generates from tokq/config.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_support import headings, prose_lines

from tokq import config_doc

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
MAX_README_LINES = 200
MAX_README_WORDS_PER_SENTENCE = 22

# [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def anchors(path: Path) -> set[str]:
    """The anchors a markdown file offers: one per heading (GitHub's numbering of repeats
    included) and any explicit id= / name= attribute."""
    text = path.read_text()
    found = {anchor for _, _, anchor in headings(text)}
    for line in prose_lines(text):
        found.update(re.findall(r"""(?:id|name)=["']([^"']+)["']""", line))
    return found


def relative_links(path: Path) -> list[str]:
    """Every link target in ``path`` outside code that is not a URL (http:, mailto: ...)."""
    targets = []
    for line in prose_lines(path.read_text()):
        line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link
        for target in LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                targets.append(target)
    return targets


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


# `path` in backticks naming a file or folder of this repository (globs are left out)
PATH_IN_CODE = re.compile(r"`((?:tokq|gateway|workers|lua|profiling|deploy|tests|docs|\.ci)/[\w./-]*)`")
# `tokq.module.attribute` in backticks; tokq.v1.Embedder is the gRPC service's name, not Python's
DOTTED_IN_CODE = re.compile(r"`(tokq(?:\.\w+)+)`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_module_named_in_code_exists(page):
    import importlib

    text = page.read_text()
    missing = [p for p in PATH_IN_CODE.findall(text) if not (ROOT / p.rstrip("/")).exists()]
    for dotted in set(DOTTED_IN_CODE.findall(text)):
        if dotted.startswith("tokq.v1.Embedder"):
            continue
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(dotted)
            break
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {sorted(missing)}"


def test_configuration_md_is_the_generated_page():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_doc.render(), (
        "docs/configuration.md differs from what tokq/config.py generates: run `make docs`")


def test_the_configuration_page_lists_every_setting_its_flag_and_variable():
    from tokq import config as cfg
    import dataclasses

    page = config_doc.render()
    for cls in config_doc.config_classes():
        assert f"## {cls.__name__}" in page
        for f in dataclasses.fields(cls):
            assert f"`{cfg.flag_of(f)}`" in page and f"`{cfg.env_var(f.name)}`" in page, f.name
    for name in cfg.OTHER_ENV:
        assert f"`{name}`" in page


def test_config_doc_check_fails_on_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(config_doc.render().replace("TOKQ_LEASE_MS", "TOKQ_LEASE"))
    assert config_doc.main(["--check", str(stale)]) == 1
    assert "make docs" in capsys.readouterr().err
    assert config_doc.main(["--write", str(stale)]) == 0
    assert config_doc.main(["--check", str(stale)]) == 0


def readme_sentences(text: str) -> list[str]:
    """The README's prose sentences: outside code blocks, tables and headings; a list item or a
    paragraph break also ends a sentence."""
    blocks, current = [], []
    for line in prose_lines(text):
        stripped = line.strip()
        if not stripped or stripped.startswith(("|", "#")) or re.match(r"^([-*]|\d+\.)\s", stripped):
            if current:
                blocks.append(" ".join(current))
            current = []
            if re.match(r"^([-*]|\d+\.)\s", stripped):
                current = [re.sub(r"^([-*]|\d+\.)\s+", "", stripped)]
            continue
        current.append(stripped)
    if current:
        blocks.append(" ".join(current))
    sentences = []
    for block in blocks:
        sentences += [s for s in re.split(r"(?:(?<=[.!?])|(?<=[.!?]\*\*))\s+(?=[A-Z`*\[(])", block) if s.strip()]
    return sentences


def test_the_readme_is_a_short_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    sentences = readme_sentences(text)
    words = sum(len(s.split()) for s in sentences) / len(sentences)
    assert words <= MAX_README_WORDS_PER_SENTENCE, f"{words:.1f} words a sentence"


def test_the_readme_links_every_docs_page():
    linked = {Path(t.partition("#")[0]).name for t in relative_links(README)}
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.name not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_every_metric_and_alert_is_documented():
    import yaml

    from tokq import metrics

    page = (ROOT / "docs" / "metrics.md").read_text()
    for name, kind in metrics.series_names().items():
        base = re.sub(r"_(bucket|sum|count)$", "", name) if kind == "histogram" else name
        assert f"`{base}" in page, f"{base} is not in docs/metrics.md"
    rules = yaml.safe_load((ROOT / "deploy/prometheus/rules/tokq-alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert f"`{rule['alert']}`" in page, f"alert {rule['alert']} is not in docs/metrics.md"


HISTORY = re.compile(r"\b(session \d+|sessions \d|issue \d+|issue's|bug hunt)\b", re.I)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_do_not_narrate_history(page):
    hits = [line.strip() for line in page.read_text().splitlines() if HISTORY.search(line)]
    assert not hits, f"{page.relative_to(ROOT)}: {hits}"
