"""A delivery of a step that already settled (``Engine.execute_step``'s not-claimed path):
a re-dispatch with a new task id gets the recorded outcome to report, the settling
delivery itself and a duplicate of a live or retrying step get nothing to report."""

from __future__ import annotations

from typing import Any

from pikku_celery import PikkuCelery
from pikku_celery.engine.outcomes import RecordedStepError
from pikku_celery.worker.inline import InlineDispatcher
from pikku_celery.worker.tasks import recorded_failure
from tests.unit.test_engine import pikku  # noqa: F401 (a fixture)


def test_only_a_new_task_id_of_a_settled_step_reports_its_outcome(
        pikku: PikkuCelery) -> None:  # noqa: F811
    double = pikku.step(name="settled.double")(lambda n: n * 2)
    refuse = pikku.step(name="settled.refuse", retries=0)(
        lambda n: (_ for _ in ()).throw(KeyError(n)))

    @pikku.workflow("settled.flow")
    def flow(wf: Any, n: int) -> Any:
        return wf.do("double", double, n), wf.do("refuse", refuse, n)

    engine = pikku.engine
    inline = InlineDispatcher(engine)
    engine.dispatcher = inline
    run_id = pikku.start(flow, 4)
    while inline.queue:  # run the steps with task ids, as a worker would
        kind, function, target = inline.queue.popleft()
        if kind == "run":
            engine.advance(target, inline, step_name=function or None)
        else:
            run, step = target.split("\x00")
            engine.execute_step(engine.registry.steps[function], run, step, inline,
                                task_id=f"owner-{step}")
    assert pikku.get_run(run_id).status == "failed"
    steps = engine.registry.steps
    again = engine.execute_step(steps["settled.double"], run_id, "double", task_id="dup-1")
    assert (again.kind, again.result, again.attempt) == ("settled", 8, 1)
    assert again.error is None
    own = engine.execute_step(steps["settled.double"], run_id, "double",
                              task_id="owner-double")
    assert own.kind == "not_claimed"  # its own task already reported: nothing to add
    failed = engine.execute_step(steps["settled.refuse"], run_id, "refuse", task_id="dup-2")
    assert failed.kind == "settled" and isinstance(failed.error, RecordedStepError)
    rebuilt = recorded_failure(failed.error.error)
    assert type(rebuilt) is KeyError and str(rebuilt) == str(KeyError(str(4)))
    custom = recorded_failure({"type": "CardDeclined", "message": "no funds"})
    assert type(custom).__name__ == "CardDeclined" and str(custom) == "no funds"
