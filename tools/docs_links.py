"""MkDocs hook: a page that shares a section of README.md (``--8<-- "README.md:name"``) gets
it here, with README's links to pages (written from the repository's top, as GitHub shows
them: ``docs/guide/x.md``) made relative to that page. Left to the snippets extension, the
section would keep links that lead nowhere on the site."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"
_SHARED = re.compile(r'^--8<-- "README\.md:([\w-]+)"$', re.MULTILINE)
_README_LINK = re.compile(r"\]\(docs/([^)\s]+)\)")


def section(text: str, name: str) -> str:
    start = f"<!-- --8<-- [start:{name}] -->\n"
    end = f"<!-- --8<-- [end:{name}] -->"
    if start not in text or end not in text:
        raise ValueError(f"README.md has no section {name!r}")
    return text[text.index(start) + len(start):text.index(end)]


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if not _SHARED.search(markdown):
        return markdown
    readme = README.read_text()
    here = posixpath.dirname(page.file.src_uri) or "."
    return _SHARED.sub(lambda m: _README_LINK.sub(
        lambda link: f"]({posixpath.relpath(link.group(1), here)})",
        section(readme, m.group(1))), markdown)
