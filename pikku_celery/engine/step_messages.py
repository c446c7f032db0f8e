"""How a step a pass recorded leaves it: a message, a timer, or nothing (a child run's
step, a gate), each sent through the pass's guard (``_guard``)."""

from __future__ import annotations

from pikku_celery.engine._guard import guarded
from pikku_celery.engine.protocols import Dispatcher
from pikku_celery.store._claim_hint import hint_of
from pikku_celery.store._docs import new_step_doc
from pikku_celery.store.base import NewStep


def send_recorded(dispatcher: Dispatcher, step: NewStep, recorded_ms: int, seq: int) -> None:
    """Send ``step``, inserted at ``recorded_ms`` by the pass holding run-lease token
    ``seq``. Its message carries the step as recorded when the dispatcher can carry it,
    so its first claim needs no read (``store._claim_hint``)."""
    if step.child_run_id is not None or (step.function is None and step.due_ms is None):
        return  # parked on a child run, or a gate: nothing to send
    if step.function is None:
        due_ms = step.due_ms
        assert due_ms is not None
        guarded(lambda: dispatcher.arm_timer(step.run_id, step.step_name, due_ms))
        return
    function = step.function
    hint = (hint_of(new_step_doc(step, recorded_ms, seq))
            if getattr(dispatcher, "carries_claims", False) else None)
    if hint is None:
        guarded(lambda: dispatcher.dispatch_step(function, step.run_id, step.step_name))
    else:
        guarded(lambda: dispatcher.dispatch_step(  # type: ignore[call-arg]
            function, step.run_id, step.step_name, expected=hint))
