"""Frozen definitions attached by the decorators, and the registry that holds them."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic

from pikku_celery.model.durations import Duration
from pikku_celery.model.errors import InvalidInputError, WorkflowNotFoundError
from pikku_celery.model.validate import check_concurrency, check_name
from pikku_celery.workflow.retry import (
    DEFAULT_RETRIES,
    NO_DEFAULTS,
    Errors,
    RetryPolicy,
    StepDefaults,
    check_retries,
    positive_ms,
    retry_policy,
)
from pikku_celery.workflow.schedule_spec import ScheduleDefinition

if TYPE_CHECKING:  # defaults (PEP 696): a bare ``StepDefinition`` is ``[..., Any]``
    from typing_extensions import ParamSpec, TypeVar

    P = ParamSpec("P", default=...)
    R = TypeVar("R", default=Any)
else:  # typing_extensions is not a dependency
    from typing import ParamSpec, TypeVar

    P = ParamSpec("P")
    R = TypeVar("R")

__all__ = ["DEFAULT_RETRIES", "P", "R", "Registry", "StepDefaults", "StepDefinition",
           "WorkflowDefinition", "check_retries", "make_step", "make_workflow"]


@dataclass(frozen=True)
class StepDefinition(Generic[P, R]):
    """A step: the Celery task name it runs as is its identity in the store."""

    name: str
    fn: Callable[P, R]
    lease_ms: int | None  # None: the app's step_lease
    bind: bool
    retry: RetryPolicy = field(default_factory=RetryPolicy)  # see ``workflow.retry``
    # The body's MongoDB writes (``ctx.session``) commit with its settle (``transactional``)
    transactional: bool = False

    @property
    def retries(self) -> int | None:
        """The step's own retries (``None``: it did not say; ``max_attempts`` decides)."""
        return self.retry.retries

    @property
    def no_retry_for(self) -> Errors:
        return self.retry.no_retry_for

    def max_attempts(self, defaults: StepDefaults = NO_DEFAULTS) -> int:
        return self.retry.max_attempts(defaults)

    def delay_before(self, next_attempt: int, override_ms: int | None = None,
                     defaults: StepDefaults = NO_DEFAULTS) -> int:
        """The wait before ``next_attempt`` (2, 3, ...): see ``RetryPolicy``."""
        return self.retry.delay_ms_before(next_attempt, override_ms, defaults)


def make_step(fn: Callable[P, R], name: str, *, retries: int | None = None,
              retry_delay: Duration | None = None, lease: Duration | None = None,
              bind: bool = False, no_retry_for: Errors = (), transactional: bool = False,
              max_retries: int | None = None, autoretry_for: Errors | None = None,
              retry_backoff: bool | Duration | None = None,
              retry_backoff_max: Duration | None = None,
              retry_jitter: bool | None = None) -> StepDefinition[P, R]:
    check_name("step function name", name)
    if transactional is not False and transactional is not True:
        raise InvalidInputError(f"step {name!r}: transactional must be True or False, got "
                                f"{transactional!r}")
    if transactional and not bind:
        raise InvalidInputError(f"step {name!r}: transactional=True needs bind=True (the "
                                "body writes with ctx.session)")
    policy = retry_policy(f"step {name!r}", retries=retries, max_retries=max_retries,
                          retry_delay=retry_delay, autoretry_for=autoretry_for,
                          no_retry_for=no_retry_for, retry_backoff=retry_backoff,
                          retry_backoff_max=retry_backoff_max, retry_jitter=retry_jitter)
    return StepDefinition(
        name=name, fn=fn, lease_ms=None if lease is None else positive_ms(lease, "lease"),
        bind=bind, retry=policy, transactional=transactional)


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

    def step(self, step: Any) -> StepDefinition:
        """The definition of ``step``: a definition, a decorated step, or a registered
        step's name; ``InvalidInputError`` for anything else."""
        if isinstance(step, StepDefinition):
            return step
        attached = getattr(step, "pikku_step", None)
        if isinstance(attached, StepDefinition):
            return attached
        if isinstance(step, str) and step in self.steps:
            return self.steps[step]
        raise InvalidInputError(f"{step!r} is not a pikku step: decorate it with @pikku.step")
