"""The object a setting names by its dotted path: one parser for every hook a setting may
name (a redactor, a metrics registry), so each accepts the same two spellings."""

from __future__ import annotations

from importlib import import_module


def import_dotted(path: str) -> object:
    """``pkg.mod:name`` or ``pkg.mod.name``. Raises ``ImportError``, ``AttributeError`` or
    ``ValueError`` (the caller names its setting in the error it raises)."""
    module, colon, name = path.partition(":")
    if not colon:
        module, _, name = path.rpartition(".")
    return getattr(import_module(module), name)
