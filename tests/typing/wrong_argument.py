"""Each line with an "expected error" comment must be reported by both checkers
(``tests/unit/test_typing.py``): if the types of steps degraded to ``Any``, none would."""

from __future__ import annotations

from celery import Celery

from pikku_celery import PikkuCelery, StepContext, WorkflowContext

pikku = PikkuCelery(Celery("typing"))


@pikku.step()
def charge(amount: int) -> int:
    return amount


@pikku.step(bind=True)
def refund(ctx: StepContext, amount: int) -> int:
    return amount


@pikku.workflow()
def checkout(wf: WorkflowContext, amount: int) -> str:
    wf.do("charge", charge, "forty-two")  # expected error: not an int
    wf.do("refund", refund, "forty-two")  # expected error: not an int
    total: str = wf.do("charge", charge, amount)  # expected error: an int, not a str
    charge(amount)  # expected error: a step is not called like its function
    return total
