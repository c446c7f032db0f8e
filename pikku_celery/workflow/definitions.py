"""Frozen definitions attached by the decorators, and the registry that holds them."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pikku_celery.model.durations import Duration, to_ms
from pikku_celery.model.errors import InvalidInputError, WorkflowNotFoundError
from pikku_celery.model.validate import check_concurrency, check_name
from pikku_celery.workflow.schedule_spec import ScheduleDefinition

DEFAULT_RETRIES = 3  # so 4 attempts: max attempts is always retries + 1
DEFAULT_RETRY_DELAY_MS = 1000  # the first retry's delay; doubled per attempt when not set
MAX_BACKOFF_MS = 300_000


def check_retries(retries: object, what: str) -> int:
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 1000:
        raise InvalidInputError(f"{what}: retries must be an int from 0 to 1000, "
                                f"got {retries!r}")
    return retries


@dataclass(frozen=True)
class StepDefinition:
    """A step: the Celery task name it runs as is its identity in the store."""

    name: str
    fn: Callable[..., Any]
    retries: int
    retry_delay_ms: int | None  # None: exponential from DEFAULT_RETRY_DELAY_MS
    lease_ms: int | None  # None: the app's step_lease
    bind: bool
    no_retry_for: tuple[type[BaseException], ...] = ()  # errors that fail the step at once
    # The body's MongoDB writes (``ctx.session``) commit with its settle (``transactional``)
    transactional: bool = False

    def delay_before(self, next_attempt: int, override_ms: int | None = None) -> int:
        """The wait before ``next_attempt`` (2, 3, ...): fixed if set, else exponential."""
        fixed = override_ms if override_ms is not None else self.retry_delay_ms
        if fixed is not None:
            return fixed
        backoff: int = DEFAULT_RETRY_DELAY_MS * 2 ** max(0, next_attempt - 2)
        return min(backoff, MAX_BACKOFF_MS)


def make_step(fn: Callable[..., Any], name: str, *, retries: int, retry_delay: Duration | None,
              lease: Duration | None, bind: bool,
              no_retry_for: tuple[type[BaseException], ...] = (),
              transactional: bool = False) -> StepDefinition:
    check_name("step function name", name)
    if transactional is not False and transactional is not True:
        raise InvalidInputError(f"step {name!r}: transactional must be True or False, got "
                                f"{transactional!r}")
    if transactional and not bind:
        raise InvalidInputError(f"step {name!r}: transactional=True needs bind=True (the "
                                "body writes with ctx.session)")
    if not all(isinstance(t, type) and issubclass(t, BaseException) for t in no_retry_for):
        raise InvalidInputError(f"step {name!r}: no_retry_for must be exception classes, "
                                f"got {no_retry_for!r}")
    return StepDefinition(
        name=name, fn=fn, retries=check_retries(retries, f"step {name!r}"),
        retry_delay_ms=None if retry_delay is None else to_ms(retry_delay, what="retry_delay"),
        lease_ms=None if lease is None else _positive_ms(lease, "lease"), bind=bind,
        no_retry_for=tuple(no_retry_for), transactional=transactional)


def _positive_ms(value: Duration, what: str) -> int:
    ms = to_ms(value, what=what)
    if ms <= 0:
        raise ValueError(f"invalid {what}: {value!r} (must be greater than zero)")
    return ms


@dataclass(frozen=True)
class WorkflowDefinition:
    name: str
    fn: Callable[..., Any]
    version: str
    source: str
    # At most ``concurrency`` runs at once per ``concurrency_key(input)`` (``None``: one key
    # for every run); ``None``: no limit (``pikku_celery.engine.concurrency``).
    concurrency: int | None = None
    concurrency_key: Callable[[Any], Any] | None = None


def make_workflow(fn: Callable[..., Any], name: str, *, source: str | None = None,
                  concurrency: int | None = None,
                  concurrency_key: Callable[[Any], Any] | None = None) -> WorkflowDefinition:
    """``source`` (default: the function's source) is what the version hash is taken of."""
    check_name("workflow name", name)
    if concurrency is not None:
        check_concurrency(f"workflow {name!r}: concurrency", concurrency)
    if concurrency_key is not None and (concurrency is None or not callable(concurrency_key)):
        raise InvalidInputError(
            f"workflow {name!r}: concurrency_key must be a callable of the run's input, "
            f"and needs concurrency=N, got {concurrency_key!r} with concurrency="
            f"{concurrency!r}")
    if source is None:
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            source = f"{fn.__module__}.{fn.__qualname__}"
    version = hashlib.sha256(source.encode()).hexdigest()[:16]
    return WorkflowDefinition(name=name, fn=fn, version=version, source=source,
                              concurrency=concurrency, concurrency_key=concurrency_key)


class Registry:
    """Steps by task name, workflows and schedules by name, for one ``PikkuCelery``
    instance."""

    def __init__(self) -> None:
        self.steps: dict[str, StepDefinition] = {}
        self.workflows: dict[str, WorkflowDefinition] = {}
        self.schedules: dict[str, ScheduleDefinition] = {}

    def add_step(self, step: StepDefinition) -> None:
        self.steps[step.name] = step

    def add_workflow(self, workflow: WorkflowDefinition) -> None:
        if workflow.name in self.workflows and self.workflows[workflow.name].fn is not workflow.fn:
            raise InvalidInputError(f"a workflow named {workflow.name!r} is already registered")
        self.workflows[workflow.name] = workflow

    def add_schedule(self, schedule: ScheduleDefinition) -> None:
        """Register a schedule; the same declaration again (a module imported twice) is
        fine, another definition under a name already used is refused."""
        known = self.schedules.get(schedule.name)
        if known is not None and known != schedule:
            raise InvalidInputError(f"a schedule named {schedule.name!r} is already "
                                    f"registered with another definition ({known})")
        self.schedules[schedule.name] = schedule

    def concurrency_of(self, workflow: str) -> int | None:
        """The concurrency limit of ``workflow``: ``None`` for a workflow without one, or
        one this process does not know (its own workers admit its runs)."""
        found = self.workflows.get(workflow)
        return None if found is None else found.concurrency

    def workflow(self, name_or_fn: str | Callable[..., Any] | WorkflowDefinition
                 ) -> WorkflowDefinition:
        if isinstance(name_or_fn, WorkflowDefinition):
            return name_or_fn
        attached = getattr(name_or_fn, "pikku_workflow", None)
        if isinstance(attached, WorkflowDefinition):
            return attached
        name = name_or_fn if isinstance(name_or_fn, str) else getattr(
            name_or_fn, "__name__", repr(name_or_fn))
        found = self.workflows.get(name)
        if found is None:
            raise WorkflowNotFoundError(name, sorted(self.workflows))
        return found
