"""Parse the duration forms users write (``"500ms"``, ``"30s"``, ``5``, ``timedelta``)."""

from __future__ import annotations

import math
import re
from datetime import timedelta

Duration = int | float | str | timedelta

_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")


def to_seconds(value: Duration, *, what: str = "duration") -> float:
    """Return ``value`` in seconds; ``ValueError`` names the bad value otherwise.

    Negative, NaN and infinite values are refused: a lease or delay that can never
    elapse (or has elapsed before it starts) is always a caller's mistake.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid {what}: {value!r} (a bool is not a duration)")
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None:
            raise ValueError(
                f"invalid {what}: {value!r} (use seconds, a timedelta, or a string like "
                "'500ms', '30s', '5m', '1h', '1d')"
            )
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    else:
        raise ValueError(f"invalid {what}: {value!r} (type {type(value).__name__})")
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise ValueError(f"invalid {what}: {value!r} (must be a finite, non-negative time)")
    return seconds


def to_ms(value: Duration, *, what: str = "duration") -> int:
    """Return ``value`` in whole milliseconds (rounded up, so 0.1 ms is 1 ms)."""
    return math.ceil(to_seconds(value, what=what) * 1000)
