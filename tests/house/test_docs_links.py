"""Every relative link in README.md, BENCHMARKS.md and docs/*.md resolves: the file exists, and a ``#anchor`` names
one of its headings (GitHub's slugs). Links inside fenced code are not links; web addresses are not checked (no
network in tests)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and spaces dropped, spaces as hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()).splitlines():
        if m := re.match(r"^#{1,6} (.+)$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_pages_exist_and_have_links():
    assert all(p.is_file() for p in PAGES) and len(PAGES) >= 10
    assert sum(len(links(p)) for p in PAGES) > 30


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_readme_quick_start_is_within_its_first_60_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## Quick start"))
    assert start < 60 and "<!-- /main-command -->" in lines[:60] and "<!-- /test-command -->" in lines[:60]
