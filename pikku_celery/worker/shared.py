"""Steps, workflows and schedules declared without an instance, like Celery's
``shared_task``.

A reusable Django app (or any library), or a Flask app whose factory builds the
``PikkuCelery``, cannot import the project's instance: it does not know where the project
builds it, and importing it would tie the app to one project. ``shared_step``,
``shared_workflow`` and ``shared_schedule`` bind to every ``PikkuCelery`` of the process,
those created before the declaration and those created after, the way Celery binds a shared
task to every app.

How: every instance registers here when it is built (``bind``), and every declaration is a
hook run once per instance, now for the existing ones and at creation for later ones. The
test kit uses the same hooks to reach every instance of the process for one test.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol

from celery import current_app

from pikku_celery.model.durations import Duration
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.workflow.declare import attach_workflow
from pikku_celery.workflow.definitions import (
    StepDefinition,
    WorkflowDefinition,
    make_step,
    make_workflow,
)
from pikku_celery.workflow.retry import Errors
from pikku_celery.workflow.schedule_spec import ScheduleDefinition, make_schedule
from pikku_celery.workflow.typed import P, R, Workflow

if TYPE_CHECKING:
    from celery import Task


class Instance(Protocol):
    """What a declaration needs of a ``PikkuCelery`` (this module is below ``app``: the
    instances register here, it never imports them)."""

    def add_step(self, definition: StepDefinition, task_options: dict[str, Any]) -> Any: ...

    def add_workflow(self, definition: WorkflowDefinition) -> None: ...

    def schedule(self, name: str, workflow: str | Callable[..., Any], *,
                 cron: str | None = None, every: Duration | None = None, data: Any = None,
                 tz: str = "UTC", catch_up: str = "latest") -> ScheduleDefinition: ...


Hook = Callable[[Any], None]  # given each ``PikkuCelery``

_lock = threading.RLock()
_instances: weakref.WeakSet[Instance] = weakref.WeakSet()
_hooks: list[Hook] = []
_shared_workflows: dict[str, Callable[..., Any]] = {}
_shared_schedules: dict[str, ScheduleDefinition] = {}


def bind(pikku: Instance) -> None:
    """Register a new instance and run every hook on it (called by ``PikkuCelery``)."""
    with _lock:
        _instances.add(pikku)
        hooks = list(_hooks)
    for hook in hooks:
        hook(pikku)


def on_every_instance(hook: Hook) -> Callable[[], None]:
    """Run ``hook`` on every instance, existing and future; returns a function that stops
    it for future instances. A hook that raises on an existing instance is not kept."""
    with _lock:
        existing = list(_instances)
        _hooks.append(hook)

    def remove() -> None:
        with _lock:
            if hook in _hooks:
                _hooks.remove(hook)
    try:
        for pikku in existing:
            hook(pikku)
    except BaseException:
        remove()
        raise
    return remove


def instances() -> list[Instance]:
    """Every live ``PikkuCelery`` of the process."""
    with _lock:
        return list(_instances)


class SharedStep(Generic[P, R]):
    """What ``shared_step`` returns: the step's definition (``pikku_step``, all that
    ``wf.do`` needs, typed by the step's function), and for anything else the step task of
    Celery's current app, as ``shared_task``'s proxy does (``my_step.name``,
    ``my_step.pikku_step.fn``)."""

    def __init__(self, definition: StepDefinition[P, R]) -> None:
        self.pikku_step: StepDefinition[P, R] = definition
        self.name = definition.name
        functools.update_wrapper(self, definition.fn)

    def task(self, app: Any = None) -> Task:
        """The step's Celery task on ``app`` (default: Celery's current app)."""
        return (app or current_app).tasks[self.name]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.task()(*args, **kwargs)

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return getattr(self.task(), attribute)

    def __repr__(self) -> str:
        return f"<shared pikku step {self.name}>"


def shared_step(name: str | None = None, *, retries: int | None = None,
                max_retries: int | None = None, retry_delay: Duration | None = None,
                autoretry_for: Errors | None = None, no_retry_for: Errors = (),
                retry_backoff: bool | Duration | None = None,
                retry_backoff_max: Duration | None = None, retry_jitter: bool | None = None,
                lease: Duration | None = None, bind: bool = False,
                **task_options: Any) -> Callable[[Callable[P, R]], SharedStep[P, R]]:
    """``@pikku.step`` for code that has no instance: the step is registered on every
    ``PikkuCelery`` of the process, created before or after. Same arguments (one attempt
    unless it asks for more; what it leaves out, each app's ``pikku_step_*`` settings
    decide); the task name defaults to ``<module>.<function name>`` (set ``name`` for a
    module run as ``__main__``)."""
    def decorate(fn: Callable[P, R]) -> SharedStep[P, R]:
        definition = make_step(
            fn, name or f"{fn.__module__}.{fn.__name__}", retries=retries,
            max_retries=max_retries, retry_delay=retry_delay, autoretry_for=autoretry_for,
            no_retry_for=no_retry_for, retry_backoff=retry_backoff,
            retry_backoff_max=retry_backoff_max, retry_jitter=retry_jitter, lease=lease,
            bind=bind)
        on_every_instance(lambda pikku: pikku.add_step(definition, task_options))
        return SharedStep(definition)
    return decorate


def shared_workflow(name: str | None = None
                    ) -> Callable[[Callable[P, R]], Workflow[P, R]]:
    """``@pikku.workflow`` for code that has no instance: registered on every
    ``PikkuCelery`` of the process, created before or after."""
    def decorate(fn: Callable[P, R]) -> Workflow[P, R]:
        definition = make_workflow(fn, name or fn.__name__)
        with _lock:  # refused here, not in every instance created later
            taken = _shared_workflows.get(definition.name)
            if taken is not None and taken is not fn:
                raise InvalidInputError(
                    f"a shared workflow named {definition.name!r} is already declared (by "
                    f"{taken.__module__}.{taken.__qualname__})")
            _shared_workflows[definition.name] = fn
        try:
            on_every_instance(lambda pikku: pikku.add_workflow(definition))
        except BaseException:
            with _lock:
                _shared_workflows.pop(definition.name, None)
            raise
        return attach_workflow(fn, definition)
    return decorate


def shared_schedule(name: str, workflow: str | Callable[..., Any], *,
                    cron: str | None = None, every: Duration | None = None, data: Any = None,
                    tz: str = "UTC", catch_up: str = "latest") -> ScheduleDefinition:
    """``pikku.schedule`` for code that has no instance (a Flask app whose factory builds
    the ``PikkuCelery``): the schedule is declared on every ``PikkuCelery`` of the process,
    created before or after. Same arguments. Its workflow must be a shared one
    (``shared_workflow``, declared before the schedule), which every instance knows. Checked
    here: ``InvalidInputError`` for what ``pikku.schedule`` refuses, and for a name another
    shared schedule declares with another definition."""
    named = workflow if isinstance(workflow, str) else str(
        getattr(getattr(workflow, "pikku_workflow", None), "name", None)
        or getattr(workflow, "__name__", repr(workflow)))
    definition = make_schedule(name, named, cron=cron, every=every, data=data, tz=tz,
                               catch_up=catch_up)
    with _lock:
        known = named in _shared_workflows
    if not known:
        raise InvalidInputError(
            f"shared schedule {name!r}: no shared workflow named {named!r} is declared "
            "(declare it with shared_workflow before its schedule; a workflow of one "
            "PikkuCelery takes pikku.schedule)")
    with _lock:  # refused here, not in every instance created later
        taken = _shared_schedules.get(definition.name)
        if taken is not None and taken != definition:
            raise InvalidInputError(f"a shared schedule named {definition.name!r} is "
                                    f"already declared with another definition ({taken})")
        _shared_schedules[definition.name] = definition

    def declare(pikku: Any) -> None:
        pikku.schedule(name, named, cron=cron, every=every, data=data, tz=tz,
                       catch_up=catch_up)
    try:
        on_every_instance(declare)
    except BaseException:
        with _lock:
            if taken is None:
                _shared_schedules.pop(definition.name, None)
        raise
    return definition


__all__ = ["SharedStep", "shared_schedule", "shared_step", "shared_workflow"]
