"""The README, docs/ and benchmarks/RESULTS.md link to each other: every relative link must land.

A link is checked the way GitHub renders it: the path relative to the linking file must exist, and an
``#anchor`` must be the slug of a heading in the target (GitHub's rule: lower case, punctuation other
than ``-`` and ``_`` dropped, spaces to hyphens, ``-1``, ``-2``, ... for repeats). Links inside code
blocks and code spans are text, not links, and are skipped; so are absolute URLs and ``mailto:``.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [
    REPO / "README.md",
    REPO / "benchmarks" / "RESULTS.md",
    REPO / "tests" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans (a `[x](y)` there is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(FENCE.sub("", page.read_text())):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO)}: ({target})"
        if not dest.exists():
            problems.append(f"{where} names a file that does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading of {dest.relative_to(REPO)} has the anchor #{anchor}")
    return problems


def test_every_documentation_page_the_links_walk_exists():
    assert [p.relative_to(REPO) for p in PAGES if not p.exists()] == []


def test_every_relative_link_in_the_readme_docs_and_results_lands_on_a_file_and_heading():
    problems = [problem for page in PAGES for problem in broken_links(page)]
    assert problems == [], "\n".join(problems)
