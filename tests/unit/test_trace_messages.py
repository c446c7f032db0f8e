"""A run's trace context travels in pikku's messages (``observe/trace_messages.py``): a
message whose first argument is a run this process knows gets the ``pikku_trace`` header,
and the task that runs it finds the context there, not in a store read; a header for
another run, a forged one, or none, gives nothing."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from pikku_celery.observe import trace_messages as tm
from pikku_celery.observe import tracing

PARENT = {"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"}


def run_id() -> str:
    return f"tm-{uuid.uuid4().hex[:8]}"


def test_a_known_runs_message_is_stamped_and_no_other() -> None:
    known, unknown = run_id(), run_id()
    tm.know(known, PARENT, "order")
    headers: dict[str, Any] = {}
    tm.stamp(body=((known, "charge"), {}, {}), headers=headers)
    assert headers == {tm.HEADER: {"w3c": PARENT, "workflow": "order"}}
    for body in (((unknown,), {}, {}), ((), {}, {}), ((42,), {}, {}), None, "text"):
        untouched: dict[str, Any] = {}
        tm.stamp(body=body, headers=untouched)
        assert untouched == {}, body
    tm.know(run_id(), None, "order")  # nothing saved with the run: nothing kept


def test_the_kept_runs_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tm, "KEPT", 3)
    ids = [run_id() for _ in range(5)]
    for each in ids:
        tm.know(each, PARENT, None)
    assert len(tm._known) == 3 and list(tm._known)[-3:] == ids[2:]


def test_the_task_finds_the_context_of_its_own_run_only() -> None:
    app = Celery(f"tm-{uuid.uuid4().hex[:6]}", broker="memory://")
    found: list[Any] = []

    @app.task(name="tm.step")
    def step(run: str, asked: str) -> None:
        found.append(tm.carried(asked))

    mine = run_id()
    header = {tm.HEADER: {"w3c": PARENT, "workflow": "order"}}
    step.apply(args=(mine, mine), headers=header)
    step.apply(args=(mine, "another-run"), headers=header)
    step.apply(args=(mine, mine), headers={tm.HEADER: {"w3c": {"traceparent": "forged"}}})
    step.apply(args=(mine, mine), headers={tm.HEADER: {"w3c": PARENT, "workflow": 7}})
    step.apply(args=(mine, mine))
    assert found == [(PARENT, "order"), None, None, None, None]
    assert tm.carried(mine) is None  # no task runs here


def test_a_worker_takes_the_context_from_the_message_not_from_the_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", TracerProvider())
    assert tracing._PROVIDER.tracer() is not None  # an SDK is configured
    reads: list[str] = []
    contexts = tracing._RunContexts(lambda run: reads.append(run))
    app = Celery(f"tm-{uuid.uuid4().hex[:6]}", broker="memory://")
    got: list[Any] = []

    @app.task(name="tm.orchestrate")
    def orchestrate(run: str) -> None:
        got.append(contexts.get(run))

    mine = run_id()
    orchestrate.apply(args=(mine,), headers={tm.HEADER: {"w3c": PARENT, "workflow": "order"}})
    (info,) = got
    assert reads == []
    assert (f"{info.context.trace_id:032x}", info.workflow) == ("a" * 32, "order")
    assert contexts.get(mine) is info  # kept: the next pass here asks nobody
    assert tm._known[mine] == {"w3c": PARENT, "workflow": "order"}  # and passed on


def test_a_task_passes_its_own_messages_context_on_to_the_messages_it_sends() -> None:
    """A task of a run that sends a message of that run without having learnt the run (no
    span of its own: a step delivered before its retry was due re-arms the timer and runs
    nothing) stamps it with the context its own message carried: the receiver of the timer
    would otherwise read the run from the store for it (seen under load in
    ``test_on_rabbitmq_steps_run_in_place_are_one_trace_per_run``)."""
    app = Celery(f"tm-{uuid.uuid4().hex[:6]}", broker="memory://")
    sent: list[dict[str, Any]] = []

    @app.task(name="tm.rearm")
    def rearm(run: str, step_name: str) -> None:
        headers: dict[str, Any] = {}
        tm.stamp(body=((run, step_name), {}, {}), headers=headers)
        sent.append(headers)
        other: dict[str, Any] = {}
        tm.stamp(body=((run_id(), step_name), {}, {}), headers=other)  # another run: none
        sent.append(other)

    mine = run_id()
    rearm.apply(args=(mine, "flaky"), headers={tm.HEADER: {"w3c": PARENT, "workflow": "p"}})
    rearm.apply(args=(run_id(), "flaky"))  # a message without a context passes none on
    assert sent == [{tm.HEADER: {"w3c": PARENT, "workflow": "p"}}, {}, {}, {}]
    assert mine not in tm._known  # nothing learnt: only passed on
