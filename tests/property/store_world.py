"""A deterministic world for the store and claim-layer property tests (issue 21 (b)).

One run, its steps, several workers (each a separate ``Claimer`` with a heartbeat of its own,
as separate processes have), the engine's own ``cancel``, ``finish`` and ``ensure_child``, and
the reaper, all on one fake clock (the lease service's) and either store. Nothing runs in a
thread: the heartbeat of a worker beats when the test says so (``beat``), through the real
``Heartbeat.beat``.

Where the MongoDB store does a read and then writes (``cancel_steps``: a read, then one guarded
write per step; a reclaim: ``find_one``, then a guarded ``find_one_and_update``), the world
can split the operation: ``cancel_begin`` runs the engine's cancel with ``cancel_steps``' own
read and its own writes captured, ``cancel_finish`` sends those exact writes later; a
``claim`` can run another operation between the claim's read and its write (``between=``). The
in-memory store does each of these under one lock: there the split does not exist, and the
world runs the operation whole (the order is then the only thing that varies).

``check`` asserts the invariants of ``shared/design/contract.md`` that a state of the world can
show; the operations assert the ones about what an operation may do (a superseded write
changes nothing, a live owner is never robbed, nothing records an outcome on an ended run).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from pymongo.errors import BulkWriteError

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.engine.claims import Claimed, Claimer, NotClaimed
from pikku_celery.engine.heartbeat import Heartbeat
from pikku_celery.model import keys
from pikku_celery.model.errors import WorkflowStepSupersededError
from pikku_celery.model.records import (
    RUN_CANCELLED,
    RUN_TERMINAL,
    STEP_PENDING,
    STEP_RUNNING,
    StepState,
)
from pikku_celery.store.base import NewRun, NewStep, WorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from pikku_celery.workflow.replay import CHILD_PREFIX

T0 = 1_700_000_000_000
LEASE_MS = 30_000
RUN = "sm-run"
STEPS = ("a", "b")  # recorded at the start, two attempts each
LATE = "c"  # recorded by a later pass
KID = "kid"  # parked on a child run
WORK = "sm.work"
KID_FLOW = "sm.kid"
CHILD_RUN = keys.child_run_id(RUN, KID)


class FakeTime:
    """The lease service's clock; it moves only when told."""

    def __init__(self) -> None:
        self.ms = T0

    def __call__(self) -> int:
        return self.ms


class WorldClock:
    """The engine's ``Clock`` on the fake time (no sampling, no extrapolation)."""

    def __init__(self, time: FakeTime) -> None:
        self._time = time

    def now_ms(self) -> int:
        return self._time.ms

    def observe(self, server_ms: int, sent_monotonic: float) -> None:
        pass

    def sleep_until(self, due_ms: int) -> None:
        self._time.ms = max(self._time.ms, due_ms)


class ManualHeartbeat(Heartbeat):
    """The real heartbeat without its thread: it beats when the test calls ``beat``."""

    def _ensure_thread(self) -> None:
        pass


class Steps:
    """The MongoDB store's step collection, with two seams: writes of ``update_one``
    captured instead of sent (``capturing``), and an operation run right after the next
    ``find_one`` returns (``after_read``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.capturing = False
        self.captured: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.after_read: Callable[[], None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def update_one(self, guard: Any, update: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.capturing:
            return self._inner.update_one(guard, update, *args, **kwargs)
        self.captured.append((guard, update))
        return _NotYet()

    def bulk_write(self, requests: Any, *args: Any, **kwargs: Any) -> Any:
        """A fence guarded on the end still standing is an ordered command of two
        statements (``cancel_steps(while_ended=True)``): captured whole, sent later whole."""
        if not self.capturing:
            return self._inner.bulk_write(requests, *args, **kwargs)
        self.captured.append((list(requests), None))
        return _NotYetBulk()

    def find_one(self, *args: Any, **kwargs: Any) -> Any:
        doc = self._inner.find_one(*args, **kwargs)
        hook, self.after_read = self.after_read, None
        if hook is not None:
            hook()
        return doc


class _NotYet:
    matched_count = 0  # what ``cancel_steps`` counts; the write is sent later


class _NotYetBulk:
    matched_count = 1  # the end's mark matched; the fence itself is sent later


class Violation(AssertionError):
    """An invariant of the contract does not hold."""


@dataclass
class Worker:
    name: str
    claimer: Claimer
    held: Claimed | None = None
    history: list[str] = field(default_factory=list)


class World:
    def __init__(self, store: WorkflowStore, *, workers: int = 3) -> None:
        self.store = store
        self.time = FakeTime()
        self.clock = WorldClock(self.time)
        self.leases = InMemoryLeaseService(clock_ms=self.time)
        self.split = isinstance(store, MongoWorkflowStore)
        self.steps_seam: Steps | None = None
        if isinstance(store, MongoWorkflowStore):
            self.steps_seam = Steps(store._steps)
            store._steps = self.steps_seam  # type: ignore[assignment]
            original = store.cancel_steps

            def cancel_steps(run_id: str, error: dict[str, Any], now_ms: int,
                             **options: Any) -> int:
                assert self.steps_seam is not None
                self.steps_seam.capturing = True
                try:
                    return original(run_id, error, now_ms, **options)
                finally:
                    self.steps_seam.capturing = False

            store.cancel_steps = cancel_steps  # type: ignore[method-assign]
        self.pikku = PikkuCelery(Celery(f"sm-{uuid.uuid4().hex[:8]}", broker="memory://"),
                                 store=store, leases=self.leases, worker_reaper=False)
        self.pikku.step(name=WORK)(lambda data: data)
        self.pikku.workflow(KID_FLOW)(lambda wf, data: data)
        self.engine = self.pikku.engine
        self.engine.clock = self.clock
        self.engine.claimer.clock = self.clock
        self.sent: list[tuple[str, str]] = []
        self.engine.dispatcher = _Collect(self.sent)
        self.workers = [
            Worker(f"w{i}", Claimer(store, self.leases, self.clock,
                                    ManualHeartbeat(store, self.leases, self.clock),
                                    host=f"w{i}"))
            for i in range(workers)]
        store.create_run(NewRun(RUN, "sm.flow", None), self.time.ms)
        store.insert_steps([NewStep(RUN, name, WORK, max_attempts=2) for name in STEPS],
                           self.time.ms, seq=1)
        self.names = list(STEPS)
        self.kid_recorded = False
        self.kid_created = False
        # What the world has seen: the highest attempt of each step, the lease each
        # attempt was last given (by its claim or a renewal the store accepted).
        self.attempts: dict[str, int] = {name: 1 for name in STEPS}
        self.lease_of: dict[tuple[str, int], int] = {}
        self.ended = False  # an end (cancel, completion, failure) has been fully written
        self.log: list[str] = []

    # --- helpers -------------------------------------------------------------------------

    @property
    def pending_writes(self) -> int:
        return 0 if self.steps_seam is None else len(self.steps_seam.captured)

    def step(self, name: str) -> StepState:
        state = self.store.get_step(RUN, name)
        assert state is not None
        return state

    def run_status(self, run_id: str = RUN) -> str | None:
        run = self.store.get_run(run_id)
        return None if run is None else run.status

    def _observe(self) -> None:
        """Remember each running attempt's lease as the store has it now."""
        for state in self.store.list_steps(RUN):
            if state.status == STEP_RUNNING and state.lease_expires_at is not None:
                self.lease_of[(state.step_name, state.attempt)] = round(
                    state.lease_expires_at.timestamp() * 1000)

    def lapsed(self) -> list[str]:
        """The steps running on a lease that has lapsed by now."""
        return [s.step_name for s in self.store.list_steps(RUN)
                if s.status == STEP_RUNNING and s.lease_expires_at is not None
                and s.lease_expires_at.timestamp() * 1000 < self.time.ms]

    def _settled_view(self, name: str) -> tuple[StepState, list[Any], str | None]:
        history = [h for h in self.store.get_history(RUN) if h.step_name == name]
        return self.step(name), history, self.run_status()

    # --- operations --------------------------------------------------------------------

    def tick(self, ms: int) -> None:
        self.time.ms += ms
        self.log.append(f"tick({ms})")

    def claim(self, w: int, name: str, between: str | None = None,
              other: int | None = None) -> None:
        """Worker ``w`` claims ``name`` through the claim layer (Redis lease, then the
        store's claim); with ``between``, the operation ``between`` (done by worker
        ``other``, by default the worker holding ``name``) lands between the store claim's
        read and its write."""
        worker = self.workers[w]
        self.log.append(f"claim(w{w}, {name!r}, between={between!r}, other={other})")
        if worker.held is not None or name not in self.names:
            return
        self._observe()
        before = self.step(name)
        now = self.time.ms
        at_write = [before]  # the step as the claim's write will find it

        def interleaved() -> None:
            if between is None:
                return
            self._do(between, other if other is not None else self._holder_of(name, w), name)
            self._observe()
            at_write[0] = self.step(name)

        if self.steps_seam is not None and between is not None:
            self.steps_seam.after_read = interleaved
        elif between is not None:
            interleaved()  # one lock: the other operation lands before or after, whole
        try:
            got = worker.claimer.claim(RUN, name, WORK, LEASE_MS)
        finally:
            if self.steps_seam is not None:
                self.steps_seam.after_read = None
        after = self.step(name)
        if isinstance(got, Claimed):
            self._won(worker, got, at_write[0], after, now)
        else:
            assert isinstance(got, NotClaimed)
        self._observe()

    def _won(self, worker: Worker, got: Claimed, fenced_out: StepState, after: StepState,
             now: int) -> None:
        """What a claim that won may not have done."""
        name = after.step_name
        if after.attempt > fenced_out.attempt:
            # A reclaim fenced out the attempt it found running: it must have lapsed.
            lease = self.lease_of.get((name, fenced_out.attempt))
            if fenced_out.status == STEP_RUNNING and lease is not None and lease >= now:
                raise Violation(f"a live worker was robbed: attempt {fenced_out.attempt} of "
                                f"{name!r} held until {lease} was superseded at {now}")
        if self.run_status() in RUN_TERMINAL:
            raise Violation(f"{worker.name} claimed attempt {got.state.attempt} of {name!r} "
                            f"of run {RUN}, which had ended {self.run_status()}: a body "
                            "starts for an ended run")
        for other_worker in self.workers:
            if other_worker is not worker and other_worker.held is not None:
                held = other_worker.held.state
                if (held.step_name, held.attempt) == (name, got.state.attempt):
                    raise Violation(f"two claimers won attempt {held.attempt} of {name!r}")
        worker.held = got
        worker.history.append(f"{name}#{got.state.attempt}")
        self.lease_of[(name, got.state.attempt)] = now + LEASE_MS

    def _holder_of(self, name: str, default: int) -> int:
        """The worker that holds ``name`` now (the newest attempt), else another one."""
        holders = [(wk.held.state.attempt, i) for i, wk in enumerate(self.workers)
                   if wk.held is not None and wk.held.state.step_name == name]
        return max(holders)[1] if holders else (default + 1) % len(self.workers)

    def _do(self, what: str, w: int, name: str) -> None:
        """An operation another party makes inside a claim's window."""
        if what == "beat":
            self.beat(w)
        elif what == "succeed":
            self.settle(w, True)
        elif what == "fail":
            self.settle(w, False)
        elif what == "cancel":
            self.cancel_begin()
        elif what == "finish":
            self.finish("completed")
        else:  # pragma: no cover - the strategies name the above only
            raise AssertionError(what)

    def beat(self, w: int) -> None:
        """One beat of worker ``w``'s heartbeat (the real ``Heartbeat.beat``)."""
        worker = self.workers[w]
        self.log.append(f"beat(w{w})")
        heartbeat = worker.claimer.heartbeat
        held = heartbeat.held()
        if not held:
            return
        heartbeat.beat(held)
        for h in held:
            state = self.step(h.step_name)
            if h.lost.is_set():
                continue
            if state.attempt != h.attempt or state.status != STEP_RUNNING:
                raise Violation(f"{worker.name}'s attempt {h.attempt} of {h.step_name!r} was "
                                f"superseded (store: attempt {state.attempt}, "
                                f"{state.status}) and a beat did not tell it")
            if self.ended and self.pending_writes == 0:
                raise Violation(f"run ended ({self.run_status()}) but {worker.name}'s body "
                                f"of {h.step_name!r} attempt {h.attempt} was not told its "
                                "lease is lost at the next beat")
        self._observe()

    def settle(self, w: int, success: bool) -> None:
        """Worker ``w`` records its attempt's outcome (success, or a failure with a retry
        due at once when attempts are left)."""
        worker = self.workers[w]
        self.log.append(f"settle(w{w}, success={success})")
        if worker.held is None:
            return
        claimed, worker.held = worker.held, None
        name, attempt = claimed.state.step_name, claimed.state.attempt
        before = self._settled_view(name)
        ended_before = self.ended and self.pending_writes == 0
        try:
            if success:
                claimed_state = worker.claimer.succeed(claimed, f"{worker.name}:{attempt}")
            else:
                claimed_state = worker.claimer.fail(
                    claimed, {"type": "Boom", "message": f"{worker.name}:{attempt}"}, 0)
        except WorkflowStepSupersededError:
            after = self._settled_view(name)
            if after != before:
                raise Violation(f"a superseded write of attempt {attempt} of {name!r} "
                                f"changed something:\n{before}\n->\n{after}") from None
            return
        if claimed_state.attempt != attempt:
            raise Violation(f"attempt {attempt}'s settle reports attempt "
                            f"{claimed_state.attempt}")
        if ended_before:
            raise Violation(f"run {RUN} had ended ({self.run_status()}) when attempt "
                            f"{attempt} of {name!r} recorded its "
                            f"{'success' if success else 'failure'}")

    def die(self, w: int) -> None:
        """Worker ``w``'s process dies: nothing settles, its leases are left to lapse."""
        worker = self.workers[w]
        self.log.append(f"die(w{w})")
        if worker.held is not None:
            worker.claimer.heartbeat.remove(worker.held.held)
            worker.held = None

    def cancel_begin(self) -> None:
        """The engine's cancel; on MongoDB, ``cancel_steps``' writes are held back (its read
        has happened) until ``cancel_finish``."""
        self.log.append("cancel_begin()")
        self.engine.cancel(RUN, "property test")
        self._ended_if_done()

    def finish(self, status: str) -> None:
        """A pass ends the run (``completed`` or ``failed``) with steps left unsettled: the
        engine's ``finish``, whose fence of the leftovers is split like a cancel's."""
        self.log.append(f"finish({status!r})")
        run = self.store.get_run(RUN)
        assert run is not None
        if run.is_terminal:
            return
        error = None if status == "completed" else {"type": "Boom", "message": "x"}
        self.engine.finish(run, status, error=error)
        self._ended_if_done()

    def cancel_finish(self) -> None:
        """The held-back writes of the fences begun so far land now."""
        self.log.append("cancel_finish()")
        if self.steps_seam is not None:
            captured, self.steps_seam.captured = self.steps_seam.captured, []
            for guard, update in captured:
                if update is not None:
                    self.steps_seam._inner.update_one(guard, update)
                    continue
                # The fence and the end's mark it is guarded on, in order; without the
                # mark (the end was undone meanwhile) the fence writes nothing.
                with contextlib.suppress(BulkWriteError):
                    self.steps_seam._inner.bulk_write(guard, ordered=True)
        self._ended_if_done()

    def _ended_if_done(self) -> None:
        if self.run_status() in RUN_TERMINAL and self.pending_writes == 0:
            self.ended = True

    def record_late_step(self) -> None:
        """A pass of the live run records one more step (``insert_steps``, as a pass
        flushes its batch)."""
        self.log.append("record_late_step()")
        if LATE in self.names or self.run_status() in RUN_TERMINAL:
            return
        self.store.insert_steps([NewStep(RUN, LATE, WORK, max_attempts=2)], self.time.ms,
                                seq=2)
        self.names.append(LATE)
        self.attempts[LATE] = 1

    def record_child_step(self) -> None:
        """A pass reaches a child workflow: it records the parked step (first half)..."""
        self.log.append("record_child_step()")
        if self.kid_recorded or self.run_status() in RUN_TERMINAL:
            return
        self.store.insert_steps([NewStep(RUN, KID, CHILD_PREFIX + KID_FLOW,
                                         status=STEP_RUNNING, child_run_id=CHILD_RUN)],
                                self.time.ms, seq=3)
        self.kid_recorded = True

    def create_child(self) -> None:
        """... then creates the child run (second half: the engine's ``ensure_child``)."""
        self.log.append("create_child()")
        if not self.kid_recorded or self.kid_created:
            return
        self.engine.ensure_child(RUN, KID, KID_FLOW, None, CHILD_RUN, self.engine.dispatcher)
        self.kid_created = True

    def sweep(self) -> None:
        """A reaper sweep (the real ``Reaper``), then the store's sweeps checked: every
        running step whose lease lapsed is found (invariant 4: a dead worker's step comes
        back without the broker)."""
        self.log.append("sweep()")
        self.sent.clear()
        self.engine.reap(self.engine.dispatcher)
        now = self.time.ms
        lapsed = {s.step_name for s in self.store.find_lapsed_steps(now, 100)
                  if s.run_id == RUN}
        for state in self.store.list_steps(RUN):
            expires = state.lease_expires_at
            is_lapsed = (state.status == STEP_RUNNING and expires is not None
                         and expires.timestamp() * 1000 < now)
            if is_lapsed != (state.step_name in lapsed):
                raise Violation(f"find_lapsed_steps disagrees about {state.step_name!r}: "
                                f"{state}")

    # --- invariants ------------------------------------------------------------------------

    def check(self) -> None:
        states = {s.step_name: s for s in self.store.list_steps(RUN)}
        history = self.store.get_history(RUN)
        for name, state in states.items():
            seen = self.attempts.get(name, 1)
            if state.attempt < seen:
                raise Violation(f"attempt of {name!r} went back from {seen} to "
                                f"{state.attempt}")
            self.attempts[name] = state.attempt
            if state.attempt > state.max_attempts:
                raise Violation(f"{name!r} is at attempt {state.attempt} of "
                                f"{state.max_attempts}")
            entries = [h.attempt for h in history if h.step_name == name]
            if len(entries) != len(set(entries)) or any(a > state.attempt for a in entries):
                raise Violation(f"history of {name!r} is not one entry per attempt: "
                                f"{entries} (step at attempt {state.attempt})")
            current = [h for h in history if h.step_name == name
                       and h.attempt == state.attempt]
            if state.status in (STEP_RUNNING, "succeeded") and not current:
                raise Violation(f"{name!r} is {state.status} at attempt {state.attempt} "
                                "with no history entry for it")
            if current and state.status != STEP_PENDING and (
                    current[0].status != state.status):
                raise Violation(f"history says attempt {state.attempt} of {name!r} is "
                                f"{current[0].status}, the step says {state.status}")
        held = [(w.held.state.step_name, w.held.state.attempt)
                for w in self.workers if w.held is not None]
        if len(held) != len(set(held)):
            raise Violation(f"two workers hold one attempt: {held}")
        if self.pending_writes:
            return  # a fence is half written: the end is not complete yet
        status = self.run_status()
        if status in RUN_TERMINAL:
            # Once the end is written (the run, then its fence), no attempt of the run is
            # left running. A step left claimable (pending, or failed with a retry due: one
            # that settled inside the fence's window) may stay so: its next claim must fence
            # itself (``claim`` checks that no body starts for an ended run).
            running = [s for s in states.values() if s.status == STEP_RUNNING]
            if running:
                raise Violation(f"run ended {status} but steps are left running unfenced: "
                                + ", ".join(f"{s.step_name} attempt {s.attempt}"
                                            for s in running))
        child = self.run_status(CHILD_RUN)
        if status == RUN_CANCELLED and child is not None and child not in RUN_TERMINAL:
            raise Violation(f"run {RUN} is cancelled but its child run is {child}")


@dataclass
class _Collect:
    sent: list[tuple[str, str]]

    def dispatch_step(self, function: str, run_id: str, step_name: str) -> None:
        self.sent.append((run_id, step_name))

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        pass

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        pass


def new_memory_store() -> WorkflowStore:
    return InMemoryWorkflowStore()
