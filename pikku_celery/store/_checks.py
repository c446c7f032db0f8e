"""Argument checks both stores make before any write, and the conflict a run id can meet.

Written once so the reference store and MongoDB refuse the same input with the same words
(``pikku_celery.model.validate`` holds the rules; this module says which apply to which call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pikku_celery.model.errors import WorkflowRunConflictError
from pikku_celery.model.validate import check_name, check_value
from pikku_celery.store.base import NewRun, NewStep


def check_new_run(run: NewRun) -> None:
    check_name("run id", run.run_id)
    check_name("workflow name", run.workflow)
    check_value("workflow input", run.input)


def check_new_steps(steps: Sequence[NewStep]) -> None:
    for step in steps:
        check_name("run id", step.run_id)
        check_name("step name", step.step_name)
        check_value(f"data of step {step.step_name!r}", step.data)


def check_run_end(run_id: str, output: Any, error: dict[str, Any] | None) -> None:
    check_name("run id", run_id)
    check_value("workflow output", output)
    check_value("workflow error", error)


def run_conflict(run: NewRun, owner: str) -> WorkflowRunConflictError:
    """The error of a ``create_run`` whose id is taken by a run of workflow ``owner``."""
    return WorkflowRunConflictError(
        run.run_id, f"it already belongs to workflow {owner!r}, not {run.workflow!r}")
