"""Events into a running workflow (issue 26, item 1) through the test kit's inline engine:
``wf.wait_for_event`` takes events in the order sent, events sent before the wait are kept,
a key makes a send idempotent, a timeout returns the default, an ended or unknown run
refuses a send, ``wf.set_event`` publishes what ``pikku.get_event`` reads, and a send whose
sender stopped before its wake-up is woken by the reaper."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InvalidInputError,
    PikkuCelery,
    WorkflowEventError,
    WorkflowRunNotFoundError,
)
from pikku_celery.testing import InlineKit, inline


@pytest.fixture
def pikku() -> Iterator[PikkuCelery]:
    pikku = PikkuCelery(Celery(f"events-{uuid.uuid4().hex[:8]}", broker="memory://"))

    @pikku.step()
    def record(data: Any) -> Any:
        return data

    @pikku.workflow()
    def checkout(wf: Any, data: Any) -> Any:
        wf.set_event("stage", "waiting for payment")
        paid = wf.wait_for_event("paid")
        wf.set_event("stage", "paid")
        shipped = wf.wait_for_event("shipped", timeout=data.get("timeout") if data else None,
                                    default={"late": True})
        return wf.do("done", record, {"paid": paid, "shipped": shipped})

    @pikku.workflow()
    def collect(wf: Any, data: Any) -> Any:
        return [wf.wait_for_event("item") for _ in range(data["n"])]

    yield pikku


@pytest.fixture
def kit(pikku: PikkuCelery) -> Iterator[InlineKit]:
    with inline(pikku, hold_timers=True) as kit:
        yield kit


def test_a_run_waits_suspended_and_takes_the_events_it_waits_for(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    run_id = pikku.start("checkout", None)
    assert pikku.get_run(run_id).status == "suspended"
    assert pikku.get_event(run_id, "stage") == "waiting for payment"
    pikku.send_event(run_id, "shipped", {"carrier": "ups"})  # kept until its wait
    assert pikku.get_run(run_id).status == "suspended"  # still waiting for "paid"
    pikku.send_event(run_id, "paid", {"amount": 12})
    run = pikku.get_run(run_id)
    assert run.status == "completed"
    assert run.output == {"paid": {"amount": 12}, "shipped": {"carrier": "ups"}}
    assert pikku.get_event(run_id, "stage") == "paid"  # the latest value set
    assert [(e.name, e.seq) for e in pikku.list_events(run_id)] == [("shipped", 1),
                                                                   ("paid", 2)]


def test_events_sent_before_the_waits_are_taken_in_the_order_sent(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    run_id = pikku.start("collect", {"n": 3})
    for item in ("a", "b"):
        pikku.send_event(run_id, "item", item)
    assert pikku.get_run(run_id).status == "suspended"
    pikku.send_event(run_id, "item", "c")
    assert pikku.get_run(run_id).output == ["a", "b", "c"]


def test_a_key_makes_a_send_idempotent(pikku: PikkuCelery, kit: InlineKit) -> None:
    run_id = pikku.start("collect", {"n": 2})
    first = pikku.send_event(run_id, "item", "a", key="k-1")
    again = pikku.send_event(run_id, "item", "a (retried)", key="k-1")
    assert again == first and again.payload == "a"
    assert pikku.get_run(run_id).status == "suspended"  # delivered once: one more to go
    pikku.send_event(run_id, "item", "b", key="k-2")
    assert pikku.get_run(run_id).output == ["a", "b"]
    assert len(pikku.list_events(run_id)) == 2


def test_a_wait_times_out_with_its_default(pikku: PikkuCelery, kit: InlineKit) -> None:
    run_id = pikku.start("checkout", {"timeout": "1h"})
    pikku.send_event(run_id, "paid", 5)
    assert pikku.get_run(run_id).status == "suspended"
    kit.advance("59m")
    assert pikku.get_run(run_id).status == "suspended"
    kit.advance("2m")
    run = pikku.get_run(run_id)
    assert run.status == "completed", run
    assert run.output == {"paid": 5, "shipped": {"late": True}}
    with pytest.raises(WorkflowEventError, match=r"the run has ended \(completed\)"):
        pikku.send_event(run_id, "shipped", {"carrier": "ups"})


def test_an_unknown_or_ended_run_refuses_a_send_and_keeps_nothing(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    with pytest.raises(WorkflowRunNotFoundError):
        pikku.send_event("no-such-run", "paid", 1)
    run_id = pikku.start("collect", {"n": 1})
    pikku.cancel(run_id, "changed my mind")
    with pytest.raises(WorkflowEventError, match=r"event 'item' for run .* refused: the run "
                                                 r"has ended \(cancelled\)"):
        pikku.send_event(run_id, "item", 1)
    assert pikku.list_events(run_id) == []


@pytest.mark.parametrize(("name", "payload", "key", "message"), [
    ("a#2", None, None, r"event name 'a#2' is not allowed \(no '#'\)"),
    ("$x", None, None, r"event name '\$x' is not allowed"),
    ("ok", {1: "x"}, None, r"payload of event 'ok'"),
    ("ok", None, "", r"event key must be 1 to"),
])
def test_a_bad_send_is_refused_with_what_was_wrong(
        pikku: PikkuCelery, kit: InlineKit, name: str, payload: Any, key: str | None,
        message: str) -> None:
    run_id = pikku.start("collect", {"n": 1})
    with pytest.raises(InvalidInputError, match=message):
        pikku.send_event(run_id, name, payload, key=key)
    assert pikku.list_events(run_id) == []
    assert pikku.get_run(run_id).status == "suspended"


def test_a_send_whose_sender_stopped_before_its_wake_is_woken_by_the_reaper(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    run_id = pikku.start("collect", {"n": 1})
    engine = pikku.engine
    now = engine.now_ms()
    # The sender's first write, and nothing after it: no wake, the check left on the event.
    engine.store.send_event(run_id, "item", "lost", now,
                            wake_check_ms=engine.settings.wake_check_ms(now))
    pikku.reap()
    assert pikku.get_run(run_id).status == "suspended"  # the check is not due yet
    kit.advance(engine.settings.stalled_after_ms / 1000 + 1)
    pikku.reap()
    assert pikku.get_run(run_id).output == ["lost"]
    assert engine.store.find_event_wakes(engine.now_ms(), 10) == []
