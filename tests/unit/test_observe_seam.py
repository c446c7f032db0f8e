"""The seam every observability part uses (``pikku_celery.observe``): every event the engine
reports reaches the observers, passes included, in the thread that did the work and properly
nested; an observer that raises is logged and changes nothing."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery, observe
from pikku_celery.engine.observed import BUSY, ENDED, WAITING
from pikku_celery.model import keys
from tests.unit.test_in_place import Worker


def _pikku(monkeypatch: pytest.MonkeyPatch, *observers: Any) -> PikkuCelery:
    monkeypatch.setattr(observe, "install", lambda pikku: list(observers))
    return PikkuCelery(Celery(f"seam-{uuid.uuid4().hex[:8]}", broker="memory://"),
                       store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                       worker_reaper=False)


def test_every_event_reaches_the_observers_passes_around_their_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str, dict[str, Any]]] = []
    pikku = _pikku(monkeypatch, lambda event, sender, fields: seen.append(
        (event, sender, fields)))
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"seam{tag}.one")
    def one(data: Any) -> int:
        return 1

    @pikku.workflow(f"seam-{tag}")
    def flow(wf: Any, data: Any) -> int:
        return int(wf.do("a", one, data)) + int(wf.do("b", one, data))

    worker = Worker(pikku)  # a worker's deliveries, steps run in place
    run_id = pikku.start(flow, None)
    worker.drain()
    assert worker.sent == [] and pikku.get_run(run_id).status == "completed"

    names = [event for event, _, _ in seen]
    assert names[0] == "run_started" and names[-1] == "pass_finished"
    assert names.count("step_attempt_started") == names.count("step_attempt_finished") == 2
    depth = 0
    for event, sender, fields in seen:  # passes nest: no attempt outside a pass here
        if event == "pass_started":
            depth += 1
            assert sender == "pass" and fields["run_id"] == run_id
        elif event == "pass_finished":
            depth -= 1
            assert fields["outcome"] in (ENDED, WAITING) and fields["duration"] >= 0
        elif event.startswith("step_attempt"):
            assert depth >= 1, (event, seen)  # run in place: inside the pass that ran it
        assert depth >= 0
    assert depth == 0
    finished = [f for e, _, f in seen if e == "pass_finished"]
    assert finished[-1]["outcome"] == ENDED
    # An attempt run in place names its workflow and says it ran in place (logs, traces).
    attempts = [f for e, _, f in seen if e.startswith("step_attempt")]
    assert attempts and all(f["in_place"] and f["workflow"] == f"seam-{tag}"
                            for f in attempts)
    assert {f["workflow"] for f in finished} <= {None, f"seam-{tag}"}


def test_a_pass_that_finds_the_run_held_is_reported_busy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    pikku = _pikku(monkeypatch, lambda event, sender, fields: seen.append((event, fields)))
    tag = uuid.uuid4().hex[:6]

    @pikku.workflow(f"seam-busy-{tag}")
    def flow(wf: Any, data: Any) -> None:
        return None

    run_id = pikku.start(flow, None)  # not inline: no pass yet
    held = pikku.engine.leases.acquire(keys.run_lease_key(run_id), "someone-else", 60_000)
    assert held is not None
    with pytest.raises(Exception):  # noqa: B017 - LeaseTakenError, whatever wraps it
        pikku.engine.advance(run_id)
    assert [(e, f.get("outcome")) for e, f in seen if e.startswith("pass")] == [
        ("pass_started", None), ("pass_finished", BUSY)]


def test_an_observer_that_raises_is_logged_and_changes_nothing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    after: list[str] = []

    def broken(event: str, sender: str, fields: dict[str, Any]) -> None:
        raise RuntimeError("observer bug")

    pikku = _pikku(monkeypatch, broken, lambda event, sender, fields: after.append(event))
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"seam{tag}.one")
    def one(data: Any) -> int:
        return 1

    @pikku.workflow(f"seam-broken-{tag}")
    def flow(wf: Any, data: Any) -> int:
        return int(wf.do("a", one, data))

    with caplog.at_level(logging.ERROR, logger="pikku_celery"):
        run_id = pikku.start(flow, None, inline=True)
    assert pikku.get_run(run_id).status == "completed"
    assert "run_finished" in after  # the observers after the broken one were told
    assert any("observer" in r.getMessage() and r.exc_info for r in caplog.records)
