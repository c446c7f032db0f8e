"""The types the decorators give back, so an editor follows a step through ``wf.do``.

``@pikku.step()`` on ``def charge(order: Order) -> Receipt`` gives a ``Step[[Order],
Receipt]``: ``wf.do("charge", charge, order)`` is a ``Receipt`` and a wrong ``order`` is a
type error. A bound step (``bind=True``, ``def charge(ctx, order)``) is a ``Step`` of both
parameters; ``wf.do`` passes the context itself and checks the data against the second.
``@pikku.workflow()`` gives the function back, typed as a ``Workflow`` of its own
parameters and result, with its ``pikku_workflow`` definition.

At runtime a step is a Celery task (or, from ``shared_step``, a ``SharedStep``): these are
protocols, describing what is there, so nothing is wrapped. A step task is not called like
its function (pikku sends it ``(run_id, step_name)``; a direct call is refused with an
explanation), so ``Step`` declares no ``__call__``: ``charge(order)`` is a type error too.
Its function is ``charge.pikku_step.fn``, typed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

from pikku_celery.workflow.definitions import StepDefinition, WorkflowDefinition

if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult

P = ParamSpec("P")  # a step's or a workflow's parameters
R = TypeVar("R")  # its result
R_co = TypeVar("R_co", covariant=True)


class HasStep(Protocol[P, R]):
    """What ``wf.do`` needs of a step: its definition, typed by the step's function."""

    @property
    def pikku_step(self) -> StepDefinition[P, R]: ...


class Step(HasStep[P, R], Protocol[P, R]):
    """What ``@pikku.step()`` returns: the step's Celery task, typed by its function
    (``P``: its parameters, ``R``: its result). ``delay`` and ``apply_async`` are
    Celery's, and take pikku's arguments only (``(run_id, step_name)``)."""

    @property
    def name(self) -> str: ...

    @property
    def app(self) -> Celery: ...

    def delay(self, *args: Any, **kwargs: Any) -> AsyncResult: ...

    def apply_async(self, args: Any = None, kwargs: Any = None, *rest: Any,
                    **options: Any) -> AsyncResult: ...

    def s(self, *args: Any, **kwargs: Any) -> Any: ...

    def si(self, *args: Any, **kwargs: Any) -> Any: ...

    def signature(self, *args: Any, **kwargs: Any) -> Any: ...


class Workflow(Protocol[P, R_co]):
    """What ``@pikku.workflow()`` returns: the function itself, called as before, with its
    definition attached (``pikku_workflow``)."""

    @property
    def pikku_workflow(self) -> WorkflowDefinition: ...

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...


__all__ = ["HasStep", "P", "R", "Step", "Workflow"]
