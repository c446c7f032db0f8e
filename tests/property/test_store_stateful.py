"""Stateful property tests of the store and the claim layer (issue 21 (b)).

Hypothesis chooses the order of: claims by several workers (each its own ``Claimer`` and
heartbeat: separate processes), a claim with another party's operation landing between the
claim's read and its write, heartbeat beats, settles (success, failure with a retry), worker
deaths, the clock moving (leases lapse), the engine's cancel split between its read and its
writes, a pass ending the run with steps left over (the same split), a pass recording a late
step, a child run created in two halves (step, then run), and reaper sweeps. After every rule
the contract's invariants are checked (``tests/property/store_world.py``); the operations
assert the rest. Runs on the in-memory store and on the real ``mongod``.

    ./dev test tests/property/test_store_stateful.py                     # CI: seeded, bounded
    PIKKU_HYPOTHESIS_PROFILE=long ./dev test tests/property/test_store_stateful.py

The CI profile is derandomized (the same examples every run); the long one is random and
many times larger. Shrunk failures found by the machine are kept as example tests at the end.
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
from tests.property.store_world import LATE, LEASE_MS, STEPS, World

LONG = os.environ.get("PIKKU_HYPOTHESIS_PROFILE") == "long"
WORKERS = 3

CI_SETTINGS = settings(max_examples=200, stateful_step_count=25, derandomize=True,
                       deadline=None, database=None, print_blob=True,
                       suppress_health_check=[HealthCheck.too_slow,
                                              HealthCheck.filter_too_much])
LONG_SETTINGS = settings(max_examples=2000, stateful_step_count=50, derandomize=False,
                         deadline=None, database=None, print_blob=True,
                         suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.filter_too_much])
# mongod examples cost a few milliseconds per rule (round trips): fewer of them in CI.
CI_MONGOD = settings(CI_SETTINGS, max_examples=100)


def chosen(kind: str) -> settings:
    if LONG:
        return settings(LONG_SETTINGS, max_examples=LONG_SETTINGS.max_examples
                        // (4 if kind == "mongod" else 1))
    return CI_MONGOD if kind == "mongod" else CI_SETTINGS


workers = st.integers(min_value=0, max_value=WORKERS - 1)
names = st.sampled_from([STEPS[0], *STEPS, LATE])  # "a" twice as often
ticks = st.sampled_from([LEASE_MS + 1, LEASE_MS // 2, LEASE_MS + 1, 1_000])
window_ops = st.sampled_from([None, "beat", None, "succeed", "fail", "cancel", "finish"])


class StoreMachine(RuleBasedStateMachine):
    """Rules are the world's operations; ``contract_holds`` runs after each."""

    make_store: Callable[[], WorkflowStore] = InMemoryWorkflowStore
    children = True  # the child-run rules (off: explore the rest past a child defect)

    def __init__(self) -> None:
        super().__init__()
        self.world: World | None = None

    @initialize()
    def start(self) -> None:
        self.world = World(type(self).make_store(), workers=WORKERS)

    @property
    def w(self) -> World:
        assert self.world is not None
        return self.world

    @rule(w=workers, name=names, between=window_ops)
    def claim(self, w: int, name: str, between: str | None) -> None:
        # With ``between``, that operation lands between the claim's read and its write:
        # made by the worker holding the step (a renewal, a settle), or a cancel, or a
        # pass ending the run.
        self.w.claim(w, name, between=between)

    @precondition(lambda self: self.world is not None and bool(self.world.lapsed()))
    @rule(w=workers, between=st.sampled_from(["beat", "succeed", "beat", "fail", None,
                                              "cancel"]))
    def redeliver_lapsed(self, w: int, between: str | None) -> None:
        """The reaper's re-dispatch of a step whose lease lapsed, delivered to a worker
        with nothing in hand (``w`` or the next such), with the step's own (stale, maybe
        still alive) worker renewing or settling inside the reclaim's window, or a cancel
        landing there."""
        world = self.w
        idle = [i % WORKERS for i in range(w, w + WORKERS)
                if world.workers[i % WORKERS].held is None]
        if idle:
            world.claim(idle[0], world.lapsed()[0], between=between)

    # Hypothesis picks among rules uniformly: claims, the clock and re-deliveries get a
    # second rule each, so that runs are not mostly ended before their steps are claimed.
    @rule(w=workers, name=names, between=window_ops)
    def claim_again(self, w: int, name: str, between: str | None) -> None:
        self.claim(w, name, between)

    @rule(ms=ticks)
    def tick_again(self, ms: int) -> None:
        self.w.tick(ms)

    @precondition(lambda self: self.world is not None and bool(self.world.lapsed()))
    @rule(w=workers, between=st.sampled_from(["beat", "succeed", "beat", "fail", None,
                                              "cancel"]))
    def redeliver_lapsed_again(self, w: int, between: str | None) -> None:
        self.redeliver_lapsed(w, between)

    @rule(w=workers)
    def beat(self, w: int) -> None:
        self.w.beat(w)

    @rule(w=workers, success=st.booleans())
    def settle(self, w: int, success: bool) -> None:
        self.w.settle(w, success)

    @rule(w=workers)
    def die(self, w: int) -> None:
        self.w.die(w)

    @rule(ms=ticks)
    def tick(self, ms: int) -> None:
        self.w.tick(ms)

    # What the rest of the system does to the run: the engine's cancel (its fence's read
    # and its writes split), a pass ending the run with steps left over (its fence split the
    # same way), a pass recording a late step, a pass starting a child run in two halves
    # (the parked step, then the run), a reaper sweep.

    # Ending the run is made rarer (``now`` drawn true one time in three): an ended run
    # refuses every claim, and most examples would otherwise end before any lease lapsed.
    @rule(now=st.sampled_from([False, True, False]))
    def cancel_begin(self, now: bool) -> None:
        if now:
            self.w.cancel_begin()

    @rule()
    def cancel_finish(self) -> None:
        self.w.cancel_finish()

    @rule(status=st.sampled_from(["completed", "failed"]),
          now=st.sampled_from([False, True, False]))
    def finish(self, status: str, now: bool) -> None:
        if now:
            self.w.finish(status)

    @rule()
    def record_late_step(self) -> None:
        self.w.record_late_step()

    @precondition(lambda self: self.children)
    @rule()
    def record_child_step(self) -> None:
        self.w.record_child_step()

    @precondition(lambda self: self.children)
    @rule()
    def create_child(self) -> None:
        self.w.create_child()

    @rule()
    def sweep(self) -> None:
        self.w.sweep()

    @invariant()
    def contract_holds(self) -> None:
        if self.world is not None:
            self.world.check()

    def teardown(self) -> None:
        if self.world is not None:
            for worker in self.world.workers:
                for held in worker.claimer.heartbeat.held():
                    worker.claimer.heartbeat.remove(held)


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


# A failing case is shrunk before it is reported: on mongod that took two minutes.
@pytest.mark.timeout(3600 if LONG else 900)
@pytest.mark.parametrize("kind", ["memory", "mongod"])
def test_store_and_claim_layer_under_every_interleaving(kind: str,
                                                        request: pytest.FixtureRequest) -> None:
    factory: Callable[[], WorkflowStore] = (
        InMemoryWorkflowStore if kind == "memory" else request.getfixturevalue("mongod_factory"))
    machine = type(f"StoreMachine_{kind}", (StoreMachine,),
                   {"make_store": staticmethod(factory)})
    run_state_machine_as_test(machine, settings=chosen(kind))
