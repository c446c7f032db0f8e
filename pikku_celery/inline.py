"""Inline runs: orchestrate and execute a run in the caller's process.

Every pass still holds the run lease and every step still goes through the claim layer, so
an inline run is fenced exactly like a run on workers; it just pays no broker hops. Useful
for tests, scripts, and a web request that must return the outcome.
"""

from __future__ import annotations

import collections
import heapq
import time
from typing import TYPE_CHECKING

from pikku_celery.errors import InvalidInputError
from pikku_celery.records import RUN_SUSPENDED, WorkflowRun

if TYPE_CHECKING:
    from pikku_celery.engine import Engine


class InlineDispatcher:
    """Collects the work a pass or a step asks for, instead of sending messages."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.queue: collections.deque[tuple[str, str, str]] = collections.deque()
        self.timers: list[tuple[int, str, str]] = []

    def dispatch_step(self, function: str, run_id: str, step_name: str) -> None:
        self.queue.append(("step", function, f"{run_id}\x00{step_name}"))

    def wake_run(self, run_id: str, countdown_s: float = 0.0) -> None:
        if countdown_s > 0:
            heapq.heappush(self.timers, (self._engine.now_ms() + int(countdown_s * 1000),
                                         "run", run_id))
        elif ("run", "", run_id) not in self.queue:
            self.queue.append(("run", "", run_id))

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        heapq.heappush(self.timers, (due_ms, "timer", f"{run_id}\x00{step_name}"))


def run_inline(engine: Engine, run_id: str, *, poll_s: float = 0.05) -> WorkflowRun:
    """Drive ``run_id`` (and any child runs) in this process until it ends or is suspended."""
    dispatcher = InlineDispatcher(engine)
    dispatcher.wake_run(run_id)
    while True:
        run = engine.get_run(run_id)
        if run.is_terminal or (run.status == RUN_SUSPENDED and not dispatcher.queue):
            return run
        if dispatcher.queue:
            _do(engine, dispatcher, dispatcher.queue.popleft())
        elif dispatcher.timers:
            due_ms, kind, target = heapq.heappop(dispatcher.timers)
            time.sleep(max(0.0, (due_ms - engine.now_ms()) / 1000))
            if kind == "run":
                dispatcher.wake_run(target)
            else:
                timer_run, timer_step = target.split("\x00")
                engine.fire_timer(timer_run, timer_step, dispatcher=dispatcher)
        else:
            # Something else holds the work (a worker, another process): look again soon.
            time.sleep(poll_s)
            dispatcher.wake_run(run_id)


def _do(engine: Engine, dispatcher: InlineDispatcher, item: tuple[str, str, str]) -> None:
    kind, function, target = item
    if kind == "run":
        engine.advance(target, dispatcher)
        return
    run_id, step_name = target.split("\x00")
    definition = engine.registry.steps.get(function)
    if definition is None:
        raise InvalidInputError(f"step function {function!r} is not registered here")
    engine.execute_step(definition, run_id, step_name, dispatcher)
