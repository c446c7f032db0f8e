"""Inline runs: orchestrate and execute a run in the caller's process.

Every pass still holds the run lease and every step still goes through the claim layer, so
an inline run is fenced exactly like a run on workers; it just pays no broker hops. Useful
for tests, scripts, and a web request that must return the outcome.
"""

from __future__ import annotations

import collections
import heapq
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.records import RUN_QUEUED, RUN_SUSPENDED, WorkflowRun

if TYPE_CHECKING:
    from pikku_celery.engine.facade import Engine


class InlineDispatcher:
    """Collects the work a pass or a step asks for, instead of sending messages."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.queue: collections.deque[tuple[str, str, str]] = collections.deque()
        self.timers: list[tuple[int, str, str]] = []

    def dispatch_step(self, function: str, run_id: str, step_name: str) -> None:
        self.queue.append(("step", function, f"{run_id}\x00{step_name}"))

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        # A queued pass reads what its step name says (all unsettled steps for ""); one
        # queued pass per run, reading everything when two wakes name different steps.
        hint = step_name or ""
        if countdown_s > 0:
            heapq.heappush(self.timers, (self._engine.now_ms() + int(countdown_s * 1000),
                                         "run", run_id))
            return
        queued = [item for item in self.queue if item[0] == "run" and item[2] == run_id]
        if not queued:
            self.queue.append(("run", hint, run_id))
        elif queued[0][1] != hint and queued[0][1] != "":
            self.queue[self.queue.index(queued[0])] = ("run", "", run_id)

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        heapq.heappush(self.timers, (due_ms, "timer", f"{run_id}\x00{step_name}"))

    def do_next(self) -> bool:
        """Do the next piece of work: a queued item, else the earliest timer once it is due
        on the engine's clock (a virtual clock jumps to it). ``False`` when there is none."""
        if self.queue:
            _do(self._engine, self, self.queue.popleft())
            return True
        if not self.timers:
            return False
        self._fire(heapq.heappop(self.timers))
        return True

    def _fire(self, timer: tuple[int, str, str]) -> None:
        due_ms, kind, target = timer
        self._engine.clock.sleep_until(due_ms)
        if kind == "run":
            self.wake_run(target)
        else:
            timer_run, timer_step = target.split("\x00")
            self._engine.fire_timer(timer_run, timer_step, dispatcher=self)


class DrivingDispatcher(InlineDispatcher):
    """Does the work as soon as it is asked for, in the asking thread, until nothing is left:
    every started run goes to its end (or to a suspension) before ``start`` returns (the test
    kit's dispatcher; its virtual clock makes every timer due at once).

    While ``holds_timers()`` is true, a timer is done only once it is due on the engine's
    clock (the clock never jumps to it): the runs stop at their sleeps, retry delays and
    expiring gates until the clock is moved forward and ``drain`` is called again.

    Work asked for while this dispatcher is already working (a pass dispatching steps, a
    step waking its run) is queued and done by the loop that is running, never nested. A
    thread that finds another thread working leaves its work to it; the worker looks again
    after letting go, so nothing queued is stranded."""

    def __init__(self, engine: Engine, *,
                 holds_timers: Callable[[], bool] | None = None) -> None:
        super().__init__(engine)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._holds_timers = holds_timers or (lambda: False)

    def do_next(self) -> bool:
        if self.queue or not self.timers or not self._holds_timers():
            return super().do_next()
        timer = heapq.heappop(self.timers)
        if timer[0] > self._engine.now_ms():  # held, and not due yet
            heapq.heappush(self.timers, timer)
            return False
        self._fire(timer)
        return True

    def has_work(self) -> bool:
        """Whether ``drain`` has something to do now: queued work, or a timer it may fire
        (any timer, unless timers are held: then a due one)."""
        return bool(self.queue) or (bool(self.timers) and self._timer_may_fire())

    @property
    def working_here(self) -> bool:
        """Whether this thread is inside this dispatcher's loop (a step body, a pass)."""
        return bool(getattr(self._local, "working", False))

    def _timer_may_fire(self) -> bool:
        timers = self.timers
        return bool(timers) and (not self._holds_timers()
                                 or timers[0][0] <= self._engine.now_ms())

    def dispatch_step(self, function: str, run_id: str, step_name: str) -> None:
        super().dispatch_step(function, run_id, step_name)
        self.drain()

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        super().wake_run(run_id, countdown_s, step_name)
        self.drain()

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        super().arm_timer(run_id, step_name, due_ms)
        self.drain()

    def drain(self) -> None:
        while not getattr(self._local, "working", False) and self._lock.acquire(blocking=False):
            self._local.working = True
            try:
                while self.do_next():
                    pass
            finally:
                self._local.working = False
                self._lock.release()
            if not self.has_work():
                return


def run_inline(engine: Engine, run_id: str, *, poll_s: float = 0.05) -> WorkflowRun:
    """Drive ``run_id`` (and any child runs) in this process until it ends, is suspended, or
    waits ``queued`` for a slot of its concurrency limit (another run's end admits it)."""
    dispatcher = InlineDispatcher(engine)
    dispatcher.wake_run(run_id)
    while True:
        run = engine.get_run(run_id)
        if run.is_terminal or (run.status in (RUN_SUSPENDED, RUN_QUEUED)
                               and not dispatcher.queue):
            return run
        if not dispatcher.do_next():
            # Something else holds the work (a worker, another process): look again soon.
            time.sleep(poll_s)
            dispatcher.wake_run(run_id)


def _do(engine: Engine, dispatcher: InlineDispatcher, item: tuple[str, str, str]) -> None:
    kind, function, target = item
    if kind == "run":  # ``function`` holds the pass's step name, if any
        engine.advance(target, dispatcher, step_name=function or None)
        return
    run_id, step_name = target.split("\x00")
    definition = engine.registry.steps.get(function)
    if definition is None:
        raise InvalidInputError(f"step function {function!r} is not registered here")
    engine.execute_step(definition, run_id, step_name, dispatcher)
