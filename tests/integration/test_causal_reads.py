"""The Dekker pairs of a run's end hold across an election (issue 21's last finding).

A run's end and a claim each write, then read what the other wrote (``store._ended``). On
one primary a majority read after a majority write sees it; right after an election the new
primary serves majority reads from a commit point that can be behind what the old primary
acknowledged, and the read misses the other side. The chaos run at seed 20261203 saw the
same thing as a run read as missing just after a step-down. The store runs each thread's
calls in a causally consistent session (``MongoWorkflowStore._causally``), so such a read
waits until the new primary's snapshot covers the thread's own write.

The stale snapshot is made deterministic with MongoDB's ``disableSnapshotting`` failpoint on
the node about to be elected: its majority snapshot stays where it was while the old
primary's writes replicate to it. A thread lifts the failpoint a few seconds after the
election, so a read that waits (the fix) returns the current state, and a read that does not
wait (without the fix) returns the frozen one, which each test would then fail on:

- the ender's side: a run ended on the old primary, its steps fenced on the new one; without
  the session ``cancel_steps`` reads the step as pending (frozen), its guard matches nothing
  and the attempt another worker claimed keeps running on a cancelled run;
- the claim's side: a step claimed on the old primary after the run ended, its run read on
  the new one; without the session the claim reads the run as running and lets the body run.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo.errors import OperationFailure

from pikku_celery import MongoWorkflowStore
from pikku_celery.model.errors import WorkflowStepSupersededError
from pikku_celery.model.records import RUN_CANCELLED, RUN_RUNNING, STEP_FAILED, STEP_RUNNING
from pikku_celery.store.base import NewRun, NewStep
from tests.support.mongod import MongodNode, MongodReplicaSet

LEASE_MS = 60_000
LIFT_AFTER_S = 3.0  # well past the read that must wait, however loaded the machine


@pytest.fixture
def store(mongod_replset3: MongodReplicaSet) -> Iterator[MongoWorkflowStore]:
    db = f"pikku_causal_{uuid.uuid4().hex[:8]}"
    made = MongoWorkflowStore.from_url(mongod_replset3.url_for(db), heartbeatFrequencyMS=500)
    yield made
    made.db.client.drop_database(db)
    made.db.client.close()


def _now() -> int:
    return int(time.time() * 1000)


def _freeze(node: MongodNode, mode: str) -> None:
    with node.client() as client:
        client.admin.command("configureFailPoint", "disableSnapshotting", mode=mode)


@contextlib.contextmanager
def _frozen(node: MongodNode) -> Iterator[None]:
    """``node``'s majority snapshot stays put while the failpoint is on (always lifted)."""
    _freeze(node, "alwaysOn")
    try:
        yield
    finally:
        _freeze(node, "off")


def _replicated(rs: MongodReplicaSet, node: MongodNode, store: MongoWorkflowStore) -> None:
    """Wait until ``node``'s majority snapshot has what the store wrote so far (the setup's
    writes must be in the snapshot the failpoint then freezes)."""
    marker = uuid.uuid4().hex
    store.db["causal_markers"].insert_one({"_id": marker})
    deadline = time.monotonic() + 30
    with node.client(readConcernLevel="majority") as client:
        while client[store.db.name]["causal_markers"].find_one({"_id": marker}) is None:
            assert time.monotonic() < deadline, f"{node.host} did not catch up"
            time.sleep(0.05)


def _elect(rs: MongodReplicaSet, node: MongodNode, store: MongoWorkflowStore) -> None:
    """Make ``node`` primary and wait until the store's client routes to it.

    A step-up can lose its election ("Election failed.", code 125) when a voter has not yet
    seen the candidate catch up or is still in the previous election's term: MongoDB's own
    answer is to ask again, so this does until a deadline."""
    deadline = time.monotonic() + 30
    with node.client() as client:
        while True:
            try:
                client.admin.command("replSetStepUp")
                break
            except OperationFailure as exc:
                if exc.code != 125 or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    rs.wait_for_primary(30)
    deadline = time.monotonic() + 30
    want = ("127.0.0.1", node.port)
    while store.db.client.primary != want:
        assert time.monotonic() < deadline, "the store's client never saw the new primary"
        time.sleep(0.05)


def _lift_later(node: MongodNode) -> threading.Timer:
    timer = threading.Timer(LIFT_AFTER_S, _freeze, (node, "off"))
    timer.start()
    return timer


def _run_with_step(store: MongoWorkflowStore) -> tuple[str, str]:
    run_id, step = f"r-{uuid.uuid4().hex[:8]}", "charge"
    store.create_run(NewRun(run_id=run_id, workflow="wf", input={}), _now())
    store.insert_step(NewStep(run_id=run_id, step_name=step, function="charge", data={}),
                      _now())
    return run_id, step


def _in_thread(call: Any) -> Any:
    """``call`` on a thread of its own: another process's claim or cancel, whose causal
    times are not this thread's."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    thread.join(60)
    assert out, "the call did not return"
    return out[0]


def _secondary(rs: MongodReplicaSet) -> MongodNode:
    primary = rs.primary()
    return next(node for node in rs.nodes if node is not primary)


def test_a_run_end_fences_a_step_claimed_before_it_across_an_election(
        mongod_replset3: MongodReplicaSet, store: MongoWorkflowStore) -> None:
    rs = mongod_replset3
    run_id, step = _run_with_step(store)
    successor = _secondary(rs)
    _replicated(rs, successor, store)
    with _frozen(successor):
        # Another worker claims the step: its claim reads the run as live, rightly.
        claimed = _in_thread(lambda: store.claim_step(run_id, step, "charge", _now(),
                                                      LEASE_MS))
        assert claimed.state is not None and claimed.state.attempt == 1
        # This thread (the canceller) ends the run on the old primary, then the set elects
        # the node whose snapshot still has the step pending.
        assert store.transition_run(run_id, [RUN_RUNNING], RUN_CANCELLED, _now())
        _elect(rs, successor, store)
        timer = _lift_later(successor)
        fenced = store.cancel_steps(run_id, {"type": "WorkflowCancelledError",
                                             "message": "cancelled"}, _now())
        timer.join()
    assert fenced == 1, "the fence read a stale snapshot and missed the running attempt"
    after = store.get_step(run_id, step)
    assert after is not None and after.status == STEP_FAILED and after.lease_expires_at is None


def test_a_claim_after_a_run_end_fences_itself_across_an_election(
        mongod_replset3: MongodReplicaSet, store: MongoWorkflowStore,
        monkeypatch: pytest.MonkeyPatch) -> None:
    rs = mongod_replset3
    run_id, step = _run_with_step(store)
    successor = _secondary(rs)
    _replicated(rs, successor, store)
    elected: list[threading.Timer] = []
    unless_ended = MongoWorkflowStore._unless_run_ended

    def elect_between_write_and_read(self: MongoWorkflowStore, claimed: dict[str, Any],
                                     now_ms: int) -> Any:
        # The claim's write landed on the old primary; its read of the run goes to the
        # new one, whose snapshot predates the run's end.
        _elect(rs, successor, self)
        elected.append(_lift_later(successor))
        return unless_ended(self, claimed, now_ms)

    with _frozen(successor):
        # Another process cancels the run on the old primary (its own fence ran before the
        # claim, so only the claim's half of the pair can catch this one).
        assert _in_thread(lambda: store.transition_run(run_id, [RUN_RUNNING], RUN_CANCELLED,
                                                       _now()))
        monkeypatch.setattr(MongoWorkflowStore, "_unless_run_ended",
                            elect_between_write_and_read)
        result = store.claim_step(run_id, step, "charge", _now(), LEASE_MS)
        monkeypatch.undo()
        for timer in elected:
            timer.join()
    assert elected, "the claim's write did not win"
    assert result.state is None, "the claim read a stale run and let a body run on an ended run"
    after = store.get_step(run_id, step)
    assert after is not None and after.status == STEP_FAILED
    assert after.status != STEP_RUNNING and after.lease_expires_at is None


def test_a_refused_settle_then_reads_its_landed_write_across_an_election(
        mongod_replset3: MongodReplicaSet, store: MongoWorkflowStore) -> None:
    """A settle whose reply was lost is made again and refused (the step is settled); the
    worker then reads the step to tell its own landed write from a newer attempt
    (``Claimer._landed``). That read must see the settle the refusal saw, even on a newly
    elected primary: without it the attempt is told superseded while the store holds its
    result (partition test, netem)."""
    rs = mongod_replset3
    run_id, step = _run_with_step(store)
    claimed = store.claim_step(run_id, step, "charge", _now(), LEASE_MS)
    assert claimed.state is not None and claimed.state.attempt == 1
    successor = _secondary(rs)
    _replicated(rs, successor, store)
    with _frozen(successor):
        # The first try landed, its reply lost: this thread's causal times never saw it.
        _in_thread(lambda: store.set_result(run_id, step, 1, {"paid": True}, _now()))
        with pytest.raises(WorkflowStepSupersededError):
            store.set_result(run_id, step, 1, {"paid": True}, _now())
        _elect(rs, successor, store)
        timer = _lift_later(successor)
        seen = store.get_step(run_id, step)
        timer.join()
    assert seen is not None and (seen.status, seen.attempt, seen.result) == (
        "succeeded", 1, {"paid": True}), "the read after the refusal missed the landed settle"
