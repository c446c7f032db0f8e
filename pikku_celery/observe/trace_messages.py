"""A run's saved trace context, carried in pikku's own messages (a ``pikku_trace`` header).

A worker that sees a run for the first time needs the run's trace context before the
pass's span starts (its parent), which is before the pass reads the run: without the header
it reads the run once more from the store, a MongoDB read per run and worker process that
observability promised not to add. So the process that sends a message of a run it knows
(the starter, a pass sending a step, a timer or a wake) puts the context in the message's
headers, and the receiving task reads it there. A message without it (the reaper's, from a
process that never saw the run) falls back to the read.

Every message published in the process passes ``stamp`` (Celery's ``before_task_publish``):
a dict lookup by the first argument, for pikku's messages and everyone else's alike, and,
for a first argument not found there, a look at the running task's own first argument (a
task of that run passes its message's context on).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from celery import current_task, signals

from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.trace_context import check_trace

HEADER = "pikku_trace"
#: Runs whose context this process keeps for its messages (the most recent).
KEPT = 4096

_known: OrderedDict[str, dict[str, Any]] = OrderedDict()
_lock = threading.Lock()
_connected: list[bool] = []


def know(run_id: str, carrier: Mapping[str, str] | None, workflow: str | None) -> None:
    """Keep ``carrier`` (the run's saved W3C map) and its workflow's name (the spans' names)
    for the messages of ``run_id`` sent here."""
    if not carrier:
        return
    with _lock:
        _known[run_id] = {"w3c": dict(carrier), "workflow": workflow}
        _known.move_to_end(run_id)
        while len(_known) > KEPT:
            _known.popitem(last=False)
    if not _connected:
        signals.before_task_publish.connect(stamp, weak=False, dispatch_uid=__name__)
        _connected.append(True)


def stamp(sender: Any = None, body: Any = None, headers: dict[str, Any] | None = None,
          **_: Any) -> None:
    """``before_task_publish``: a message whose first argument is a run this process knows,
    or the run of the task running now (its message carried the context), carries its
    context."""
    if headers is None:
        return
    args = body[0] if isinstance(body, tuple | list) and body else (
        body.get("args") if isinstance(body, dict) else None)
    if not args or not isinstance(args[0], str):
        return
    carrier = _known.get(args[0])
    if carrier is None:
        # A task of that run sends it without having started a span of its own (a step
        # message delivered before its retry was due re-arms the timer and runs nothing):
        # its own message's context goes on, or the receiver reads the run for it.
        found = carried(args[0])
        if found is not None:
            carrier = {"w3c": found[0], "workflow": found[1]}
    if carrier is not None:
        headers[HEADER] = carrier


def carried(run_id: str) -> tuple[dict[str, str], str | None] | None:
    """The context (and workflow name) the task running now was sent with for ``run_id``
    (its first argument), or ``None``: no task, another run, no header, or a header that
    is not a valid W3C map and a name (a forged message misleads no span)."""
    task = current_task  # a proxy: false when no task runs
    if not task:
        return None
    request = task.request
    args = request.args
    if not args or args[0] != run_id:
        return None
    value = getattr(request, HEADER, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(HEADER)
    if not isinstance(value, Mapping):
        return None
    workflow = value.get("workflow")
    try:
        carrier = check_trace(value.get("w3c"))
    except InvalidInputError:
        return None
    if carrier is None or not (workflow is None or isinstance(workflow, str)):
        return None
    return carrier, workflow
