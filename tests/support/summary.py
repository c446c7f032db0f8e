"""Lines a test adds to the pytest terminal summary (printed with or without -s).

``tests/conftest.py`` prints them at the end of the run. Under pytest-xdist (``./dev test``
runs two processes) a test's lines are made in a worker process: the conftest hands each
worker's lines to the controller, which prints them all, once."""

from __future__ import annotations

LINES: list[str] = []


def add(line: str) -> None:
    """Repeat ``line`` in the terminal summary of this run."""
    LINES.append(line)
