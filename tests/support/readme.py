"""The documentation's examples, as the tests run them: a fenced ``python`` block that follows
a ``<!-- readme-example: NAME ... -->`` comment at the start of a line, in README.md or any
page under docs/. A test that runs the example as written keeps the documentation true."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MARKER = re.compile(r"^<!-- readme-example: (\S+)", re.MULTILINE)


def documents() -> list[Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def markers() -> list[tuple[str, Path]]:
    """Every example marker, as ``(name, file)``, in file order."""
    return [(match.group(1), path) for path in documents()
            for match in MARKER.finditer(path.read_text())]


def readme_example(name: str) -> str:
    """The code of the example ``name`` (for instance ``"proj.py"``), wherever it lives."""
    texts = [path.read_text() for path in documents()]
    found = [(text, match) for text in texts
             for match in MARKER.finditer(text) if match.group(1) == name]
    if len(found) != 1:
        where = ", ".join(str(path.relative_to(ROOT)) for n, path in markers() if n == name)
        raise LookupError(f"readme example {name!r} must be found exactly once in README.md "
                          f"and docs/**/*.md: found {len(found)} times ({where or 'nowhere'})")
    text, match = found[0]
    fence = "```python\n"
    start = text.index(fence, match.end()) + len(fence)
    return text[start:text.index("```", start)]
