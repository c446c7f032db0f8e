"""The leases' Lua scripts, read from ``lua/*.lua`` beside this module once, at import.

The scripts are Lua so they read as Lua (an editor highlights them, a reviewer diffs them
without Python string seams). Two fragments are shared: a line ``--#include NAME`` is
replaced by ``lua/_NAME.lua`` (the server clock, ``now_ms``; the grant, ``grant``), so every
script keeps one copy of each.
"""

from __future__ import annotations

import re
from importlib import resources

_INCLUDE = re.compile(r"^--#include (\w+)$", re.M)


def _read(file: str) -> str:
    return (resources.files(__package__) / "lua" / file).read_text(encoding="utf-8")


def _fragment(name: str) -> str:
    """``lua/_NAME.lua`` without its heading comment (that is for the reader of the file)."""
    lines = _read(f"_{name}.lua").splitlines()
    while lines and lines[0].startswith("--"):
        lines.pop(0)
    return "\n".join(lines)


def lua_script(name: str) -> str:
    """The script ``lua/NAME.lua`` with its includes expanded (one level: fragments include
    nothing)."""
    return _INCLUDE.sub(lambda m: _fragment(m.group(1)), _read(f"{name}.lua"))
