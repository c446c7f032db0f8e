"""A deterministic world for the model-based test over the operations (issue 31).

One ``PikkuCelery`` with five small workflows (an order limited to one live run per key that
waits for the same event twice, the same waits with no limit, an approval then a sleep, a
parent with a child run of two calls gathered, and a schedule of the approval workflow),
driven through the public engine on either store: every message the engine sends (a step, a
wake of a run, a timer) waits in ``Pool`` until a rule delivers it, every step body does
what the rule tells it (succeed, fail, or die like a SIGKILL, its lease left to lapse), and
the clock (``FakeTime``, the lease service's and the engine's) moves only when told, by one
millisecond per operation at least. Nothing runs in a thread (the heartbeat does not beat: a
rule moves the clock past a lease instead).

Where an operation writes twice and another may land between the two writes (a retry takes
its slot, then revives the run; a cancel ends the run, then fences its steps), ``SeamStore``
runs that other operation right before the second write is sent (``between``), as
``store_world`` does for the claim layer.

``Model`` holds what the operations promised (shared/design/contract.md, section 7) and
``check`` compares the stores' state with it after every rule; a failure names the
invariant by its number in section 7."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from pikku_celery import InMemoryLeaseService, PikkuCelery
from pikku_celery.engine.busy_runs import BusyRuns
from pikku_celery.engine.facade import Engine
from pikku_celery.model import keys
from pikku_celery.model.errors import (
    LeaseTakenError,
    PikkuError,
    WorkflowEventError,
    WorkflowEventLimitError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.records import RUN_TERMINAL
from pikku_celery.schedules.firing import Scheduler
from pikku_celery.store._slots import slot_id
from pikku_celery.store.base import WorkflowStore
from tests.property.ops_checks import ORDER, SCHEDULE, Checks, Model
from tests.property.store_world import FakeTime, WorldClock

LEASE_MS = 30_000
# How far ahead of the world's clock a process's estimate of it runs when a timer is
# delivered there (``deliver_ahead``): a re-anchor on a stalled sample (``ServerClock``).
AHEAD_MS = 5
# A run keeps at most this many events (pikku_max_events_per_run), low enough that the
# machine's sends reach it: a refusal for the limit comes only when the store holds it.
MAX_EVENTS = 3
APPROVAL, PARENT, CHILD, COLLECT = "mb.approval", "mb.parent", "mb.child", "mb.collect"


class WorkerDied(BaseException):
    """A body told to die: nothing is settled, the attempt's lease is left to lapse (a
    ``BaseException``, so the engine does not record it as the step's failure)."""


@dataclass
class Message:
    kind: str  # "step" | "run" | "timer"
    run_id: str
    step_name: str = ""
    function: str = ""
    due_ms: int = 0
    expected: object = None  # the step as recorded, carried as a Celery message carries it

    def __str__(self) -> str:
        return f"{self.kind}:{self.run_id}:{self.step_name}"


@dataclass
class Pool:
    """The engine's dispatcher: every message waits here until a rule delivers it."""

    messages: list[Message] = field(default_factory=list)
    carries_claims = True  # as Celery's: a first claim from the message, no read

    def dispatch_step(self, function: str, run_id: str, step_name: str, *,
                      expected: object = None) -> None:
        self.messages.append(Message("step", run_id, step_name, function, expected=expected))

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        self.messages.append(Message("run", run_id, step_name or ""))

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        self.messages.append(Message("timer", run_id, step_name, due_ms=due_ms))


class _Estimate(WorldClock):
    """The engine's clock: the world's, or ``ahead`` of it while a rule says so."""

    ahead = 0

    def now_ms(self) -> int:
        return super().now_ms() + self.ahead


class SeamStore:
    """The world's store as the engine sees it: every call goes through, except that an
    operation put ``before`` a method runs once, right before that method's next call."""

    def __init__(self, inner: WorkflowStore) -> None:
        self._inner = inner
        self._before: dict[str, Callable[[], None]] = {}

    def before(self, method: str, hook: Callable[[], None]) -> None:
        self._before[method] = hook

    def clear(self) -> None:
        self._before.clear()

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._inner, name)
        hook = self._before.pop(name, None)
        if hook is None:
            return found

        def call(*args: Any, **kwargs: Any) -> Any:
            hook()
            return found(*args, **kwargs)
        return call


def _parameters(fn: Callable[..., Any]) -> set[str]:
    return set(inspect.signature(fn).parameters)


class World(Checks):
    """The engine, its store and clock, the pool of messages, and the model."""

    def __init__(self, store: WorkflowStore) -> None:
        self.time = FakeTime()
        self.store = SeamStore(store)
        self.inner = store
        self.pool = Pool()
        self.model = Model()
        self.fate = "ok"  # what the next body does: "ok", "fail" or "die"
        self.skip: frozenset[int] = frozenset()  # invariants not checked (``Checks.check``)
        self.log: list[str] = []
        self.counter = 0
        leases = InMemoryLeaseService(clock_ms=self.time)
        self.leases = leases
        self.listening = contextlib.ExitStack()
        self.listeners: dict[str, Any] = {}
        self.pikku = pikku = PikkuCelery(
            Celery(f"model-{id(self)}", broker="memory://"), store=store, leases=leases,
            step_lease=LEASE_MS / 1000, run_lease=LEASE_MS / 1000, worker_reaper=False,
            max_events_per_run=MAX_EVENTS)
        self._declare(pikku)
        self.clock = _Estimate(self.time)
        self.engine: Engine = pikku.make_engine(
            store=self.store,
            leases=leases, clock=self.clock, dispatcher=lambda engine: self.pool)
        self.engine.heartbeat._ensure_thread = lambda: None  # type: ignore[method-assign]
        pikku._override_engine(None, self.engine)
        # The guess that a run is still held elsewhere ages on the world's clock too.
        self.engine.passes.busy = BusyRuns(clock=lambda: self.time.ms / 1000)
        self.scheduler = Scheduler(self.engine)
        self.fork_keeps = "keep_decisions" in _parameters(pikku.fork)

    def close(self) -> None:
        self.engine.heartbeat.stop()
        self.listening.close()

    # --- the workflows ----------------------------------------------------------------------

    def _declare(self, pikku: PikkuCelery) -> None:
        world = self

        @pikku.step(name="mb.work", retries=1, retry_delay="1s", bind=True)
        def work(ctx: Any, data: Any) -> Any:
            return world.body(ctx.run_id, ctx.step_name, ctx.attempt, data)

        @pikku.workflow(ORDER, concurrency=1, concurrency_key=lambda data: data["k"])
        def order(wf: Any, data: Any) -> Any:
            reserved = wf.do("reserve", work, data["k"])
            paid = wf.wait_for_event("paid", timeout=data.get("t"), default="NO-PAYMENT")
            shipped = wf.do("ship", work, paid)
            again = wf.wait_for_event("paid", timeout=data.get("t"), default="NONE")
            return [reserved, paid, shipped, again]

        @pikku.workflow(COLLECT)
        def collect(wf: Any, data: Any) -> Any:  # the order's waits, with no limit
            paid = wf.wait_for_event("paid", timeout=data.get("t"), default="NO-PAYMENT")
            shipped = wf.do("ship", work, paid)
            return [paid, shipped, wf.wait_for_event("paid", timeout=data.get("t"))]

        @pikku.workflow(APPROVAL)
        def approval(wf: Any, data: Any) -> Any:
            prepared = wf.do("prepare", work, data)
            decision = wf.approval("ok", expiry=(data or {}).get("t"))
            wf.sleep("nap", "5s")
            return wf.do("pay", work, [prepared, decision])

        @pikku.workflow(CHILD)
        def child(wf: Any, data: Any) -> Any:  # two calls at once: settles that cross
            return wf.gather(wf.call("x", work, data), wf.call("y", work, data))

        @pikku.workflow(PARENT)
        def parent(wf: Any, data: Any) -> Any:
            got = wf.child("kid", CHILD, data)
            return wf.do("after", work, got)

        pikku.schedule(SCHEDULE, APPROVAL, every="60s", data={"scheduled": True})

    def body(self, run_id: str, step_name: str, attempt: int, data: Any) -> Any:
        """Every step body: notes a body started on an ended run (invariant 2), then does
        what the rule said."""
        run = self.inner.get_run(run_id)
        if run is None or run.status in RUN_TERMINAL:
            self.model.late_bodies.append(
                f"{run_id}:{step_name}#{attempt} ({run.status if run else 'no run'})")
        fate, self.fate = self.fate, "ok"
        if fate == "die":
            raise WorkerDied
        if fate == "fail":
            raise RuntimeError(f"{step_name} failed")
        return f"{step_name}({data})#{attempt}"

    # --- helpers ------------------------------------------------------------------------------

    def tick(self, ms: int = 1) -> None:
        self.time.ms += ms

    def note(self, line: str) -> None:
        self.log.append(line)

    def run_at(self, index: int, among: tuple[str, ...] = ()) -> str | None:
        """The run ``index`` (modulo their count) of those the world started, or of those
        of them whose status is in ``among`` when there are any (a user retries the runs
        that ended, and cancels the live ones)."""
        known = self.model.order
        if among:
            found = [r.run_id for r in self.inner.list_runs(limit=1000)
                     if r.status in among and r.run_id in known]
            known = sorted(found, key=known.index) or known
        return known[index % len(known)] if known else None

    # --- the operations ---------------------------------------------------------------------

    def start(self, workflow: str, data: Any) -> str:
        self.tick()
        self.counter += 1
        run_id = f"r{self.counter:03d}"
        self.pikku.start(workflow, data, run_id=run_id)
        self.model.order.append(run_id)
        self.note(f"start {workflow} {data} -> {run_id}")
        return run_id

    def deliver(self, index: int, fate: str, duplicate: bool = False,
                between: str | None = None) -> None:
        """Deliver the pool's message ``index`` (modulo its size); a step's body does
        ``fate``; ``duplicate``: the message stays in the pool (a redelivery later);
        ``between``: as for ``cancel``, should the delivery end the run."""
        if not self.pool.messages:
            return
        self.tick()
        messages = self.pool.messages
        message = messages[index % len(messages)]
        if not duplicate:
            messages.remove(message)
        self.note(f"deliver {message} {fate if message.kind == 'step' else ''}".rstrip()
                  + (f" with a {between} inside its end" if between else ""))
        self._arm(message.run_id, between)
        try:
            self._delivered(message, fate)
        finally:
            self.store.clear()

    def deliver_held(self, index: int, fate: str) -> None:
        """Deliver the pool's message ``index`` while a pass in another process holds its
        run: the delivery's pass leaves a mark (a delivered step's settle written before
        it); the holder then passes again before it lets go (here: a wake of the run)."""
        if not self.pool.messages:
            return
        message = self.pool.messages[index % len(self.pool.messages)]
        run_id = message.run_id
        # The mark the delivery leaves names its step (a settle's, a timer's wake): the
        # holder's next pass reads it (``release_or_take_marks``).
        marked = message.step_name if message.kind in ("run", "step") else ""
        leases = self.engine.leases
        held = leases.acquire(keys.run_lease_key(run_id), "a-pass-elsewhere", LEASE_MS)
        if held is None:  # held already (cannot be, between rules): deliver as usual
            self.deliver(index, fate)
            return
        self.note(f"hold {run_id} elsewhere")
        try:
            self.deliver(index, fate)
        except LeaseTakenError:
            pass  # a wake of the held run: it left its mark
        finally:
            leases.release(held)
            self.pool.messages.append(Message("run", run_id, marked))

    def deliver_ahead(self, index: int) -> None:
        """Deliver the pool's timer ``index`` (among its timers) in a process whose estimate
        of the clock runs ``AHEAD_MS`` ahead: it fires that much before its step is due on
        the world's clock, and the wake it sends is delivered on the world's clock."""
        timers = [m for m in self.pool.messages if m.kind == "timer"]
        if not timers:
            return
        self.tick()
        message = timers[index % len(timers)]
        self.pool.messages.remove(message)
        self.note(f"deliver {message} in a process {AHEAD_MS} ms ahead")
        self.time.ms = max(self.time.ms, message.due_ms - AHEAD_MS)
        self.clock.ahead = AHEAD_MS
        try:
            self.engine.fire_timer(message.run_id, message.step_name, self.pool)
        finally:
            self.clock.ahead = 0

    def _delivered(self, message: Message, fate: str) -> None:
        if message.kind == "run":
            self._pass(message.run_id, message.step_name or None)
        elif message.kind == "timer":
            self.time.ms = max(self.time.ms, message.due_ms)
            self.engine.fire_timer(message.run_id, message.step_name, self.pool)
        else:
            self.fate = fate
            definition = self.engine.registry.steps[message.function]
            try:
                self.engine.execute_step(definition, message.run_id, message.step_name,
                                         self.pool, expected=message.expected)
            except WorkerDied:
                pass
            except WorkflowStepSupersededError:
                pass  # a later attempt owns the step: this one is fenced out
            finally:
                self.fate = "ok"

    def _pass(self, run_id: str, step_name: str | None = None) -> None:
        self.engine.advance(run_id, self.pool, step_name=step_name)

    def drain(self, limit: int = 200) -> None:
        """Deliver everything in the pool, first in first out, every body succeeding (timers
        too: the clock jumps to them), until nothing is left."""
        for _ in range(limit):
            if not self.pool.messages:
                return
            self.deliver(0, "ok")

    def drain_kinds(self, kind: str, limit: int = 20) -> None:
        """Deliver the pool's messages of ``kind`` only, first in first out, until none is
        left (an example test's setup: the passes, the steps left waiting)."""
        for _ in range(limit):
            index = next((i for i, m in enumerate(self.pool.messages) if m.kind == kind), None)
            if index is None:
                return
            self.deliver(index, "ok")

    def advance_clock(self, ms: int) -> None:
        self.tick(ms)
        self.note(f"clock +{ms} ms")

    def sweep(self) -> None:
        self.tick()
        self.note("sweep")
        self.engine.reap(self.pool)

    def pass_run(self, index: int, between: str | None = None) -> None:
        """A pass of a run (a wake from anywhere); ``between``: as for ``cancel``, should
        the pass end the run."""
        run_id = self.run_at(index)
        if run_id is None:
            return
        self.tick()
        self._arm(run_id, between)
        self.note(f"pass {run_id}" + (f" with a {between} inside its end" if between else ""))
        try:
            self._pass(run_id)
        finally:
            self.store.clear()

    def _arm(self, run_id: str, between: str | None) -> None:
        """``between="retry@<method>"``: a retry of the run lands right before the store's
        next ``<method>`` call (an end's fence, ``cancel_steps``; the slot's return,
        ``give_slot``)."""
        if between is not None and between.startswith("retry@"):
            self.store.before(between.split("@")[1], lambda: self._retry_inside(run_id))

    def cancel(self, index: int, between: str | None, among: tuple[str, ...] = ()) -> None:
        """Cancel a run; ``between="retry@cancel_steps"``: a retry of it lands between the
        cancel's end of the run and its fence of the steps; ``"retry@give_slot"``: before
        the cancel gives the run's slot back."""
        run_id = self.run_at(index, among)
        if run_id is None:
            return
        self.tick()
        self._arm(run_id, between)
        self.note(f"cancel {run_id}" + (f" with a {between} between" if between else ""))
        try:
            self.engine.cancel(run_id, "model")
        finally:
            self.store.clear()

    def _retry_inside(self, run_id: str) -> None:
        self.note(f"  retry {run_id} -> {self.engine.retry(run_id)}")

    def _sweep_inside(self) -> None:
        self.note(f"  sweep {self.engine.reap(self.pool)}")

    def retry(self, index: int, between: str | None, among: tuple[str, ...] = ()) -> None:
        """Retry a run; ``between="sweep"``: a reaper sweep lands between the retry's slot
        and its revival of the run (the seam is ``retry_run``); ``between="pass"``: on
        MongoDB, where the revival and the reopen of the steps are two writes, a pass of
        the run lands between them (elsewhere the retry is one step: no seam)."""
        run_id = self.run_at(index, among)
        if run_id is None:
            return
        self.tick()
        if between == "sweep":
            self.store.before("retry_run", self._sweep_inside)
        before = self._attempts_run(run_id)
        restore = self._pass_before_reopen(run_id) if between == "pass" else None
        try:
            done = self.engine.retry(run_id)
        finally:
            self.store.clear()
            if restore is not None:
                restore()
        if done:
            self.model.retried[run_id] = before
        self.note(f"retry {run_id}" + (f" with a {between} between" if between else "")
                  + f" -> {done}")

    def _attempts_run(self, run_id: str) -> dict[str, int]:
        """How many attempts of each step have a history entry (attempts that ran)."""
        counts: dict[str, int] = {}
        for entry in self.inner.get_history(run_id):
            counts[entry.step_name] = counts.get(entry.step_name, 0) + 1
        return counts

    def _pass_before_reopen(self, run_id: str) -> Callable[[], None] | None:
        inner: Any = self.inner
        if not hasattr(inner, "_reopen_owed") or "_reopen_steps" in vars(inner):
            return None  # the in-memory store: the retry is one step under its lock
        reopen = inner._reopen_steps

        def a_pass_first(rid: str, now_ms: int) -> Any:
            del inner._reopen_steps  # once: the pass itself may finish the reopen
            self.note(f"  a pass of {rid} between the retry's writes")
            with contextlib.suppress(PikkuError):
                self._pass(rid)
            return reopen(rid, now_ms)
        inner._reopen_steps = a_pass_first

        def restore() -> None:
            vars(inner).pop("_reopen_steps", None)
        return restore

    def fork(self, index: int, step: int, keep: bool, target: int | None) -> None:
        """Fork a run from one of its recorded steps (``step``, modulo their count), into a
        new run id, or (``target``) into the id of a run the world started."""
        source = self.run_at(index)
        if source is None:
            return
        steps = [s.step_name for s in self.inner.list_steps(source)]
        if not steps:
            return
        self.tick()
        from_step = steps[step % len(steps)]
        model = self.model
        if target is None:
            self.counter += 1
            new_id = f"f{self.counter:03d}"
        else:
            new_id = model.order[target % len(model.order)]
        kwargs: dict[str, Any] = {"keep_decisions": keep} if self.fork_keeps else {}
        keep = keep and self.fork_keeps
        before = {rid: self._steps_of(rid) for rid in {source, new_id}}
        existed = self.inner.get_run(new_id) is not None
        self.note(f"fork {source} from {from_step!r} into {new_id}"
                  + (" (an existing run)" if existed else "") + (" keeping" if keep else ""))
        try:
            made = self.pikku.fork(source, from_step=from_step, new_run_id=new_id, **kwargs)
        except PikkuError as exc:  # refused (a conflict): nothing may have changed
            self.note(f"  refused: {type(exc).__name__}: {exc}")
            made = None
        again = model.forks.get((source, from_step, keep)) == new_id
        for rid, steps_before in before.items():
            if rid == made and not existed:
                continue
            if rid == made and again:
                continue
            if 6 not in self.skip and self._steps_of(rid) != steps_before:
                raise self.violation(f"6. fork of {source} from {from_step!r} into {new_id} "
                                f"changed run {rid}, which it did not create: "
                                f"{steps_before} -> {self._steps_of(rid)} ({self.log[-1]})")
        if made is None:
            return
        if not existed:
            model.forks[(source, from_step, keep)] = made
            model.order.append(made)
            model.copied[made] = {s.step_name for s in self.inner.list_steps(made)}
            model.kept_decisions[made] = keep

    def _steps_of(self, run_id: str) -> list[tuple[Any, ...]]:
        return [(s.step_name, s.status, s.attempt, s.result)
                for s in self.inner.list_steps(run_id)]

    def send(self, index: int, key: str | None, among: tuple[str, ...] = ()) -> None:
        run_id = self.run_at(index, among)
        if run_id is None:
            return
        self.tick()
        self.counter += 1
        payload = f"{run_id}:paid:{self.counter}"
        run = self.inner.get_run(run_id)
        assert run is not None
        try:
            event = self.pikku.send_event(run_id, "paid", payload, key=key)
        except WorkflowEventLimitError:
            kept = len(self.inner.list_events(run_id))
            self.note(f"send paid to {run_id} key={key}: refused at the limit ({kept} kept)")
            if kept < MAX_EVENTS:
                raise self.violation(f"5. a send to run {run_id} holding {kept} events was "
                                     f"refused for the limit of {MAX_EVENTS}") from None
            return
        except WorkflowEventError:
            self.note(f"send paid to {run_id} key={key}: refused ({run.status})")
            if run.status not in RUN_TERMINAL:
                raise self.violation(f"5. a send to live run {run_id} was refused") from None
            return
        self.note(f"send paid to {run_id} key={key} -> seq {event.seq}")
        if len(self.inner.list_events(run_id)) > MAX_EVENTS:
            raise self.violation(f"5. run {run_id} keeps more than {MAX_EVENTS} events")
        model = self.model
        if key is None:
            model.sends[run_id] = model.sends.get(run_id, 0) + 1
        else:
            model.keyed.setdefault(run_id, set()).add(key)
        model.payloads.setdefault(run_id, set()).add(event.payload)

    def approve(self, index: int, decision: str) -> None:
        run_id = self.run_at(index)
        if run_id is None:
            return
        self.tick()
        try:
            self.pikku.approve(run_id, "ok", decision)
            self.note(f"approve {run_id} {decision}")
        except PikkuError as exc:
            self.note(f"approve {run_id}: refused ({type(exc).__name__})")

    def schedule_tick(self, firers: int) -> None:
        """The clock to the schedule's next tick, then ``firers`` workers fire it."""
        self.tick()
        next_ms = None
        for _ in range(firers):
            found = self.scheduler.fire_due(every_tick=False)
            next_ms = found if next_ms is None else next_ms
        for run in self.inner.list_runs(workflow=APPROVAL, limit=1000):
            if run.schedule is not None and run.run_id not in self.model.order:
                self.model.order.append(run.run_id)
        self.note(f"schedule tick by {firers} firer(s)")
        if next_ms is not None:
            self.time.ms = max(self.time.ms, next_ms)

    def admit(self, key: str) -> None:
        self.tick()
        self.note(f"admit {key}")
        self.engine.runs.admission.admit(slot_id(ORDER, key), self.pool)
