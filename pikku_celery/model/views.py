"""What an orchestrating process remembers of the runs it advanced: incremental replay.

A pass replays the workflow over the run's steps. Reading every step every pass makes a run
of N steps cost N²/2 documents; instead each process keeps a *view* of the runs it advanced
recently (a bounded LRU, ``Views``) and a pass reads only what may have changed since:

* A step settled for good (``succeeded``, or ``failed`` with no attempt due) never changes
  again: the view keeps it.
* Any other step may change at any time (claimed, settled, expired, fenced by a cancel).
  Every change a pass must see leaves a mark on the run lease naming the step: the settle
  of a step (its worker's in-place continuation, or the orchestrator message it sends),
  an expiry, a due sleep, a finished child run. A pass re-reads the steps its grant's marks
  name; ``ALL`` (a message that names nothing: the reaper, a resume, a cancel) re-reads the
  run and every step the view does not hold settled for good.
* Other processes may have advanced the run meanwhile. The run-lease token rises by one
  with every grant, so a view made under token T is current when this grant's token is
  T + 1. Otherwise the pass re-reads the run, every step the view holds unsettled, and the
  steps recorded by passes after T (each step records the token of the pass that recorded
  it: ``seq``). A token *below* T means Redis lost its counters: the view is not trusted
  and the run is read in full. Unless the holder of the grant before left a note with the
  lease that closes the gap (``engine.handover``): then only the run's document is read.
* A step the view lacks although it exists (recorded late by a pass that had lost its
  lease) is found when this pass records it: the insert finds it and the pass runs again.

A view is taken out of the cache for the length of a pass and put back only by a pass that
ended well, so a pass that failed or lost its lease leaves nothing half-updated behind (the
next pass reads the run in full).

Timeline of the race the marks close (``continue_in_place``, two workers):

    t0  worker A settles step s1; its continuation takes the run lease and reads its view
    t1  worker B settles step s2; its continuation finds the lease held: it marks "s2"
    t2  A's pass ends; handing the lease back takes the mark "s2" instead of releasing
    t3  A passes again, re-reading s2: nothing was missed and no message was sent
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from pikku_celery.model._fork import reset_in_forked_child
from pikku_celery.model.clock import epoch_ms
from pikku_celery.model.records import (
    STEP_FAILED,
    STEP_SCHEDULED,
    STEP_SUCCEEDED,
    StepState,
    WorkflowRun,
)

ALL = "$all"  # a mark that names no step: re-read the run and every unsettled step
# A run's views together hold at most this many steps in one process (about 1 KB each).
MAX_VIEW_STEPS = 20_000
# A note (``RunView.changed``) starts again past this many steps (about 400 B each): it is
# written to Redis at every hand-back of the run lease.
NOTE_STEPS = 100


def settled_for_good(state: StepState) -> bool:
    """Whether ``state`` can never change again (nothing else may be cached)."""
    return state.status == STEP_SUCCEEDED or (state.status == STEP_FAILED
                                              and state.due_at is None)


def timer_due_ms(state: StepState) -> int | None:
    """When the timer of a sleep or a timed wait (a gate's expiry, an event's timeout) is
    due, in epoch ms; ``None`` for any other step, or one that waits with no deadline."""
    if state.status != STEP_SCHEDULED or state.function is not None or state.due_at is None:
        return None
    return epoch_ms(state.due_at)


@dataclass(eq=False)
class RunView:
    """One run as a process last saw it under the run lease."""

    run: WorkflowRun
    steps: dict[str, StepState]  # by step name: the replay's own table
    token: int  # the run-lease token under which the view was last made current
    touched_ms: int  # the run's ``updated_ms`` as last read or written
    unsettled: set[str] = field(default_factory=set)
    # The steps the last replay paused on at a ``wf.gather`` (empty when it paused on
    # anything else): see ``skips``.
    waiting: set[str] = field(default_factory=set)
    # The note left with the run lease for its next holder (``engine.handover``): what the
    # view's passes put in it since the view's token was ``base`` (0 for a view read in
    # full), across passes (cumulative, so a holder whose view is older than the grant
    # before can still adopt it) ...
    base: int = 0
    changed: dict[str, StepState] = field(default_factory=dict)
    # ... and what the pass holding it put since it began (its token then:
    # ``pass_base``): the note left when the cumulative one would be too large.
    pass_base: int = 0
    pass_changed: dict[str, StepState] = field(default_factory=dict)
    # Each step of a note as JSON, kept with the state it encodes (a fan-out's passes
    # leave notes of mostly the same steps).
    encoded: dict[str, tuple[StepState, str]] = field(default_factory=dict)
    # The run's document is older than the steps (a note brought them up): read it.
    run_stale: bool = False

    def begin(self) -> None:
        """A pass takes the view: its own note starts here; the cumulative one starts
        again here once it holds ``NOTE_STEPS`` steps."""
        self.pass_base, self.pass_changed = self.token, {}
        if len(self.changed) >= NOTE_STEPS:
            self.restart_note()

    def restart_note(self) -> None:
        """The cumulative note carries only what this pass put, from where it began."""
        self.base, self.changed = self.pass_base, dict(self.pass_changed)

    def skips(self, fresh: set[str]) -> bool:
        """Whether a pass that learned ``fresh`` (read, or settled by its caller) can skip
        the replay: all of them are steps the last replay's gather waited on, all
        succeeded, and the gather still waits on others, so a replay would only pause
        there again. A fan-out of N steps then replays once at its end instead of once per
        settle (N replays of N calls each). Anything else (a failure, a step it did not
        wait on) replays."""
        waiting = self.waiting
        if not fresh or not fresh <= waiting or any(
                self.steps[n].status != STEP_SUCCEEDED for n in fresh):
            return False
        still = {n for n in waiting
                 if n not in self.steps or self.steps[n].status != STEP_SUCCEEDED}
        self.waiting = still
        return bool(still)

    def put(self, state: StepState) -> None:
        self.steps[state.step_name] = state
        self.changed[state.step_name] = state
        self.pass_changed[state.step_name] = state
        if settled_for_good(state):
            self.unsettled.discard(state.step_name)
        else:
            self.unsettled.add(state.step_name)


class Views:
    """The LRU of run views of one process, bounded by the steps they hold."""

    def __init__(self, max_steps: int = MAX_VIEW_STEPS) -> None:
        self._max_steps = max_steps
        self._lock = threading.Lock()
        self._views: OrderedDict[str, RunView] = OrderedDict()
        self._steps = 0
        reset_in_forked_child(self)

    def _after_fork_in_child(self) -> None:
        # A prefork child starts with no views: its lock may have been copied held, and a
        # view is only as good as the lease grants its own process saw.
        self._lock = threading.Lock()
        self._views = OrderedDict()
        self._steps = 0

    def take(self, run_id: str) -> RunView | None:
        """Remove and return the view of ``run_id``: a pass owns it while it runs."""
        with self._lock:
            view = self._views.pop(run_id, None)
            if view is not None:
                self._steps -= len(view.steps)
            return view

    def workflow_of(self, run_id: str) -> str | None:
        """The workflow of a run whose view is kept, leaving it kept: what a report of a
        pass names (``engine.observed``) without a read of its own."""
        with self._lock:
            view = self._views.get(run_id)
        return view.run.workflow if view is not None else None

    def put(self, view: RunView) -> None:
        """Keep ``view`` (the newest), dropping the least recently used beyond the bound."""
        size = len(view.steps)
        if size > self._max_steps:
            return
        with self._lock:
            old = self._views.pop(view.run.run_id, None)
            if old is not None:
                self._steps -= len(old.steps)
            self._views[view.run.run_id] = view
            self._steps += size
            while self._steps > self._max_steps and self._views:
                _, dropped = self._views.popitem(last=False)
                self._steps -= len(dropped.steps)

    def clear(self) -> None:
        with self._lock:
            self._views.clear()
            self._steps = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._views)
