"""A model-based test over the operations (issue 31, contract section 7).

Hypothesis chooses a sequence of the operations a user and the system perform: start (the
limited workflow with a key, its waits with no limit, the approval, the parent of a child),
a message delivered (a pass, a timer, a step whose body succeeds, fails or dies, maybe
delivered twice, maybe while a pass elsewhere holds its run), the clock moving (leases
lapse, timeouts pass), a reaper sweep, a pass of any run, cancel (a retry landing inside its
fence window, or not), retry (a sweep landing between its slot and its revival, or not),
fork (with and without ``keep_decisions``, into a new id or an existing one), send_event
(keyed, unkeyed, to an ended run, past the run's limit on kept events), approve, a schedule
tick (one or two firers), an admit. After every rule the world's state is checked against
the promises of section 7 (``tests/property/ops_world.py``: each failure names the
invariant's number), and three of ours: every end of a run wakes those waiting for it (8),
a retried run never fails again on a step it did not run again (9), and a live run's sleep
or timed gate always has a timer on its way or its wake (10; a timer may be delivered in a
process whose clock runs ahead). Runs on the in-memory
store and on the real ``mongod`` (there a retry is two writes, and a pass may land between
them: ``between="pass"``).

    ./dev test tests/property/test_operations_model.py                   # CI: seeded, bounded
    PIKKU_HYPOTHESIS_PROFILE=long ./dev test tests/property/test_operations_model.py -n 0

The CI profile is derandomized (the same examples every run, about 30 s for both stores on
the project's 2-core machine); the long one is random and many times larger. The shrunk
sequences the machine found (defects 1-4 of issue 31 on the code before their fixes, and
two it found after them) are kept as example tests at the end, each failing without its
fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pikku_celery.store.base import WorkflowStore
from pikku_celery.store.memory import InMemoryWorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.conftest import mongo_database
from tests.property.ops_checks import KEYS, ORDER
from tests.property.ops_world import APPROVAL, CHILD, COLLECT, LEASE_MS, PARENT, World

LONG = os.environ.get("PIKKU_HYPOTHESIS_PROFILE") == "long"
_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much]
CI_SETTINGS = settings(max_examples=300, stateful_step_count=30, derandomize=True,
                       deadline=None, database=None, print_blob=True,
                       suppress_health_check=_HEALTH)
LONG_SETTINGS = settings(max_examples=3000, stateful_step_count=60, derandomize=False,
                         deadline=None, database=None, print_blob=True,
                         suppress_health_check=_HEALTH)
# On mongod an example costs about 0.6 s (every check reads every run): far fewer there.
CI_MONGOD = settings(CI_SETTINGS, max_examples=10, stateful_step_count=25)


def chosen(kind: str) -> settings:
    if LONG:
        return settings(LONG_SETTINGS, max_examples=LONG_SETTINGS.max_examples
                        // (10 if kind == "mongod" else 1))
    return CI_MONGOD if kind == "mongod" else CI_SETTINGS


runs = st.integers(min_value=0, max_value=7)  # a run the world started (modulo their count)
fates = st.sampled_from(["ok", "ok", "fail", "ok", "die"])
timeouts = st.sampled_from([None, None, "30s"])
# A retry landing inside an end: before its fence of the steps, or before its slot's return.
inside_an_end = st.sampled_from([None, None, "retry@cancel_steps", "retry@give_slot"])


class OperationsMachine(RuleBasedStateMachine):
    """The rules are the operations; ``promises_hold`` runs after each. ``skip`` names
    invariants not checked and ``seams`` the operations that may land inside another's window
(every one in the test: an exploration past a known defect narrows them)."""

    make_store: Callable[[], WorkflowStore] = InMemoryWorkflowStore
    skip: frozenset[int] = frozenset()
    seams: frozenset[str] = frozenset({"retry", "sweep", "pass"})  # the ``between`` operations

    def __init__(self) -> None:
        super().__init__()
        self.world: World | None = None

    @initialize()
    def begin(self) -> None:
        self.world = World(type(self).make_store())
        self.world.skip = type(self).skip

    @property
    def w(self) -> World:
        assert self.world is not None
        return self.world

    def has_runs(self) -> bool:
        return self.world is not None and bool(self.world.model.order)

    def seam(self, between: str | None) -> str | None:
        return between if between is not None and between.split("@")[0] in self.seams \
            else None

    def has_messages(self) -> bool:
        return self.world is not None and bool(self.world.pool.messages)

    # --- starts ---------------------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS), timeout=timeouts)
    def start_order(self, key: str, timeout: str | None) -> None:
        self.w.start(ORDER, {"k": key, "t": timeout})

    @rule(timeout=timeouts, workflow=st.sampled_from([COLLECT, APPROVAL, PARENT]))
    def start_other(self, timeout: str | None, workflow: str) -> None:
        self.w.start(workflow, {"t": timeout})

    # --- what workers do (twice the weight: runs must get somewhere) ------------------------

    @precondition(has_messages)
    @rule(index=st.integers(min_value=0, max_value=9), fate=fates, twice=st.booleans())
    def deliver(self, index: int, fate: str, twice: bool) -> None:
        self.w.deliver(index, fate, duplicate=twice and fate == "ok")

    @precondition(has_messages)
    @rule(index=st.integers(min_value=0, max_value=9), fate=fates, between=inside_an_end)
    def deliver_again(self, index: int, fate: str, between: str | None) -> None:
        self.w.deliver(index, fate, between=self.seam(between))

    @precondition(has_messages)
    @rule(index=st.integers(min_value=0, max_value=9), fate=fates)
    def deliver_held(self, index: int, fate: str) -> None:
        self.w.deliver_held(index, fate)

    @precondition(has_messages)
    @rule(index=st.integers(min_value=0, max_value=9))
    def deliver_ahead(self, index: int) -> None:
        self.w.deliver_ahead(index)

    @precondition(has_messages)
    @rule()
    def drain(self) -> None:
        self.w.drain()

    # Hypothesis picks among rules about uniformly: the operations that compose (drain,
    # cancel, retry) get a second rule each (a cancel of a live run, a retry of an ended
    # one), or most examples would never retry a run that waited on something.
    @precondition(has_messages)
    @rule()
    def drain_again(self) -> None:
        self.w.drain()

    @rule(ms=st.sampled_from([1_000, LEASE_MS + 1, 31_000]))
    def clock(self, ms: int) -> None:
        self.w.advance_clock(ms)

    @rule()
    def sweep(self) -> None:
        self.w.sweep()

    @precondition(has_runs)
    @rule(run=runs, between=inside_an_end)
    def pass_run(self, run: int, between: str | None) -> None:
        self.w.pass_run(run, self.seam(between))

    # --- what users do ----------------------------------------------------------------------

    @precondition(has_runs)
    @rule(run=runs, between=inside_an_end)
    def cancel(self, run: int, between: str | None) -> None:
        self.w.cancel(run, self.seam(between))

    @precondition(has_runs)
    @rule(run=runs, between=inside_an_end)
    def cancel_live(self, run: int, between: str | None) -> None:
        self.w.cancel(run, self.seam(between), among=("queued", "running", "suspended"))

    @precondition(has_runs)
    @rule(run=runs, between=st.sampled_from([None, "sweep", "pass"]))
    def retry(self, run: int, between: str | None) -> None:
        self.w.retry(run, self.seam(between))

    @precondition(has_runs)
    @rule(run=runs, between=st.sampled_from([None, "sweep", "pass"]))
    def retry_ended(self, run: int, between: str | None) -> None:
        self.w.retry(run, self.seam(between), among=("failed", "cancelled"))

    @precondition(has_runs)
    @rule(run=runs, step=st.integers(min_value=0, max_value=5), keep=st.booleans(),
          into=st.sampled_from([None, None, None, 0, 1, 2]))
    def fork(self, run: int, step: int, keep: bool, into: int | None) -> None:
        self.w.fork(run, step, keep, into)

    @precondition(has_runs)
    @rule(run=runs, key=st.sampled_from([None, None, "k1", "k2"]))
    def send_event(self, run: int, key: str | None) -> None:
        self.w.send(run, key)

    @precondition(has_runs)
    @rule(run=runs, key=st.sampled_from([None, None, "k1"]))
    def send_event_live(self, run: int, key: str | None) -> None:
        self.w.send(run, key, among=("queued", "running", "suspended"))

    @precondition(has_runs)
    @rule(run=runs, decision=st.sampled_from(["yes", "no"]))
    def approve(self, run: int, decision: str) -> None:
        self.w.approve(run, decision)

    @rule(firers=st.sampled_from([1, 2]))
    def schedule_tick(self, firers: int) -> None:
        self.w.schedule_tick(firers)

    @rule(key=st.sampled_from(KEYS))
    def admit(self, key: str) -> None:
        self.w.admit(key)

    @invariant()
    def promises_hold(self) -> None:
        if self.world is not None:
            self.world.check()

    def teardown(self) -> None:
        if self.world is not None:
            self.world.close()


@pytest.fixture
def mongod_factory(mongo_server: Any) -> Iterator[Callable[[], WorkflowStore]]:
    """A fresh store per example on one database of this test, emptied between examples
    (a database per example would cost its index builds every time)."""
    db, client = mongo_database("mongod", mongo_server)
    MongoWorkflowStore(db).create_indexes()

    def make() -> WorkflowStore:
        for name in db.list_collection_names():
            db[name].delete_many({})
        return MongoWorkflowStore(db, create_indexes=False)

    yield make
    client.drop_database(db.name)  # type: ignore[attr-defined]
    client.close()  # type: ignore[attr-defined]


def factory_of(kind: str, request: pytest.FixtureRequest) -> Callable[[], WorkflowStore]:
    if kind == "memory":
        return InMemoryWorkflowStore
    made: Callable[[], WorkflowStore] = request.getfixturevalue("mongod_factory")
    return made


@pytest.mark.timeout(3600 if LONG else 900)
@pytest.mark.parametrize("kind", ["memory", "mongod"])
def test_every_operation_in_every_state_keeps_the_promises(
        kind: str, request: pytest.FixtureRequest) -> None:
    machine = type(f"OperationsMachine_{kind}", (OperationsMachine,),
                   {"make_store": staticmethod(factory_of(kind, request))})
    run_state_machine_as_test(machine, settings=chosen(kind))


# --- the sequences the machine found on the code before issue 31's fixes (shrunk) ---------

@pytest.fixture(params=["memory", "mongod"])
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    made = World(factory_of(request.param, request)())
    yield made
    made.close()


def _status(world: World, run_id: str) -> str:
    run = world.inner.get_run(run_id)
    assert run is not None
    return run.status


def _a_failed_order(world: World) -> None:
    """An order run whose first step failed both its attempts: the run failed."""
    world.start(ORDER, {"k": "a", "t": None})
    world.deliver(0, "ok")  # the pass sends reserve
    world.deliver(0, "fail")
    world.deliver(0, "ok")  # the retry delay's timer
    world.deliver(0, "fail")  # for good: the run fails
    assert _status(world, "r001") == "failed"


def test_defect_1_a_retried_event_wait_waits(world: World) -> None:
    """Invariant 3: a cancel while the run waits for an event, then a retry; the wait was
    made due at once and the next pass went on with its default."""
    world.start(ORDER, {"k": "a", "t": None})
    world.drain()
    world.cancel(0, None)
    world.retry(0, None)
    world.drain()
    world.check()
    assert _status(world, "r001") == "suspended"


def test_defect_2_a_fork_takes_its_own_first_event(world: World) -> None:
    """Invariant 5: a fork kept the source's event wait (with the source's seq 1), and
    its own event seq 1 was counted as taken: the fork's next wait never saw it."""
    world.start(ORDER, {"k": "a", "t": None})
    world.drain()
    world.send(0, None)
    world.drain()  # the first wait took seq 1; ship ran; the second wait waits
    world.cancel(0, None)  # its slot free for the fork
    world.fork(0, 2, True, None)  # from "ship", keeping the decided wait
    fork = world.model.order[-1]
    world.drain()
    world.send(1, None)
    world.drain()
    world.check()
    assert _status(world, fork) == "completed"


def test_defect_3_a_sweep_inside_a_retry_leaves_the_limit_whole(world: World) -> None:
    """Invariant 4: a retry took the slot of a failed run, a sweep gave it back (its
    holder had ended), then the retry revived the run holding none and a second run of
    the key was admitted beside it."""
    _a_failed_order(world)
    world.retry(0, "sweep")
    world.check()
    world.start(ORDER, {"k": "a", "t": None})
    world.drain()
    world.check()


def test_defect_4_a_retry_inside_a_cancel_stands(world: World) -> None:
    """Invariants 2 and 4: a retry between the cancel's end of the run and its fence; the
    fence failed what the retry reopened and the cancel gave back the revived run's slot
    (and on 552e306, whose fence was guarded, the cancel still gave the slot back)."""
    world.start(ORDER, {"k": "a", "t": None})
    world.cancel(0, "retry@cancel_steps")
    world.check()
    world.drain()
    world.check()
    world.start(ORDER, {"k": "a", "t": None})
    world.drain()
    world.check()


def test_a_retry_inside_a_failure_keeps_its_slot(world: World) -> None:
    """Invariant 4: a retry landing between a pass's write of the run's failure and its
    return of the slot (found by the machine on 552e306, whose fix of defect 4 guarded the
    fence but not the slot's return; fixed by e059f3b)."""
    world.start(ORDER, {"k": "a", "t": None})
    world.deliver(0, "ok")  # the pass sends reserve
    world.deliver(0, "fail")  # attempt 1 fails: its retry is due in a second
    world.deliver(0, "ok")  # the timer
    world.deliver(0, "fail", between="retry@give_slot")  # for good: the run fails
    world.check()
    world.drain()
    world.check()


def test_a_retried_child_step_keeps_its_first_attempt(world: World) -> None:
    """Invariant 1 (and contract 2.9, one history entry per attempt): a parent cancelled
    while its step waits on a child run, then retried: the step is parked again as attempt
    2, and the child's end must settle attempt 2, never rewrite the cancelled attempt 1
    (found by the machine on f7e4b2d: ``store._settle.waiting_fields`` closed attempt 1;
    fixed by 2bb782e)."""
    world.start(PARENT, {"t": None})
    world.deliver(0, "ok")  # the parent's pass parks "kid" on its child run
    world.cancel(0, None)
    world.retry(0, None)
    world.drain()
    world.check()
    kid = [(h.attempt, h.status) for h in world.inner.get_history("r001")
           if h.step_name == "kid"]
    assert kid == [(1, "failed"), (2, "succeeded")]


def test_calls_settling_while_their_run_is_held_elsewhere(world: World) -> None:
    """Every invariant, through the path a gather's calls take when a pass elsewhere holds
    their run (issue 34 item 3): the first call leaves a mark, writes its settle and marks
    again; the second, having seen the run held a moment ago, writes its settle first and
    marks once. The run ends with both results, each recorded once."""
    world.start(PARENT, {"t": None})
    world.drain_kinds("run")  # the parent's pass starts the child; the child's sends x, y
    calls = sorted(m.step_name for m in world.pool.messages if m.kind == "step")
    assert calls == ["x", "y"], world.pool.messages
    busy = world.engine.passes.busy
    for name in calls:
        index = next(i for i, m in enumerate(world.pool.messages) if m.step_name == name)
        world.deliver_held(index, "ok")
        world.check()
    child = next(r.run_id for r in world.inner.list_runs(limit=10) if r.workflow == CHILD)
    assert busy.likely_held(child)
    world.drain()
    world.check()
    assert world.inner.get_run("r001").status == "completed"
    assert {s.step_name: s.status for s in world.inner.list_steps(child)} == {
        "x": "succeeded", "y": "succeeded"}


def test_a_pass_between_a_retrys_writes_does_not_fail_it_again(world: World) -> None:
    """Invariant 9: on MongoDB a pass landing between the retry's revival of the run and
    its reopen of the steps replayed the failed step as the run's outcome and failed it
    again (the chaos run of seed 20261210; fixed by 63ee9f2). In memory the retry is one
    step: the same sequence with no seam."""
    _a_failed_order(world)
    world.retry(0, "pass")
    world.check()
    world.drain()
    world.check()
    assert _status(world, "r001") != "failed"


def test_a_timer_that_fired_ahead_of_its_pass_is_armed_again(world: World) -> None:
    """Invariant 10: an event wait's timeout timer fired in a process whose clock ran
    ahead, and the pass it woke, on the world's clock, found the wait not expired yet:
    nothing was left to wake the run (seen as a run left waiting on its sleep in
    ``test_on_rabbitmq_steps_run_in_place_are_one_trace_per_run`` under load; fixed by
    ``gates.rearm_early_wakes``). Then the timeout ends the wait, once."""
    world.start(ORDER, {"k": "a", "t": "30s"})
    world.deliver(0, "ok")  # the pass sends reserve
    world.deliver(0, "ok")  # reserve; the next pass waits for "paid", its timer armed
    timers = [m for m in world.pool.messages if m.kind == "timer"]
    assert [m.step_name for m in timers] == ["__event:paid"], world.pool.messages
    world.deliver_ahead(0)
    world.deliver(0, "ok")  # the wake, on the world's clock: not expired yet
    world.check()
    world.drain()
    world.check()
    paid = world.inner.get_step("r001", "__event:paid")
    assert paid is not None and paid.status == "succeeded" and paid.result["timed_out"]


def test_a_retried_runs_timed_wait_has_its_timer_again(world: World) -> None:
    """Invariant 10: a run cancelled while it waited for an event with a timeout, its
    timer delivered on the ended run, then retried: the wait was reopened with its own
    deadline and no timer, so only a reaper sweep would have timed it out (found by the
    long profile; fixed in ``engine.reopen.send_reopened``)."""
    world.start(COLLECT, {"t": "30s"})
    world.pass_run(0)
    world.cancel(0, None)
    world.drain()
    world.retry(0, None)
    world.check()
    world.drain()
    world.check()
    paid = world.inner.get_step("r001", "__event:paid")
    assert paid is not None and paid.status == "succeeded" and paid.result["timed_out"]
