"""The per-attempt timeline the CLI and the dashboard draw (``pikku_celery.timeline``):
outcomes, spans and waits read from a store's steps and history."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pikku_celery import InMemoryWorkflowStore
from pikku_celery.store.base import NewRun, NewStep
from pikku_celery.timeline import build, format_duration
from tests.support.operate import ADD, LEASE_MS

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
