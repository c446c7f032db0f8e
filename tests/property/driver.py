"""An in-process driver that lets a test choose the order in which a run's messages land.

A pass or a settled step asks its dispatcher for work (a step message, a wake of the run, a
retry timer); here every such message waits in a pool, and the test's ``choose`` picks which
one is delivered next, whether it is delivered twice (a duplicate publish or a redelivery
after the ack was lost) and whether its worker dies mid-body (the attempt keeps its lease
until it lapses; then the reaper sends the step again). Everything runs in one thread on the
in-memory store and leases with a virtual clock, so an order is reproducible from the
choices alone: what a graph run records must depend on the step results only, never on the
choices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.engine.facade import Engine
from pikku_celery.model.errors import WorkflowStepSupersededError
from pikku_celery.testing import VirtualClock

Choose = Callable[[int], int]  # given how many options there are, the index of one


class WorkerDied(BaseException):
    """Raised by a body the driver told to die: like a SIGKILL, nothing is settled and the
    attempt's lease is left to lapse (a ``BaseException``, so the engine does not record it
    as the step's failure)."""


@dataclass
class _Message:
    kind: str  # "step" | "run" | "timer"
    run_id: str
    step_name: str
    function: str = ""
    due_ms: int = 0


@dataclass
class ChoosingDispatcher:
    """The engine's dispatcher: it only collects what it is asked to send."""

    pool: list[_Message] = field(default_factory=list)

    def dispatch_step(self, function: str, run_id: str, step_name: str) -> None:
        self.pool.append(_Message("step", run_id, step_name, function))

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        self.pool.append(_Message("run", run_id, step_name or ""))

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        self.pool.append(_Message("timer", run_id, step_name, due_ms=due_ms))


class Driver:
    """Runs one ``PikkuCelery`` instance's runs message by message, in the chosen order.

    ``choose(n)`` is asked for an index below ``n`` at every delivery, and once more per
    delivered step message for what befalls it: 0 a plain delivery, 1 a duplicate (the same
    message stays in the pool, to be delivered again later), 2 the worker dies in the body
    (only while ``crashes`` last). ``duplicates`` and ``crashes`` bound how many of each one
    run may have, so every run ends."""

    def __init__(self, pikku: PikkuCelery, *, duplicates: int = 0, crashes: int = 0) -> None:
        self.pikku = pikku
        self.clock = VirtualClock()
        self.dispatcher = ChoosingDispatcher()
        self.engine: Engine = pikku.make_engine(
            store=InMemoryWorkflowStore(),
            leases=InMemoryLeaseService(clock_ms=self.clock.now_ms), clock=self.clock,
            dispatcher=lambda engine: self.dispatcher)
        self._previous = pikku._override_engine(None, self.engine)
        self.duplicates = duplicates
        self.crashes = crashes
        self.dying = False  # the body now running is to die (``die_if_told``)
        self.delivered: list[str] = []  # what was delivered, in order (for failure reports)

    def close(self) -> None:
        self.engine.heartbeat.stop()
        self.pikku._override_engine(*self._previous)

    def die_if_told(self, may: bool = True) -> None:
        """Step bodies call this first: the driver may have chosen to kill their worker
        (``may``: whether this attempt may die; a test that wants the step's outcome to
        stay the same lets only attempts with another after them die)."""
        if self.dying and may:
            self.dying = False
            raise WorkerDied

    def run(self, workflow: str, data: Any, choose: Choose, *, limit: int = 5000) -> str:
        """Start a run and deliver messages in the order ``choose`` picks until none is
        left (a crashed attempt's lease is let lapse and the reaper sweeps when only
        timers, or nothing, remain). Returns the run id."""
        run_id = self.pikku.start(workflow, data)
        self.deliver_all(choose, limit=limit)
        return run_id

    def deliver_all(self, choose: Choose, *, limit: int = 5000) -> None:
        """Deliver what is in the pool, and what that sends, until nothing is left."""
        for _ in range(limit):
            if not self.dispatcher.pool and not self._reap():
                return
            if self.dispatcher.pool:
                self._deliver(self.dispatcher.pool.pop(choose(len(self.dispatcher.pool))),
                              choose)
        raise AssertionError(f"messages were still coming after {limit} deliveries: "
                             f"{self.delivered[-20:]}")

    def _deliver(self, message: _Message, choose: Choose) -> None:
        self.delivered.append(f"{message.kind}:{message.step_name}")
        if message.kind == "run":
            self.engine.advance(message.run_id, self.dispatcher,
                                step_name=message.step_name or None)
        elif message.kind == "timer":
            self.clock.sleep_until(message.due_ms)
            self.engine.fire_timer(message.run_id, message.step_name, self.dispatcher)
        else:
            fate = choose(3)
            if fate == 1 and self.duplicates > 0:
                self.duplicates -= 1
                self.dispatcher.pool.append(message)
            self.dying = fate == 2 and self.crashes > 0
            self.crashes -= int(self.dying)
            definition = self.engine.registry.steps[message.function]
            try:
                self.engine.execute_step(definition, message.run_id, message.step_name,
                                         self.dispatcher)
            except WorkerDied:
                self.delivered.append(f"died:{message.step_name}")
            except WorkflowStepSupersededError:
                pass  # a later attempt owns the step: this one's outcome is fenced out
            finally:
                self.dying = False

    def _reap(self) -> bool:
        """Nothing left to deliver: if an attempt is held by a dead worker, let its lease
        lapse and sweep (the step comes back as its next attempt). ``True`` if that sent
        anything."""
        lapsed = [s for s in self._unsettled() if s.status == "running"]
        if not lapsed:
            return False
        self.clock.advance(self.engine.settings.step_lease_ms / 1000 + 1)
        self.engine.reap(self.dispatcher)
        return bool(self.dispatcher.pool)

    def _unsettled(self) -> Iterator[Any]:
        for run in self.engine.store.list_runs(limit=1000):
            yield from (s for s in self.engine.get_steps(run.run_id)
                        if s.status not in ("succeeded", "failed"))


def stream(choices: list[int]) -> Choose:
    """A ``choose`` that takes its answers from ``choices`` in turn (each modulo the number
    of options), then always picks the first option: Hypothesis shrinks a failing order
    towards the plain first-in, first-out one."""
    answers = iter(choices)

    def choose(count: int) -> int:
        return next(answers, 0) % count
    return choose
