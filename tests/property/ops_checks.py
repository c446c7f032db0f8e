"""The promises of contract section 7 that ``ops_world.World`` checks after every operation
of the model-based test (``test_operations_model.py``), and the model of what the
operations promised (``Model``, kept by the world as it runs them). Each failure names the
invariant by its number in section 7, followed by the operations that led there."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from pikku_celery.model import keys
from pikku_celery.model.records import StepState, WorkflowRun
from pikku_celery.store._slots import slot_holder, slot_id
from pikku_celery.store.base import WorkflowStore

KEYS = ("a", "b")
ORDER = "mb.order"
SCHEDULE = "mb.every-minute"
LIVE = ("running", "suspended")
EVENT_PREFIX, APPROVAL_PREFIX = "__event:", "__approval:"
FENCES = ("WorkflowCancelledError", "WorkflowRunEnded")  # the errors an end's fence writes


class Violation(AssertionError):
    """A promise of contract section 7 broken; the message starts with its number."""



@dataclass
class Model:
    """What the operations promised, kept by the world as it runs them."""

    order: list[str] = field(default_factory=list)  # every run the world started, in order
    seen: set[str] = field(default_factory=set)  # the runs of the last check
    queued_seen: set[str] = field(default_factory=set)  # those that were queued then
    settled: dict[tuple[str, str], Any] = field(default_factory=dict)  # succeeded steps
    copied: dict[str, set[str]] = field(default_factory=dict)  # a fork's copied steps
    kept_decisions: dict[str, bool] = field(default_factory=dict)  # per fork
    forks: dict[tuple[str, str, bool], str] = field(default_factory=dict)
    sends: dict[str, int] = field(default_factory=dict)  # unkeyed sends kept, per run
    keyed: dict[str, set[str]] = field(default_factory=dict)  # keys kept, per run
    payloads: dict[str, set[str]] = field(default_factory=dict)  # payloads sent, per run
    late_bodies: list[str] = field(default_factory=list)  # bodies started on ended runs
    listened: set[str] = field(default_factory=set)  # runs live at the last check
    # Per run retried: how many attempts of each step had run when the retry was made.
    retried: dict[str, dict[str, int]] = field(default_factory=dict)


class Checks:
    """The checks, as a part of the world (``World`` inherits them)."""

    inner: WorkflowStore
    model: Model
    pool: Any  # ops_world.Pool
    log: list[str]
    skip: frozenset[int]
    listening: contextlib.ExitStack  # a listener per run seen live (``_announced``)
    listeners: dict[str, Any]
    leases: Any

    def violation(self, message: str) -> Violation:
        """``message``, and the operations that led there (the shrunk sequence reads as
        them)."""
        return Violation(message + "\n  after:\n    " + "\n    ".join(self.log))

    def runs(self) -> list[WorkflowRun]:
        found = self.inner.list_runs(limit=1000)
        return sorted(found, key=lambda r: (r.created_at, r.run_id))

    # --- the promises: checked after every rule ---

    def check(self) -> None:
        """Contract section 7's invariants that a state shows (``skip``: numbers not
        checked, to let an exploration go past a known defect)."""
        skip = self.skip
        model = self.model
        if 2 not in skip and model.late_bodies:
            raise self.violation(f"2. a body started on an ended run: {model.late_bodies}")
        runs = {run.run_id: run for run in self.runs()}
        steps = {rid: self.inner.list_steps(rid) for rid in runs}
        for rid, run in runs.items():
            if 1 not in skip:
                self._one_outcome(run, steps[rid])
            if 2 not in skip:
                self._no_fence_on_live(run, steps[rid])
            if 3 not in skip:
                self._waits_wait(run, steps[rid])
            if 5 not in skip:
                self._events(run, steps[rid])
            if 6 not in skip:
                self._fork_copied(run)
            if 10 not in skip:
                self._timed_waits_woken(run, steps[rid])
        self._across_runs(runs)

    def _across_runs(self, runs: dict[str, WorkflowRun]) -> None:
        """The invariants about several runs, or a run over time."""
        skip = self.skip
        if 8 not in skip:
            self._announced(runs)
        if 9 not in skip:
            self._retried_ran(runs)
        if 4 not in skip:
            self._limits(runs)
        if 7 not in skip:
            ticks = [r.scheduled_for for r in runs.values() if r.schedule == SCHEDULE]
            if len(ticks) != len(set(ticks)):
                raise self.violation(f"7. two runs of one tick: {sorted(map(str, ticks))}")

    def _announced(self, runs: dict[str, WorkflowRun]) -> None:
        """8. Whatever ends a run (a pass, a cancel, a parent's cancel, a fork's or a
        retry's run ending again) wakes those waiting in ``PikkuCelery.wait``: a run seen
        live at one check and ended at the next was announced in between."""
        for rid, run in runs.items():
            listener = self.listeners.get(rid)
            heard = listener is not None and listener.wait(0)
            if run.status in (*LIVE, "queued"):
                if listener is None:
                    self.listeners[rid] = self.listening.enter_context(
                        self.leases.listen(keys.run_lease_key(rid)))
                self.model.listened.add(rid)
            elif rid in self.model.listened:
                self.model.listened.discard(rid)
                if not heard:
                    raise self.violation(f"8. run {rid} ended {run.status} and nobody waiting "
                                         "for it was told")

    def _retried_ran(self, runs: dict[str, WorkflowRun]) -> None:
        """9. A retried run that fails again fails on a step that ran again after the
        retry (a new attempt with a history entry): never on the failure its end left,
        replayed before the retry reopened it."""
        for rid, before in list(self.model.retried.items()):
            run = runs.get(rid)
            if run is None or run.status in (*LIVE, "queued"):
                continue
            del self.model.retried[rid]
            if run.status != "failed":
                continue
            message = str((run.error or {}).get("message", ""))
            name = message.split("'")[1] if message.startswith("step '") else None
            if name is None or name not in before:
                continue
            now = sum(1 for e in self.inner.get_history(rid) if e.step_name == name)
            if now <= before[name]:
                raise self.violation(f"9. run {rid} failed again on step {name!r}, which did "
                                     f"not run after the retry: {message[:200]}")

    def _one_outcome(self, run: WorkflowRun, steps: list[StepState]) -> None:
        for state in steps:
            key = (run.run_id, state.step_name)
            if key in self.model.settled:
                if (state.status, state.result) != ("succeeded", self.model.settled[key]):
                    raise self.violation(f"1. {key} had succeeded with {self.model.settled[key]!r}"
                                    f", now {state.status} {state.result!r}")
            elif state.status == "succeeded":
                self.model.settled[key] = state.result
        succeeded: dict[str, int] = {}
        attempts: dict[str, list[int]] = {}
        for entry in self.inner.get_history(run.run_id):
            attempts.setdefault(entry.step_name, []).append(entry.attempt)
            if entry.status == "succeeded":
                succeeded[entry.step_name] = succeeded.get(entry.step_name, 0) + 1
        twice = {name: n for name, n in succeeded.items() if n > 1}
        if twice:
            raise self.violation(f"1. run {run.run_id}: steps with two successes: {twice}")
        for state in steps:  # contract 2.9: one history entry per attempt, none skipped
            seen = attempts.get(state.step_name, [])
            missing = [n for n in range(1, state.attempt) if n not in seen]
            if missing or len(seen) != len(set(seen)):
                raise self.violation(f"1. run {run.run_id}: step {state.step_name!r} at "
                                     f"attempt {state.attempt} has history entries {seen}")

    def _no_fence_on_live(self, run: WorkflowRun, steps: list[StepState]) -> None:
        if run.status not in LIVE:
            return
        for state in steps:
            if (state.status == "failed" and state.attempt >= state.max_attempts
                    and state.due_at is None
                    and (state.error or {}).get("type") in FENCES):
                raise self.violation(f"2. run {run.run_id} is {run.status} but the fence of an "
                                f"end failed its step {state.step_name!r} for good: "
                                f"{state.error}")

    def _waits_wait(self, run: WorkflowRun, steps: list[StepState]) -> None:
        for state in steps:
            if not state.step_name.startswith((EVENT_PREFIX, APPROVAL_PREFIX)):
                continue
            result = state.result if isinstance(state.result, dict) else {}
            if state.status != "succeeded" or not (result.get("timed_out")
                                                  or result.get("expired")):
                continue
            expires = (state.data or {}).get("expires_at_ms")
            at = round(state.updated_at.timestamp() * 1000)
            if expires is None or at < expires:
                raise self.violation(f"3. run {run.run_id}: wait {state.step_name!r} ended as "
                                f"timed out at {at} ms, its deadline "
                                f"{'none' if expires is None else f'{expires} ms'}")

    def _timed_waits_woken(self, run: WorkflowRun, steps: list[StepState]) -> None:
        """10. A live run's sleep, or its gate with an expiry, has a timer on its way (or
        the wake its timer sent, naming it): with no reaper, nothing else would end the
        wait. A timer that fired in a process ahead of the one its wake reached must not
        leave the wait with neither."""
        if run.status not in LIVE:
            return
        owed = {(m.kind, m.step_name) for m in self.pool.messages if m.run_id == run.run_id}
        for state in steps:
            if (state.status == "scheduled" and state.function is None
                    and state.due_at is not None
                    and not owed & {("timer", state.step_name), ("run", state.step_name)}):
                raise self.violation(f"10. run {run.run_id} waits on {state.step_name!r} "
                                     f"(due {state.due_at}) and nothing will wake it")

    def _events(self, run: WorkflowRun, steps: list[StepState]) -> None:
        rid, model = run.run_id, self.model
        events = self.inner.list_events(rid)
        expected = model.sends.get(rid, 0) + len(model.keyed.get(rid, set()))
        if len(events) != expected:
            raise self.violation(f"5. run {rid} keeps {len(events)} events for {expected} sends: "
                            f"{[(e.seq, e.key, e.payload) for e in events]}")
        by_seq = {e.seq: e for e in events}
        copied = model.copied.get(rid, set())
        own = [s for s in steps if s.step_name.startswith(EVENT_PREFIX)
               and s.step_name not in copied]
        own.sort(key=lambda s: _reach(s.step_name))
        taken = [s.result["seq"] for s in own
                 if s.status == "succeeded" and isinstance(s.result, dict)
                 and "seq" in s.result]
        for state in own:
            if state.status == "succeeded" and isinstance(state.result, dict) and (
                    "seq" in state.result):
                event = by_seq.get(state.result["seq"])
                if event is None or event.payload != state.result.get("payload"):
                    raise self.violation(f"5. run {rid}'s wait {state.step_name!r} took "
                                    f"{state.result}, not an event of this run")
        ordered = sorted(by_seq)
        if taken != ordered[:len(taken)]:
            raise self.violation(f"5. run {rid} took events {taken} of {ordered}: not each once, "
                            f"in the order kept")
        waiting = [s for s in own if s.status == "scheduled"]
        if waiting and run.status in LIVE and len(taken) < len(ordered) and not any(
                m.run_id == rid for m in self.pool.messages):
            raise self.violation(f"5. run {rid} waits at {waiting[0].step_name!r} with events "
                            f"{ordered[len(taken):]} kept and not taken, and nothing will "
                            f"wake it")

    def _fork_copied(self, run: WorkflowRun) -> None:
        rid = run.run_id
        if rid not in self.model.copied or self.model.kept_decisions.get(rid):
            return
        gates = sorted(n for n in self.model.copied[rid]
                       if n.startswith((EVENT_PREFIX, APPROVAL_PREFIX)))
        if gates:
            raise self.violation(f"6. fork {rid} copied decided gates {gates} without "
                            f"keep_decisions")

    def _limits(self, runs: dict[str, WorkflowRun]) -> None:
        model = self.model
        for key in KEYS:
            slot = slot_id(ORDER, key)
            group = [r for r in runs.values() if r.workflow == ORDER and r.input["k"] == key]
            live = [r.run_id for r in group if r.status in LIVE]
            lives = {slot_holder(r) for r in group if r.status in LIVE}  # a run in its life
            holders = self.inner.slot_holders(slot)
            if len(live) > 1:
                raise self.violation(f"4. key {key!r}: {len(live)} live runs {live} (limit 1)")
            if len(holders) > 1 or set(holders) != lives:
                raise self.violation(f"4. key {key!r}: slot held by {holders}, live runs "
                                     f"{sorted(lives)}")
            queued = [r for r in group if r.status == "queued"]
            for rid in live:  # admitted since the last check: first in, first out
                if rid in model.queued_seen or rid not in model.seen:
                    older = [r.run_id for r in queued
                             if (r.created_at, r.run_id) < (runs[rid].created_at, rid)]
                    if older:
                        raise self.violation(f"4. key {key!r}: {rid} admitted before {older}, "
                                        f"queued before it")
        model.seen = set(runs)
        model.queued_seen = {rid for rid, r in runs.items() if r.status == "queued"}

def _reach(step_name: str) -> int:
    _, sep, tail = step_name.rpartition("#")
    return int(tail) if sep and tail.isdigit() else 1
