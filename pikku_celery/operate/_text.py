"""Times, spans and errors as a person reads them: the same words in the terminal, the
dashboard and the checks (none of which needs the timeline to write one)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any


def format_duration(span: timedelta | None) -> str:
    """``850ms``, ``12.3s``, ``4m05s``, ``2h03m``, ``3d04h``; ``-`` when unknown."""
    if span is None:
        return "-"
    seconds = span.total_seconds()
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def format_time(moment: datetime | None) -> str:
    """UTC, to the millisecond: ``2026-05-01 12:00:03.250Z``; ``-`` when unknown."""
    if moment is None:
        return "-"
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def error_line(error: dict[str, Any] | None, *, limit: int = 300) -> str:
    """``Type: message`` on one line, cut at ``limit`` characters."""
    if not error:
        return ""
    message = " ".join(str(error.get("message", "")).split())
    line = f"{error.get('type', 'Error')}: {message}" if message else str(error.get("type"))
    return line if len(line) <= limit else line[:limit - 1] + "…"
