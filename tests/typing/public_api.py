"""The public API as an editor sees it (issue 36, item 4): checked by ``mypy --strict`` and
``pyright`` (``tests/unit/test_typing.py``), never run. A decorated step keeps its
function's types through ``wf.do``; a workflow stays its function. (Parameters are
positional-only here so that ``assert_type`` can spell the exact types.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict, assert_type

from celery import Celery

from pikku_celery import (
    PikkuCelery,
    Step,
    StepContext,
    Workflow,
    WorkflowContext,
    shared_step,
    shared_workflow,
)
from pikku_celery.worker.shared import SharedStep
from pikku_celery.workflow.definitions import StepDefinition, WorkflowDefinition

app = Celery("typing")
pikku = PikkuCelery(app)


class Order(TypedDict):
    id: str
    amount: int


@pikku.step(autoretry_for=(ConnectionError,), retry_backoff=True)
def reserve(order: Order, /) -> str:
    return f"r-{order['id']}"


@pikku.step(bind=True, max_retries=2, retry_delay="2s")
def charge(ctx: StepContext, order: Order, /) -> dict[str, int]:
    return {"charged": order["amount"]}


@pikku.step()
def ping(_: None) -> int:
    return 1


@shared_step(retries=1)
def notify(order: Order, /) -> bool:
    return True


@pikku.workflow()
def checkout(wf: WorkflowContext, order: Order, /) -> dict[str, Any]:
    assert_type(wf.do("reserve", reserve, order), str)
    assert_type(wf.do("charge", charge, order, retries=0), dict[str, int])
    assert_type(wf.do("ping", ping), int)
    assert_type(wf.do("notify", notify, order), bool)
    assert_type(wf.do("by name", "proj.reserve", order), Any)
    return {"reservation": wf.do("reserve", reserve, order)}


@shared_workflow()
def shipping(wf: WorkflowContext, order: Order, /) -> None:
    wf.do("notify", notify, order)


assert_type(reserve, Step[[Order], str])
assert_type(charge, Step[[StepContext, Order], dict[str, int]])
assert_type(notify, SharedStep[[Order], bool])
assert_type(reserve.pikku_step, StepDefinition[[Order], str])
assert_type(reserve.pikku_step.fn, Callable[[Order], str])
assert_type(reserve.name, str)
assert_type(checkout, Workflow[[WorkflowContext, Order], dict[str, Any]])
assert_type(checkout.pikku_workflow, WorkflowDefinition)
assert_type(shipping, Workflow[[WorkflowContext, Order], None])
assert_type(pikku.start(checkout, {"id": "o-1", "amount": 42}), str)
