"""The documentation as a reader meets it: a short README that indexes every page, links
that lead somewhere, and user pages free of dated run narratives (those are docs/dev/)."""

from __future__ import annotations

import pathlib
import re

import pytest
from qosgate import paths

ROOT = paths.project_root()
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The project's folders' READMEs; not the ones tools write into hidden folders of the
# checkout (pytest's .pytest_cache/README.md appeared after a first run, one test more).
FOLDER_READMES = [p for p in ROOT.glob("*/README.md") if not p.parent.name.startswith(".")]
PAGES = sorted([README, *DOCS.rglob("*.md"), *FOLDER_READMES])
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading anchors of a markdown page (lower case, punctuation dropped,
    spaces to hyphens, repeats numbered)."""
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        name, n = slug, 1
        while name in found:
            name, n = f"{slug}-{n}", n + 1
        found.add(name)
    return found


def local_links(page: pathlib.Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", page.read_text())) if not re.match(r"\w+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_to_a_file_and_heading(page: pathlib.Path) -> None:
    broken = []
    for target in local_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert broken == []


def test_readme_is_a_landing_page_indexing_every_docs_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in local_links(README)}
    assert [p for p in DOCS.rglob("*.md") if p.resolve() not in linked] == []
    assert "<!-- section: performance -->" in text and "<!-- /section: performance -->" in text


def test_user_docs_carry_no_dated_run_narratives() -> None:
    dated = re.compile(r"\b\d{1,2}:\d{2}(-\d{1,2}:\d{2})? UTC\b|\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) \d{1,2}\b")
    performance = re.compile(r"<!-- section: performance -->.*?<!-- /section: performance -->", re.S)
    found = []
    for page in [README, *DOCS.glob("*.md")]:
        text = performance.sub("", page.read_text())  # the generated table names its runs
        found += [f"{page.name}: {m.group(0)}" for m in dated.finditer(text)]
    assert found == []
