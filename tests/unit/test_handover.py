"""The note a pass leaves with the run lease (issue 34 item 6, ``engine.handover``): it
round-trips every field of a step, is adopted only when it closes the gap to the grant
before exactly, is refused for anything else (another run, a gap, a base past the view,
bytes that are not a note), and is not left when too large."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from pikku_celery.engine import handover
from pikku_celery.model import views
from pikku_celery.model.records import StepState, WorkflowRun
from pikku_celery.model.views import RunView
from pikku_celery.store.base import NewRun
from pikku_celery.store.memory import InMemoryWorkflowStore

T = datetime(2026, 12, 6, 9, 0, 0, 123000, tzinfo=timezone.utc)


def run(run_id: str = "r1") -> WorkflowRun:
    return WorkflowRun(run_id, "wf", "running", {"big": "input"}, None, None, T, T)


def step(name: str, **changes: Any) -> StepState:
    values: dict[str, Any] = dict(
        run_id="r1", step_name=name, status="succeeded", attempt=2, max_attempts=4,
        function="fn", data={"a": [1, 2]}, result={"ok": True}, error=None,
        lease_expires_at=None, created_at=T, updated_at=T, invocation_id=f"r1:{name}",
        due_at=T, progress={"rows": 3}, progress_at=T, errors_retried=False)
    values.update(changes)
    return StepState(**values)


def writer(token: int, base: int, *names: str, waiting: set[str] | None = None) -> bytes:
    """The note of a pass under grant ``token`` whose note covers the grants after
    ``base``."""
    view = RunView(run(), {}, token, 0)
    view.base = base
    view.begin()
    view.waiting = waiting or set()
    for name in names:
        view.put(step(name))
    note, cumulative = handover.note_of(view, token)
    assert note is not None and cumulative
    return note


def reader(token: int) -> RunView:
    """A view made current under grant ``token``, its note begun there."""
    view = RunView(run(), {"s0": step("s0")}, token, 0)
    view.begin()
    view.restart_note()
    return view


def test_a_note_closing_the_gap_is_adopted_with_every_field() -> None:
    view = reader(4)
    assert handover.adopt(view, writer(5, 4, "s1", "s2"), token=6)
    assert view.steps["s1"] == step("s1") and view.steps["s2"] == step("s2")
    assert (view.token, view.base, view.run_stale) == (5, 4, True)
    # Its own note carries what it adopted and what it puts next (cumulative).
    view.put(step("s3"))
    assert list(view.changed) == ["s1", "s2", "s3"]


def test_notes_carry_every_change_since_their_base_across_grants() -> None:
    """Two processes alternating on a fan-out: the reader's view is three grants old, and
    the grant before was the writer's second in a row. The writer's note still covers all
    of it (from its base, 3), so the reader adopts it instead of reading the run, and
    learns what the writer's gather waited on."""
    view = reader(3)
    note = writer(6, 3, "s1", "s2", waiting={"s4", "s5"})
    assert handover.adopt(view, note, token=7)
    assert {"s1", "s2"} <= set(view.steps) and view.waiting == {"s4", "s5"}
    assert (view.token, view.base) == (6, 3)


def test_a_note_starts_again_past_its_step_limit() -> None:
    view = RunView(run(), {}, 9, 0)
    view.base = 2
    for i in range(views.NOTE_STEPS):
        view.put(step(f"s{i}"))
    view.begin()
    assert (view.base, view.changed) == (9, {})


@pytest.mark.parametrize(("note_token", "note_base", "grant", "why"), [
    (5, 4, 7, "a grant between the note and this one"),
    (5, 5, 6, "the note starts after the reader's view"),
    (4, 3, 5, "the reader's view is current already"),
])
def test_a_note_that_does_not_close_the_gap_is_refused(note_token: int, note_base: int,
                                                       grant: int, why: str) -> None:
    view = reader(4)
    assert not handover.adopt(view, writer(note_token, note_base, "s1"), token=grant), why
    assert "s1" not in view.steps and view.token == 4 and not view.run_stale


@pytest.mark.parametrize("note", [None, b"", b"not json", b'{"v": 99, "steps": []}',
                                  b'{"v": 1, "run": "r1", "base": 4, "token": 5, "steps": [{}]}'])
def test_what_is_not_a_note_is_refused(note: bytes | None) -> None:
    view = reader(4)
    assert not handover.adopt(view, note, token=6)
    assert view.token == 4


def test_a_note_of_another_run_is_refused() -> None:
    view = RunView(run("r2"), {}, 4, 0)
    assert not handover.adopt(view, writer(5, 4, "s1"), token=6)


def test_a_note_too_large_is_not_left() -> None:
    view = RunView(run(), {}, 4, 0)
    view.base = 4
    view.begin()
    view.put(step("s1", result="x" * handover.MAX_NOTE_BYTES))
    assert handover.note_of(view, 5) == (None, False)


def test_a_cumulative_note_too_large_leaves_the_pass_own() -> None:
    """The steps of earlier passes would not fit: the note carries this pass's alone
    (from the token it began at), and the next notes start from there."""
    view = RunView(run(), {}, 4, 0)
    view.base = 1
    view.put(step("old", result="x" * (handover.MAX_NOTE_BYTES - 100)))
    view.begin()
    view.put(step("s1"))
    note, cumulative = handover.note_of(view, 5)
    assert note is not None and not cumulative
    reader_view = reader(4)
    assert handover.adopt(reader_view, note, token=6) and "old" not in reader_view.steps
    view.restart_note()
    assert (view.base, list(view.changed)) == (4, ["s1"])


def test_a_process_without_a_view_builds_one_from_a_whole_note() -> None:
    store = InMemoryWorkflowStore()
    store.create_run(NewRun("r1", "wf", {"big": "input"}), 1000)
    whole = writer(5, 0, "s1", "s2")  # its writer read the run in full
    view = handover.whole_view(store, "r1", whole, token=6)
    assert view is not None and set(view.steps) == {"s1", "s2"}
    assert (view.token, view.run.input) == (5, {"big": "input"})
    assert handover.whole_view(store, "r1", writer(5, 3, "s1"), token=6) is None  # a delta
    assert handover.whole_view(store, "r1", whole, token=7) is None  # a grant between
