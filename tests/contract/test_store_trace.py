"""A run's trace context (``WorkflowRun.trace``, issue 33) on every store: written with the
insert that creates the run, read back as it was, kept by a retry; a malformed one is
refused by name before anything is written, and a run without one stores no field."""

from __future__ import annotations

import uuid

import pytest

from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.records import RUN_FAILED, RUN_RUNNING
from pikku_celery.model.trace_context import MAX_TRACESTATE
from pikku_celery.store.base import NewRun, WorkflowStore
from tests.contract.test_store import T0, store

__all__ = ["store"]  # the fixture, parametrized over every store

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_runs_trace_context_round_trips_and_a_retry_keeps_it(store: WorkflowStore) -> None:
    run_id = str(uuid.uuid4())
    trace = {"traceparent": PARENT, "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"}
    created, fresh = store.create_run(NewRun(run_id=run_id, workflow="order", input=1,
                                             trace=trace), T0)
    assert fresh and created.trace == trace
    assert store.get_run(run_id).trace == trace  # type: ignore[union-attr]
    # A repeated create returns the stored run, its context untouched by the new one.
    again, fresh = store.create_run(NewRun(run_id=run_id, workflow="order", input=1,
                                           trace={"traceparent": PARENT.replace("01", "00")}),
                                    T0 + 1)
    assert not fresh and again.trace == trace
    assert store.read_run(run_id, input=False).run.trace == trace  # type: ignore[union-attr]
    assert store.transition_run(run_id, (RUN_RUNNING,), RUN_FAILED, T0 + 2,
                                error={"type": "E", "message": "m"})
    assert store.retry_run(run_id, T0 + 3) is not None
    assert store.get_run(run_id).trace == trace  # type: ignore[union-attr]


def test_a_run_created_without_tracing_has_no_trace(store: WorkflowStore) -> None:
    run_id = str(uuid.uuid4())
    run, _ = store.create_run(NewRun(run_id=run_id, workflow="order", input=1), T0)
    assert run.trace is None and store.get_run(run_id).trace is None  # type: ignore[union-attr]


@pytest.mark.parametrize(("trace", "named"), [
    ({"traceparent": "nope"}, "traceparent"),
    ({"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}, "all zeros"),
    ({"traceparent": "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
     "traceparent"),
    ({"tracestate": "a=b"}, "traceparent"),
    ({"traceparent": PARENT, "baggage": "x"}, "'baggage'"),
    ({"traceparent": PARENT, "tracestate": "a=" + "b" * MAX_TRACESTATE}, "tracestate"),
    ({"traceparent": PARENT, "tracestate": "a=b\nc"}, "tracestate"),
    ("00-x", "mapping"),
])
def test_a_malformed_trace_context_is_refused_by_name(store: WorkflowStore, trace: object,
                                                       named: str) -> None:
    run_id = str(uuid.uuid4())
    with pytest.raises(InvalidInputError, match=named):
        store.create_run(NewRun(run_id=run_id, workflow="order", input=1,
                                trace=trace), T0)  # type: ignore[arg-type]
    assert store.get_run(run_id) is None
