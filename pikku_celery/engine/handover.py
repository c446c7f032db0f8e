"""The note a pass leaves with the run lease for the next holder: the steps it learned.

A streak of steps run in place ends with a message, and on two worker processes the next
streak usually lands in the other one, whose view of the run is a streak old. Reading what
changed since (``model.views``: the steps recorded after its token) costs about one document
per step of the run (issue 34, item 6). Instead, the holder that releases the run lease
leaves a note with it (``LeaseService.release_or_take_marks``'s ``note``), handed to the
next grant in the same atomic step (``Lease.note``): every step the releasing pass put in
its view since the token its view had when the pass began (``base``), as it saw them.

A process with no view of the run builds one from a note that holds the whole run (written
by a pass that read the run in full: the second process of a long run, taking its first
streak) and the run's document. Otherwise the next holder adopts the note when it closes
the gap exactly: the note was left by the
grant just before this one (``token - 1``) and starts no later than its own view
(``base <= view.token``). Then its view holds every change up to ``token - 1``, which is
what a view made under the previous grant holds, and it is brought up to date as such a
view is (the marks this grant carries), plus one read of the run's document (the note
carries steps only). Anything else (no note, a note lost with a Redis restart or after a
minute, a gap of more than one grant, a note too large to leave) and the view is read from
the store as before. A note is never trusted for more than that: it only saves reading what
its writer already read or wrote under the lease.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pikku_celery.model.clock import epoch_ms
from pikku_celery.model.records import StepState
from pikku_celery.model.views import RunView
from pikku_celery.store._docs import to_datetime
from pikku_celery.store.base import WorkflowStore

#: A note larger than this is not left (a streak's steps with large results): the next
#: holder reads the store instead. It lives in Redis for at most a minute.
MAX_NOTE_BYTES = 256 * 1024
_VERSION = 1
_FIELDS = tuple(f.name for f in dataclasses.fields(StepState))
_TIMES = frozenset(f.name for f in dataclasses.fields(StepState) if "datetime" in str(f.type))


def note_of(view: RunView, token: int) -> tuple[bytes | None, bool]:
    """The note for the next holder of ``view``'s run, left by the pass under grant
    ``token``: the cumulative one (every step the view's passes put since ``base``), or,
    when that would be larger than ``MAX_NOTE_BYTES``, the pass's own (since it began);
    ``None`` when even that would be. With whether it is the cumulative one."""
    used: dict[str, tuple[StepState, str]] = {}
    try:
        for base, steps, cumulative in ((view.base, view.changed, True),
                                        (view.pass_base, view.pass_changed, False)):
            encoded = _note(view, base, token, steps, used)
            if encoded is not None:
                return encoded, cumulative
        return None, False
    finally:
        view.encoded = used  # only what notes carry now: the cache never outgrows them


def _note(view: RunView, base: int, token: int, steps: dict[str, StepState],
          used: dict[str, tuple[StepState, str]]) -> bytes | None:
    head = json.dumps({"v": _VERSION, "run": view.run.run_id, "base": base, "token": token,
                       "waiting": sorted(view.waiting)}, separators=(",", ":"))
    parts: list[str] = []
    size = len(head)
    cache = view.encoded
    for state in steps.values():
        kept = cache.get(state.step_name)
        if kept is None or kept[0] is not state:
            kept = (state, json.dumps(_encoded(state), separators=(",", ":"),
                                      allow_nan=False))
        used[state.step_name] = kept
        parts.append(kept[1])
        size += len(kept[1]) + 1
        if size > MAX_NOTE_BYTES:
            return None
    return (head[:-1] + ',"steps":[' + ",".join(parts) + "]}").encode()


def whole_view(store: WorkflowStore, run_id: str, note: bytes | None,
               token: int) -> RunView | None:
    """A view of ``run_id`` for a process that has none, from a note that holds the whole
    run (its writer read the run in full under the previous grant: ``base`` 0) and one
    read of the run's document; ``None`` (read the run in full) for any other note."""
    found = _decoded(note)
    if (found is None or found.get("run") != run_id or found.get("token") != token - 1
            or found.get("base") != 0):
        return None
    try:
        states = [_state(s) for s in found["steps"]]
    except (KeyError, TypeError, ValueError):
        return None
    run = store.read_run(run_id, run=True).run
    if run is None:
        return None
    view = RunView(run, {}, token - 1, epoch_ms(run.updated_at))
    for state in states:
        view.put(state)  # ``base`` 0, the whole run in ``changed``: its note is whole too
    view.pass_base, view.pass_changed = token - 1, {}
    return view


def adopt(view: RunView, note: bytes | None, token: int) -> bool:
    """Bring ``view`` up to the grant before ``token`` with ``note``, if it closes the gap
    exactly (see the module's docstring); whether it did. Its run's document is then to be
    read (``view.run_stale``)."""
    if view.token >= token - 1:
        return False  # current already (this process held the grant before): no decoding
    found = _decoded(note)
    if (found is None or found.get("run") != view.run.run_id
            or found.get("token") != token - 1 or not isinstance(found.get("base"), int)
            or found["base"] > view.token or view.token >= token - 1):
        return False
    try:
        states = [_state(s) for s in found["steps"]]
    except (KeyError, TypeError, ValueError):
        return False
    for state in states:
        view.put(state)  # into ``changed`` too: the note this pass leaves carries them on
    # Now as a view made under the previous grant; its note covers what the view's own
    # covered (from ``base``) and what this one did, contiguous since ``base <= token``;
    # the pass's own note, what it puts from here on.
    view.token = view.pass_base = token - 1
    view.pass_changed = {}
    view.base = min(view.base, found["base"])
    view.run_stale = True
    # What the writer's last replay waited on at a gather, over the steps this view now
    # holds: a pass that learns one of them succeeded may skip its replay (``skips``).
    waiting = found.get("waiting")
    view.waiting = ({n for n in waiting if isinstance(n, str)}
                    if isinstance(waiting, list) else set())
    return True


def _encoded(state: StepState) -> dict[str, Any]:
    found = {name: getattr(state, name) for name in _FIELDS}
    for name in _TIMES:
        found[name] = None if found[name] is None else epoch_ms(found[name])
    return found


def _state(found: dict[str, Any]) -> StepState:
    values = {name: found[name] for name in _FIELDS}
    for name in _TIMES:
        values[name] = to_datetime(values[name])
    return StepState(**values)


def _decoded(note: bytes | None) -> dict[str, Any] | None:
    if not note:
        return None
    try:
        found = json.loads(note)
    except ValueError:
        return None
    if not isinstance(found, dict) or found.get("v") != _VERSION or not isinstance(
            found.get("steps"), list):
        return None
    return found

