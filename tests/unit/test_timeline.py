"""The per-attempt timeline the CLI and the dashboard draw (``pikku_celery.operate.timeline``):
outcomes, spans and waits read from a store's steps and history; event waits, publishes and
the events sent to a run (each with the wait that took it)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery

from pikku_celery import InMemoryWorkflowStore, PikkuCelery, WorkflowContext
from pikku_celery.operate._text import format_duration, format_time
from pikku_celery.operate.timeline import EVENT, PUBLISH, Timeline, build
from pikku_celery.store.base import NewRun, NewStep
from pikku_celery.testing import InlineKit, inline
from tests.support.operate import ADD, LEASE_MS

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

T0 = 1_700_000_000_000


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def test_open_waits_running_bars_and_the_superseded_span() -> None:
    store = InMemoryWorkflowStore()
    store.create_run(NewRun("r", "sum", None), T0)
    for name in ("queued", "retrying", "running", "lapsed"):
        store.insert_step(NewStep("r", name, ADD, max_attempts=3), T0)
    store.claim_step("r", "retrying", ADD, T0 + 100, LEASE_MS)
    store.set_error("r", "retrying", 1, {"type": "E", "message": "m"}, T0 + 200,
                    retry_at_ms=T0 + 60_000)
    store.claim_step("r", "running", ADD, T0 + 300, LEASE_MS, worker="w")
    store.claim_step("r", "lapsed", ADD, T0 + 400, LEASE_MS)
    store.claim_step("r", "lapsed", ADD, T0 + 400 + LEASE_MS + 1, LEASE_MS)
    now = at(T0 + 10_000)
    run = store.get_run("r")
    assert run is not None
    timeline = build(run, store.list_steps("r"), store.get_history("r"), now)
    steps = {s.state.step_name: s for s in timeline.steps}

    assert [(w.kind, w.open, w.end) for w in steps["queued"].waits] == [("queued", True, now)]
    retry = steps["retrying"]
    assert not retry.settled and [(w.kind, w.open) for w in retry.waits] == [
        ("queued", False), ("retry", True)]
    running = steps["running"].attempts[0]
    assert running.outcome == "running" and running.ended_at == now
    first, second = steps["lapsed"].attempts
    assert first.superseded and first.ended_at == second.started_at == at(T0 + 5_401)
    assert first.duration == timedelta(milliseconds=LEASE_MS + 1)
    assert timeline.progress() == "0/4 steps settled, 2 running, 4 attempts (1 superseded)"


def test_durations_read_as_people_write_them() -> None:
    assert [format_duration(timedelta(seconds=s)) for s in (0.25, 12.34, 245, 7380, 273600)] \
        == ["250ms", "12.3s", "4m05s", "2h03m", "3d04h"]
    assert format_duration(None) == "-"


# --- events (issue 26 item 1) ---------------------------------------------------------------


@pytest.fixture
def evented() -> Iterator[tuple[PikkuCelery, InlineKit]]:
    """``checkout``: publishes ``stage``, waits for ``paid`` (timeout one hour), publishes
    again, then waits for ``paid`` again (no timeout); the kit holds its timers."""
    pikku = PikkuCelery(Celery(f"timeline-{uuid.uuid4().hex[:8]}", broker="memory://"))

    @pikku.workflow()
    def checkout(wf: WorkflowContext, data: Any) -> Any:
        wf.set_event("stage", "waiting for payment")
        paid = wf.wait_for_event("paid", timeout="1h", default="late")
        wf.set_event("stage", "paid")
        return [paid, wf.wait_for_event("paid")]

    with inline(pikku, hold_timers=True) as kit:
        yield pikku, kit


def timeline_of(pikku: PikkuCelery, run_id: str, now: datetime | None = None) -> Timeline:
    return build(pikku.get_run(run_id), pikku.get_steps(run_id), pikku.get_history(run_id),
                 now or datetime.now(UTC), events=pikku.list_events(run_id))


def test_event_waits_and_publishes_are_their_own_kinds(
        evented: tuple[PikkuCelery, InlineKit]) -> None:
    pikku, _ = evented
    run_id = pikku.start("checkout", None)
    timeline = timeline_of(pikku, run_id)
    # The kit's clock does not move between steps: same-millisecond steps list by name.
    assert sorted((s.kind, s.label) for s in timeline.steps) == [
        (EVENT, "event paid"), (PUBLISH, "published stage")]
    [wait] = timeline.event_waits
    assert (wait.name, wait.step_name, wait.label, wait.status) == (
        "paid", "__event:paid", "event paid", "waiting")
    assert wait.expires_at is not None and wait.seq is None
    assert timeline.waiting_event == wait and timeline.event_wait_only == wait
    assert timeline.approval_only is None and timeline.waiting_gate is None
    assert sorted(w.kind for s in timeline.steps for w in s.waits) == ["event", "publish"]
    assert timeline.progress().endswith(
        f", waiting for event 'paid' (times out at {format_time(wait.expires_at)})")
    [published] = timeline.published
    assert (published.key, published.label, published.value) == (
        "stage", "published stage", "waiting for payment")
    # Past its timeout, before a pass settled it: no longer waiting, resume not refused.
    late = timeline_of(pikku, run_id, wait.expires_at + timedelta(seconds=1))
    assert late.event_waits[0].status == "expiry-passed" and late.event_wait_only is None


def test_sent_events_name_the_wait_that_took_them(
        evented: tuple[PikkuCelery, InlineKit]) -> None:
    pikku, _ = evented
    run_id = pikku.start("checkout", None)
    pikku.send_event(run_id, "shipped", {"carrier": "ups"}, key="ship-1")
    pikku.send_event(run_id, "paid", {"amount": 12})
    timeline = timeline_of(pikku, run_id)
    assert sorted(s.label for s in timeline.steps) == [
        "event paid", "event paid#2", "published stage", "published stage#2"]
    first, second = timeline.event_waits
    assert (first.status, first.seq, first.payload) == ("received", 2, {"amount": 12})
    assert first.sent_at == pikku.list_events(run_id)[1].sent_at
    assert second.status == "waiting" and second.expires_at is None
    assert "times out" not in second.describe()
    assert [(e.event.name, e.event.seq, e.event.key, e.taken_by, e.taken_by_step)
            for e in timeline.events] == [
        ("shipped", 1, "ship-1", None, None), ("paid", 2, None, "event paid", "__event:paid")]
    assert sorted((p.label, p.value) for p in timeline.published) == [
        ("published stage", "waiting for payment"), ("published stage#2", "paid")]
    pikku.send_event(run_id, "paid", 7)
    ended = timeline_of(pikku, run_id)
    assert ended.run.status == "completed" and ended.waiting_event is None
    assert ended.events[-1].taken_by == "event paid#2"
    # Without events read, the timeline lists none (the waits still show what they took).
    bare = build(ended.run, pikku.get_steps(run_id), [], datetime.now(UTC))
    assert bare.events == [] and bare.event_waits[1].seq == 3


def test_a_timed_out_wait_and_a_wait_beside_a_suspension(
        evented: tuple[PikkuCelery, InlineKit]) -> None:
    pikku, kit = evented
    run_id = pikku.start("checkout", None)
    kit.advance("2h")
    first = timeline_of(pikku, run_id).event_waits[0]
    assert (first.status, first.seq, first.payload) == ("timed-out", None, None)

    store = InMemoryWorkflowStore()
    store.create_run(NewRun("r", "sum", None), T0)
    store.insert_step(NewStep("r", "__event:go", None, {"event": "go", "expires_at_ms": None},
                              status="scheduled"), T0)
    store.insert_step(NewStep("r", "__suspend:review", None, status="scheduled"), T0)
    run = store.get_run("r")
    assert run is not None
    both = build(run, store.list_steps("r"), [], at(T0 + 1000))
    assert both.waiting_event is not None and both.event_wait_only is None
    assert [s.kind for s in both.steps] == [EVENT, "suspension"]
    # A step merely named like a wait (no event in its data) is not one.
    store.insert_step(NewStep("r", "__event:odd", None, {"x": 1}, status="scheduled"), T0)
    kinds = {s.state.step_name: s.kind for s in build(run, store.list_steps("r"), [],
                                                      at(T0)).steps}
    assert kinds["__event:odd"] == "sleep"
