"""The README's examples, as the tests run them: a fenced ``python`` block that follows a
``<!-- readme-example: NAME ... -->`` comment. A test that runs the example as written keeps
the README true."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example(name: str) -> str:
    """The code of the README example ``name`` (for instance ``"proj.py"``)."""
    text = README.read_text()
    marker = text.index(f"<!-- readme-example: {name}")
    fence = "```python\n"
    start = text.index(fence, marker) + len(fence)
    return text[start:text.index("```", start)]
