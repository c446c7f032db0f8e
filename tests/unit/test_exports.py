"""The public API is what ``pikku_celery`` exports: this test freezes it, so a name is added
or removed on purpose, never by accident."""

from __future__ import annotations

import pikku_celery

CONTRACT = {  # ../shared/design/contract.md section 1
    "PikkuCelery", "WorkflowContext", "MongoWorkflowStore", "InMemoryWorkflowStore",
    "RedisLeaseService", "InMemoryLeaseService", "WorkflowRun", "StepState", "StepAttempt",
    "PikkuError", "WorkflowStepSupersededError", "WorkflowStepLeaseExpiredError",
    "WorkflowStepFunctionMismatchError", "WorkflowNotFoundError", "WorkflowRunNotFoundError",
    "WorkflowRunFailedError", "WorkflowCancelledError", "LeaseTakenError", "LeaseLostError",
}
INTEGRATION = {"shared_step", "shared_workflow"}  # contract section 5
# Issue 36: what an unreachable service raises, to catch by name. Driver errors on purpose,
# not PikkuErrors: the engine fails a run on a PikkuError, while an outage only interrupts.
OUTAGES = {"MongoUnreachableError", "RedisUnreachableError"}
EXTRAS = {"InvalidInputError", "Lease", "LeaseService", "StepContext", "WorkflowReplayError",
          "WorkflowStepNotFoundError", "WorkflowStore", "WorkflowRunConflictError", "get_pikku",
          "hold_lease", "PikkuConfigurationError", "WorkflowApprovalError", "with_state",
          "WorkflowEvent", "WorkflowEventError",  # issue 26: events
          "WorkflowEventNotSentError",  # issue 31: a send that could not reach the store
          "WorkflowEventLimitError",  # issue 35: a run's limits on its events
          "WorkflowSchedule",  # issue 26: schedules
          "internal_task_names",  # issue 25: pikku's own task names, per app
          "Step", "Workflow",  # issue 36: what the decorators return, typed
          "QueuedReason",  # issue 36: why a queued run waits (pikku.why_queued)
          "shared_schedule",  # issue 36: a schedule declared without an instance (Flask)
          *OUTAGES}


def test_the_exported_names_are_exactly_the_public_api() -> None:
    assert set(pikku_celery.__all__) == CONTRACT | INTEGRATION | EXTRAS
    for name in pikku_celery.__all__:
        assert hasattr(pikku_celery, name), name


def test_every_error_derives_from_pikku_error() -> None:
    errors = [getattr(pikku_celery, n) for n in pikku_celery.__all__
              if n.endswith("Error") and n != "PikkuError" and n not in OUTAGES]
    assert errors and all(issubclass(e, pikku_celery.PikkuError) for e in errors)


def test_an_outage_is_the_drivers_own_error() -> None:
    """Code catching pymongo's or redis-py's connection errors keeps catching them."""
    import pymongo.errors
    import redis.exceptions

    assert issubclass(pikku_celery.MongoUnreachableError, pymongo.errors.ConnectionFailure)
    assert issubclass(pikku_celery.RedisUnreachableError, redis.exceptions.ConnectionError)


def test_the_read_api_of_pikku_celery() -> None:
    for method in ("step", "workflow", "graph", "start", "get_run", "get_steps", "get_history",
                   "wait", "cancel", "resume", "list_runs", "reap", "beat_schedule_entry",
                   "add_step", "add_workflow", "make_engine", "approve"):
        assert callable(getattr(pikku_celery.PikkuCelery, method)), method


def test_the_signals_are_frozen_too() -> None:
    from celery.utils.dispatch import Signal

    from pikku_celery import signals

    assert set(signals.__all__) == {"run_started", "run_finished", "step_attempt_started",
                                    "step_attempt_finished", "step_attempt_superseded"}
    assert all(isinstance(getattr(signals, name), Signal) for name in signals.__all__)


def test_the_test_kit_names() -> None:
    from pikku_celery import testing

    assert set(testing.__all__) == {"InlineKit", "VirtualClock", "inline",
                                    "inline_everywhere", "pikku_inline"}
    assert all(hasattr(testing, name) for name in testing.__all__)


def test_the_public_module_paths_survive_the_layout() -> None:
    """Issue 32 moved the modules into layer folders; the paths users have written keep
    working, and the moved signals are the very objects Celery-side code connects to."""
    import importlib

    from pikku_celery import backend, signals
    from pikku_celery.worker import backend as worker_backend
    from pikku_celery.worker import signals as worker_signals

    assert all(getattr(signals, n) is getattr(worker_signals, n) for n in signals.__all__)
    assert backend.PikkuResultBackend is worker_backend.PikkuResultBackend
    for path, name in [("pikku_celery.store.mongo", "MongoWorkflowStore"),
                       ("pikku_celery.store.memory", "InMemoryWorkflowStore"),
                       ("pikku_celery.leases", "RedisLeaseService"),
                       ("pikku_celery.contrib.flask", "PikkuFlask"),
                       ("pikku_celery.testing", "inline")]:
        assert hasattr(importlib.import_module(path), name), (path, name)
    for path in ("pikku_celery.contrib.django", "pikku_celery.dashboard.standalone"):
        importlib.import_module(path)


def test_the_top_level_holds_only_the_public_face_and_the_folders() -> None:
    from pathlib import Path

    top = Path(pikku_celery.__file__).parent
    assert sorted(p.name for p in top.glob("*.py")) == [
        "__init__.py", "app.py", "backend.py", "operations.py", "signals.py", "testing.py"]
    assert {p.name for p in top.iterdir() if (p / "__init__.py").exists()} == {
        "model", "store", "leases", "workflow", "engine", "worker", "schedules", "observe",
        "operate",
        "dashboard", "contrib"}
