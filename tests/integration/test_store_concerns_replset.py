"""The store's concerns and deadlines on a real replica set that loses its majority (issue 20,
item 5): a primary-secondary-arbiter set (two ``mongod`` data nodes and an arbiter, started
once for this module) whose secondary is SIGSTOPped keeps its primary (the arbiter's vote)
but can no longer acknowledge a majority write, the case the README used to leave open.

What each test proves, and what it fails without:
- a write without its majority ends at the default ``wtimeout`` (without it: blocked until
  the set heals), and its unknown outcome is recorded once when the set heals;
- a read at the default ``majority`` concern never sees a write a failover then rolls back
  (with ``local`` reads the same read returns the doomed write);
- a settle gives up by its lease's deadline, not the 10 s ``wtimeout`` (without the
  deadline: one try takes the whole ``wtimeout``), and a heartbeat renewal ends within a
  third of the lease;
- a settle sent to a primary that stopped answering (SIGSTOP) ends by its lease's deadline
  (without the deadline pymongo waits ~20 s for its monitor to give the server up).

``PIKKU_TEST_MONGO_URL`` (an external server) skips the module: it needs nodes it can stop.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pymongo
import pymongo.errors
import pytest

from pikku_celery import InMemoryLeaseService, MongoWorkflowStore
from pikku_celery.engine.claims import Claimed, Claimer
from pikku_celery.engine.heartbeat import Heartbeat
from pikku_celery.model.clock import ServerClock
from pikku_celery.model.errors import WorkflowStepSupersededError
from pikku_celery.store import _concerns
from pikku_celery.store.base import NewRun, NewStep
from tests.support.mongod import MongodNode, MongodReplicaSet, mongod_binary

SLACK_S = 2.5  # a loaded 2-core machine: scheduling, the election, thread start-up


@dataclass
class PSA:
    replset: MongodReplicaSet
    data: list[MongodNode]

    def primary(self) -> MongodNode:
        return self.replset.wait_for_primary(60)

    def secondary(self) -> MongodNode:
        primary = self.primary()
        return next(n for n in self.data if n is not primary)

    def heal(self) -> None:
        """Every node running, a primary, and a majority write acknowledged again."""
        for node in self.replset.nodes:
            node.signal(signal.SIGCONT)
            if not node.alive():
                node.start()
        self.primary()
        until = time.monotonic() + 60
        client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
            self.replset.url, w="majority", wtimeoutMS=2000, serverSelectionTimeoutMS=5000)
        with client:
            while True:
                try:
                    client.pikku_probe.heal.insert_one({"at": time.time()})
                    states = {m["stateStr"] for m in client.admin.command(
                        "replSetGetStatus")["members"]}
                    if states <= {"PRIMARY", "SECONDARY", "ARBITER"}:
                        return
                except pymongo.errors.PyMongoError:
                    pass
                if time.monotonic() > until:
                    raise RuntimeError("the set did not heal within 60 s")
                time.sleep(0.2)


@pytest.fixture(scope="module")
def psa() -> Iterator[PSA]:
    replset = MongodReplicaSet(2).start()
    try:
        binary = mongod_binary()
        assert binary is not None
        arbiter = MongodNode(binary, replset.name, replset.workdir)
        data = list(replset.nodes)
        replset.nodes.append(arbiter)  # stopped with the set
        arbiter.start()
        with replset.primary().client(serverSelectionTimeoutMS=5000) as client:
            # MongoDB 5.0+ refuses an arbiter that would change the implicit default write
            # concern unless a cluster-wide one is set; the store names its own anyway.
            client.admin.command("setDefaultRWConcern",
                                 defaultWriteConcern={"w": "majority"})
            until = time.monotonic() + 30
            while True:
                config = client.admin.command("replSetGetConfig")["config"]
                config["version"] += 1
                config["members"].append({"_id": 2, "host": arbiter.host,
                                          "arbiterOnly": True})
                try:
                    client.admin.command("replSetReconfig", config)
                    break
                except pymongo.errors.OperationFailure:  # the arbiter not answering yet
                    if time.monotonic() > until:
                        raise
                    time.sleep(0.2)
        found = PSA(replset, data)
        found.heal()
        yield found
    finally:
        replset.stop()


@pytest.fixture
def healthy(psa: PSA) -> Iterator[PSA]:
    psa.heal()
    yield psa
    psa.heal()  # whatever a test left stopped


def _store(psa: PSA, **options: Any) -> MongoWorkflowStore:
    url = psa.replset.url_for(f"pikku_psa_{uuid.uuid4().hex[:10]}")
    return MongoWorkflowStore.from_url(url, **options)


def _running_step(store: MongoWorkflowStore, lease_ms: int = 60_000) -> tuple[str, int]:
    """A run with one step claimed as attempt 1 (on the healthy set)."""
    run_id = f"r-{uuid.uuid4().hex[:8]}"
    now = int(time.time() * 1000)
    store.create_run(NewRun(run_id, "wf", None), now)
    store.insert_step(NewStep(run_id=run_id, step_name="s", function="f", max_attempts=2),
                      now)
    claimed = store.claim_step(run_id, "s", "f", now, lease_ms, worker="w1")
    assert claimed.state is not None and claimed.state.attempt == 1
    return run_id, now


def _timed(call: Callable[[], Any], wait_s: float, release: Callable[[], None]
           ) -> tuple[float, BaseException | None, Any]:
    """Run ``call`` in a thread; how long it took and what it raised or returned. A call
    still running after ``wait_s`` fails the test, after ``release`` (the set healed) let it
    end."""
    out: dict[str, Any] = {}

    def target() -> None:
        started = time.monotonic()
        try:
            out["value"] = call()
        except BaseException as exc:  # reported to the test
            out["error"] = exc
        out["took"] = time.monotonic() - started

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(wait_s)
    if thread.is_alive():
        release()
        thread.join(60)
        pytest.fail(f"the call was still blocked after {wait_s:.0f} s")
    return out["took"], out.get("error"), out.get("value")


def _claimer(store: MongoWorkflowStore) -> Claimer:
    leases = InMemoryLeaseService()
    clock = ServerClock(leases)
    return Claimer(store, leases, clock, Heartbeat(store, leases, clock), host="test")


def test_a_write_without_its_majority_ends_at_the_default_wtimeout(healthy: PSA) -> None:
    store = _store(healthy)
    run_id, now = _running_step(store)
    healthy.secondary().signal(signal.SIGSTOP)
    default_s = _concerns.DEFAULT_WTIMEOUT_MS / 1000
    took, error, _ = _timed(lambda: store.set_result(run_id, "s", 1, "done", now + 1),
                            default_s + 10, healthy.heal)
    assert isinstance(error, pymongo.errors.WTimeoutError), error
    assert default_s - 0.5 <= took <= default_s + SLACK_S
    # Unknown, not lost: applied on the primary, it is recorded (once) when the set heals.
    healthy.heal()
    step = store.get_step(run_id, "s")
    assert step is not None and (step.status, step.attempt, step.result) == (
        "succeeded", 1, "done")
    assert [(a.attempt, a.status) for a in store.get_history(run_id)] == [(1, "succeeded")]
    with pytest.raises(WorkflowStepSupersededError):  # the same write again: fenced
        store.set_result(run_id, "s", 1, "done", now + 2)
    store.db.client.close()


def test_a_majority_read_never_sees_a_write_a_failover_rolls_back(healthy: PSA) -> None:
    """The store's reads (``majority``) report the step still running while its settle
    waits for a majority it never gets; the primary then fails, the secondary is elected
    without the settle, and the settle is rolled back: the majority read was the truth. A
    ``local`` read on the same primary reported the settle, which a pass would have acted
    on (moving the run on from a result that no longer exists)."""
    store = _store(healthy, write_concern={"w": "majority", "wtimeout": 500})
    local = MongoWorkflowStore(store.db.client.get_database(
        store.db.name, read_concern=_concerns.read_concern("local")))
    run_id, now = _running_step(store)
    primary, secondary = healthy.primary(), healthy.secondary()
    # Killed, not paused: a paused node finds the write in its socket's buffer on waking.
    secondary.kill()
    with pytest.raises(pymongo.errors.WTimeoutError):
        store.set_result(run_id, "s", 1, "done", now + 1)
    seen = store.get_step(run_id, "s")
    assert seen is not None and (seen.status, seen.attempt) == ("running", 1)
    read = store.read_run(run_id, all_steps=True)
    assert [(s.step_name, s.status) for s in read.steps] == [("s", "running")]
    assert [s.status for s in store.find_unsettled_steps([run_id])] == ["running"]
    doomed = local.get_step(run_id, "s")
    assert doomed is not None and doomed.status == "succeeded"  # what local reads act on
    # The failover: the primary stalls, the secondary restarts and is elected (with the
    # arbiter's vote) without the write.
    primary.signal(signal.SIGSTOP)
    secondary.start()
    assert healthy.replset.wait_for_primary(60, not_node=primary) is secondary
    healthy.heal()  # the old primary wakes, steps down and rolls its write back
    after = store.get_step(run_id, "s")
    assert after is not None and (after.status, after.attempt) == ("running", 1)
    # Fenced as ever: the attempt's lease lapses and the next claim is attempt 2.
    late = now + 120_000
    reclaimed = store.claim_step(run_id, "s", "f", late, 60_000, worker="w2")
    assert reclaimed.state is not None and reclaimed.state.attempt == 2
    store.db.client.close()


def test_a_settle_without_its_majority_gives_up_by_its_lease_deadline(healthy: PSA) -> None:
    """Default concerns (10 s ``wtimeout``), a 3 s lease: the settle's tries end by the
    lease's deadline and it raises a timeout (its outcome unknown), never reporting success
    and never waiting the whole ``wtimeout``. When the set heals the outcome it wrote is the
    step's, once, and the same attempt's settle again is refused."""
    store = _store(healthy)
    claimer = _claimer(store)
    run_id, _ = f"r-{uuid.uuid4().hex[:8]}", None
    now = int(time.time() * 1000)
    store.create_run(NewRun(run_id, "wf", None), now)
    store.insert_step(NewStep(run_id=run_id, step_name="s", function="f", max_attempts=2),
                      now)
    lease_ms = 3000
    claimed = claimer.claim(run_id, "s", "f", lease_ms)
    assert isinstance(claimed, Claimed)
    try:
        healthy.secondary().signal(signal.SIGSTOP)
        took, error, _ = _timed(lambda: claimer.succeed(claimed, "done"), 30, healthy.heal)
        assert isinstance(error, pymongo.errors.PyMongoError) and error.timeout, error
        assert took <= lease_ms / 1000 + SLACK_S, took
        assert claimer.heartbeat.held() == []
        healthy.heal()
        step = store.get_step(run_id, "s")
        assert step is not None and (step.status, step.attempt, step.result) == (
            "succeeded", 1, "done")
        with pytest.raises(WorkflowStepSupersededError):
            store.set_result(run_id, "s", 1, "again", now + 5)
    finally:
        claimer.heartbeat.stop()
        store.db.client.close()


def test_a_heartbeat_renewal_without_its_majority_ends_within_a_third_of_the_lease(
        healthy: PSA) -> None:
    store = _store(healthy)
    claimer = _claimer(store)
    run_id = f"r-{uuid.uuid4().hex[:8]}"
    now = int(time.time() * 1000)
    store.create_run(NewRun(run_id, "wf", None), now)
    store.insert_step(NewStep(run_id=run_id, step_name="s", function="f"), now)
    lease_ms = 6000
    claimed = claimer.claim(run_id, "s", "f", lease_ms)
    assert isinstance(claimed, Claimed)
    heartbeat = claimer.heartbeat
    heartbeat.remove(claimed.held)  # beaten by the test alone, not the thread
    try:
        healthy.secondary().signal(signal.SIGSTOP)
        took, error, _ = _timed(lambda: heartbeat.beat([claimed.held]), 30, healthy.heal)
        assert error is None  # a failed renewal is logged, never raised
        assert took <= lease_ms / 3000 + SLACK_S, took
        assert not claimed.held.lost.is_set()  # kept until its last confirmed deadline
    finally:
        heartbeat.stop()
        healthy.heal()
        store.db.client.close()


def test_a_settle_sent_to_a_stalled_primary_ends_by_its_lease_deadline(
        healthy: PSA) -> None:
    """A primary that stops answering (SIGSTOP: a paused VM) with the socket still open:
    the settle's deadline ends the wait; the outcome is unknown (here: never applied, the
    set elects the secondary, which cannot reach a majority either while the old primary
    sleeps). Without the deadline the call waits ~20 s for pymongo's monitor."""
    store = _store(healthy)
    claimer = _claimer(store)
    run_id = f"r-{uuid.uuid4().hex[:8]}"
    now = int(time.time() * 1000)
    store.create_run(NewRun(run_id, "wf", None), now)
    store.insert_step(NewStep(run_id=run_id, step_name="s", function="f", max_attempts=2),
                      now)
    lease_ms = 4000
    claimed = claimer.claim(run_id, "s", "f", lease_ms)
    assert isinstance(claimed, Claimed)
    try:
        healthy.primary().signal(signal.SIGSTOP)
        took, error, _ = _timed(lambda: claimer.succeed(claimed, "done"), 40, healthy.heal)
        assert isinstance(error, pymongo.errors.PyMongoError) and error.timeout, error
        assert took <= lease_ms / 1000 + SLACK_S, took
    finally:
        claimer.heartbeat.stop()
        healthy.heal()
    # Whatever became of the write, the step holds one outcome of attempt 1 or none yet.
    step = store.get_step(run_id, "s")
    assert step is not None and step.attempt == 1 and step.status in ("running", "succeeded")
    with contextlib.suppress(WorkflowStepSupersededError):
        store.set_result(run_id, "s", 1, "done", now + 5)
    history = store.get_history(run_id)
    assert [(a.attempt, a.status) for a in history] == [(1, "succeeded")]
    store.db.client.close()
