"""Errors survive the round trips Celery puts them through (pickle, JSON) with their type,
attributes and message, so a superseded task is recorded as what it is."""

from __future__ import annotations

import pickle

import pytest
from celery.utils.serialization import get_pickleable_exception

from pikku_celery.model import errors

EXAMPLES = [
    errors.WorkflowStepSupersededError("run-1", "charge", 1, 2),
    errors.WorkflowStepLeaseExpiredError("run-1", "charge", 3),
    errors.WorkflowStepFunctionMismatchError("run-1", "charge", "a.b", "c.d"),
    errors.WorkflowNotFoundError("order"),
    errors.WorkflowRunNotFoundError("run-1"),
    errors.WorkflowStepNotFoundError("run-1", "ghost"),
    errors.WorkflowRunFailedError("step 'x' failed", {"type": "ValueError"}),
    errors.WorkflowCancelledError("run-1", "asked"),
    errors.LeaseTakenError("workflow-run:1"),
    errors.LeaseLostError("workflow-run:1"),
    errors.InvalidInputError("step name '$x' is not allowed"),
]


@pytest.mark.parametrize("exc", EXAMPLES, ids=lambda e: type(e).__name__)
def test_errors_survive_pickle_and_celerys_checks(exc: errors.PikkuError) -> None:
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and str(again) == str(exc) and again.args == exc.args
    assert get_pickleable_exception(exc) is exc  # Celery keeps it, no substitute type
    rebuilt = type(exc)(*exc.args)  # what Celery's JSON exception decoding does
    assert str(rebuilt) == str(exc) and vars(rebuilt) == vars(exc)


def test_the_superseded_error_names_run_step_and_both_attempts() -> None:
    text = str(errors.WorkflowStepSupersededError("run-1", "charge", 1, 2))
    assert "run-1" in text and "'charge'" in text and "attempt 1" in text and "2" in text
