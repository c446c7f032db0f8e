"""The documentation stays readable and whole (issue 25, item 7): the README is a short
front page, every example a test runs is found exactly once, and every page under docs/
is in the site's nav. The strict build itself (broken links and anchors) runs in
``./dev lint`` (``./dev docs``)."""

from __future__ import annotations

import re
from collections import Counter

from tests.support.readme import DOCS, README, ROOT, markers, readme_example

NAV_PAGE = re.compile(r"^\s*-\s+(?:[^:\n]+:\s+)?([\w./-]+\.md)\s*$", re.MULTILINE)


def test_the_readme_stays_under_300_lines() -> None:
    assert len(README.read_text().splitlines()) < 300


def test_every_example_marker_is_found_exactly_once() -> None:
    names = Counter(name for name, _ in markers())
    assert names, "no readme-example marker found"
    assert [name for name, count in names.items() if count != 1] == []
    for name in names:
        assert readme_example(name).strip()


def test_the_examples_the_tests_run_are_all_there() -> None:
    used = set()
    for path in (ROOT / "tests").rglob("*.py"):
        used |= set(re.findall(r'readme_example\("([^"]+)"\)', path.read_text()))
    assert used
    assert used <= {name for name, _ in markers()}


def nav_pages() -> set[str]:
    """The pages mkdocs.yml's nav names: its lines up to the next top-level key."""
    lines = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1].splitlines()
    block = []
    for line in lines:
        if line and not line[0].isspace() and not line.startswith(("-", "#")):
            break
        block.append(line)
    return set(NAV_PAGE.findall("\n".join(block)))


def test_every_docs_page_is_in_the_nav_and_every_nav_page_exists() -> None:
    nav = nav_pages()
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert pages - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - pages == set(), "nav entries with no page"


def test_the_readme_links_only_to_files_that_exist() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\((?!https?:|#)([^)#]+)(?:#[^)]*)?\)", text)
    assert targets
    assert [t for t in targets if not (ROOT / t).exists()] == []
    assert not re.search(r"\]\(#", text), "README anchors point into the docs pages now"
