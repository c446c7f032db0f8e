"""The trace context saved with a run (``WorkflowRun.trace``): a W3C Trace Context carrier,
``{"traceparent": ..., "tracestate": ...}``, so that every span of the run, whichever
process records it and however long after the start, joins the trace the run was started
in (``pikku_celery.observe.tracing``). It is checked before it is stored: it comes from the
caller's context (a web request's span, propagated from anywhere), and a store keeps only
what a propagator would accept again, bounded in size."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pikku_celery.model.errors import InvalidInputError

TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
# W3C Trace Context level 1: version 00 (a later version keeps this prefix), a 16-byte trace
# id and an 8-byte span id, neither all zeros, and the flags.
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
# The recommendation's limit: a propagator may drop a longer tracestate anyway.
MAX_TRACESTATE = 512


def check_trace(trace: Mapping[str, Any] | None) -> dict[str, str] | None:
    """``trace`` as stored (a plain dict), or ``InvalidInputError`` naming what is wrong."""
    if trace is None:
        return None
    if not isinstance(trace, Mapping):
        raise InvalidInputError(f"a run's trace context must be a mapping, got {trace!r}")
    unknown = set(trace) - {TRACEPARENT, TRACESTATE}
    if unknown:
        raise InvalidInputError(f"a run's trace context takes only {TRACEPARENT!r} and "
                                f"{TRACESTATE!r}, not {sorted(map(str, unknown))}")
    parent = trace.get(TRACEPARENT)
    match = _TRACEPARENT.match(parent) if isinstance(parent, str) else None
    if (match is None or parent.startswith("ff")  # type: ignore[union-attr]
            or set(match.group(1)) == {"0"} or set(match.group(2)) == {"0"}):
        raise InvalidInputError(f"a run's trace context needs a W3C traceparent "
                                f"(00-<32 hex>-<16 hex>-<2 hex>, ids not all zeros), "
                                f"got {parent!r}")
    checked = {TRACEPARENT: parent}
    state = trace.get(TRACESTATE)
    if state is not None and state != "":
        if not isinstance(state, str) or len(state) > MAX_TRACESTATE or not state.isprintable():
            raise InvalidInputError(f"a run's tracestate must be printable text of at most "
                                    f"{MAX_TRACESTATE} characters, got {state!r:.80}")
        checked[TRACESTATE] = state
    return checked  # type: ignore[return-value]
