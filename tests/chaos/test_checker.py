"""The checker itself: it must flag what it exists to find.

Its evidence is built the way a chaos run builds it: the store writes the documents (a real
``MongoWorkflowStore`` on mongomock, driven through claims, reclaims and settles), bodies
write the ledger, the refusal is the worker's log line. A defect is then planted in the raw
documents as a broken store would leave them, and the checker must name it.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import mongomock

from pikku_celery.model import keys
from pikku_celery.model.errors import WorkflowStepSupersededError
from pikku_celery.store.base import NewRun, NewStep
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.chaos.checker import (
    CLOCK_SLACK_MS,
    ENDED_WINDOW_MS,
    Report,
    _check_oversized,
    _exhausted_by_faults,
    _pass_recovery,
    _recovery,
    check,
)
from tests.chaos.composed import (
    Operations,
    event_fingerprints,
    limit_breaches,
    step_fingerprints,
)
from tests.chaos.faults import FaultEvent

T0 = 1_700_000_000_000
LEASE = 2_000
OFFSET_S = T0 / 1000 - 1_000.0  # monotonic 1000.0 s is T0 on the wall clock
STALE, FRESH = 101, 102  # pids of attempt 1 (paused past its lease) and attempt 2


def mono(ms: int) -> float:
    """The monotonic time of epoch ``ms``."""
    return ms / 1000 - OFFSET_S


class Scene:
    """One order run whose step ``reserve`` lost attempt 1 to a paused worker: attempt 2
    ran and recorded its result, attempt 1 woke up, ended and had its write refused."""

    def __init__(self) -> None:
        self.store = MongoWorkflowStore(mongomock.MongoClient()[f"c_{uuid.uuid4().hex[:8]}"])
        self.db = self.store.db
        self.run_id = str(uuid.uuid4())
        self.store.create_run(NewRun(self.run_id, "chaos.order", {"order": 1}), T0)
        self.store.insert_step(NewStep(run_id=self.run_id, step_name="reserve",
                                       function="chaos.work", max_attempts=4), T0)
        self.inv = keys.invocation_id(self.run_id, "reserve")
        self.store.claim_step(self.run_id, "reserve", "chaos.work", T0, LEASE, worker="h:101")
        self.store.claim_step(self.run_id, "reserve", "chaos.work", T0 + LEASE + 1, LEASE,
                              worker="h:102")
        self.store.set_result(self.run_id, "reserve", 2, self.result(2, FRESH), T0 + LEASE + 500)
        self.store.transition_run(self.run_id, ["running"], "completed", T0 + LEASE + 600)
        self.ledger = [self.body("start", 1, STALE, T0 + 10),
                       self.body("start", 2, FRESH, T0 + LEASE + 2),
                       self.body("end", 1, STALE, T0 + LEASE + 100),  # woke: a stale write
                       self.body("end", 2, FRESH, T0 + LEASE + 400)]
        self.faults = [FaultEvent("pause_worker", mono(T0 + 500), {STALE})]
        self.logs = [f"[WARNING] WorkflowStepSupersededError: "
                     f"{WorkflowStepSupersededError(self.run_id, 'reserve', 1, 2)}"]
        self.alive = {STALE, FRESH}

    def result(self, attempt: int, pid: int) -> dict[str, Any]:
        return {"attempt": attempt, "pid": pid, "invocation": self.inv}

    def body(self, event: str, attempt: int, pid: int, at_ms: int) -> dict[str, Any]:
        return {"event": event, "t": mono(at_ms), "pid": pid, "run": self.run_id,
                "step": "reserve", "attempt": attempt, "invocation": self.inv}

    def check(self, **kwargs: Any) -> Report:
        pikku = SimpleNamespace(engine=SimpleNamespace(store=self.store),
                                get_run=self.store.get_run)
        return check(pikku, {self.run_id: {"order": 1, "fatal": False}}, set(), self.ledger,
                     self.faults, self.logs, 30.0, 30.0, alive_pids=self.alive,
                     wall_offset_s=OFFSET_S, **kwargs)


def flagged(report: Report, fragment: str) -> bool:
    return any(fragment in v for v in report.violations)


def test_a_clean_run_passes_and_counts_the_stale_write() -> None:
    report = Scene().check()
    assert report.violations == []
    assert report.late_writes_refused == 1
    assert report.stale_before_settle == 1  # attempt 1 ended before attempt 2 settled
    assert report.attempts_by_reason == {"pause_worker": 1}


def test_a_superseded_attempt_without_its_own_history_entry_is_flagged() -> None:
    scene = Scene()  # what a reclaim that forgets the fenced attempt's entry leaves behind
    scene.db[keys.STEPS].update_one({"_id": scene.inv}, {"$unset": {"attempts.1": ""}})
    assert flagged(scene.check(), "no history entry written for attempts [1]")


def test_a_result_written_by_the_stale_attempt_is_flagged() -> None:
    scene = Scene()  # a settle filter without the attempt lets attempt 1's write land
    scene.db[keys.STEPS].update_one({"_id": scene.inv},
                                    {"$set": {"result": scene.result(1, STALE)}})
    report = scene.check()
    assert flagged(report, "is not attempt 2's")
    assert flagged(report, "no ledger end for the recorded attempt")


def test_an_attempt_no_fault_explains_is_flagged() -> None:
    scene = Scene()
    scene.faults = []  # attempt 1's worker was alive and never paused: it was robbed
    assert flagged(scene.check(), "a live worker was robbed")


def test_a_dead_process_explains_a_lost_lease() -> None:
    scene = Scene()
    scene.faults, scene.alive = [], {FRESH}  # attempt 1's process is gone (killed)
    assert scene.check().violations == []


def test_a_stale_body_whose_write_was_neither_recorded_nor_refused_is_flagged() -> None:
    scene = Scene()
    scene.logs = []
    assert flagged(scene.check(), "was neither recorded nor refused")


def test_two_recorded_successes_and_too_many_attempts_are_flagged() -> None:
    scene = Scene()
    scene.db[keys.STEPS].update_one({"_id": scene.inv},
                                    {"$set": {"attempts.1.status": "succeeded"}})
    scene.db[keys.STEPS].update_one({"_id": scene.inv}, {"$set": {"max_attempts": 1}})
    report = scene.check()
    assert report.double_recorded == 1
    assert flagged(report, "attempt 2 > 1")
    assert flagged(report, "superseded attempts [1] recorded ['succeeded']")


def test_a_body_that_ran_twice_in_one_attempt_is_flagged() -> None:
    scene = Scene()
    scene.ledger.append(scene.body("start", 2, 103, T0 + LEASE + 3))
    assert flagged(scene.check(), "ran 2 times")


def test_a_stuck_run_is_flagged() -> None:
    scene = Scene()
    scene.db[keys.RUNS].update_one({"_id": scene.run_id}, {"$set": {"status": "running"}})
    report = scene.check()
    assert report.stuck == [scene.run_id] and flagged(report, "stuck running")


def test_a_run_that_never_reached_the_fence_is_flagged_when_it_must() -> None:
    scene = Scene()
    scene.faults = [FaultEvent("kill_worker", mono(T0 + 500), {STALE})]
    scene.logs, scene.ledger = [], scene.ledger[:2] + scene.ledger[3:]  # attempt 1 died
    scene.alive = {FRESH}
    assert scene.check().violations == []
    report = scene.check(require_fence=True)
    assert flagged(report, "no late write refused") and flagged(report, "no pause applied")


def test_faults_that_failed_to_apply_are_reported() -> None:
    report = Scene().check(not_applied=["pause_worker: no live worker mid-step"])
    assert "faults that failed to apply 1: pause_worker: no live worker" in report.summary()


def test_a_slow_recovery_is_flagged() -> None:
    report = Report()
    ledger = [{"event": "start", "t": 1.0, "pid": 7, "invocation": "i", "attempt": 1,
               "step": "s", "run": "r"},
              {"event": "start", "t": 30.0, "pid": 8, "invocation": "i", "attempt": 2,
               "step": "s", "run": "r"}]
    _recovery(ledger, [FaultEvent("kill_worker", 2.0, {7})], 12.5, report)
    assert report.recovery_s == [28.0]
    assert any("came back 28.0s after a kill" in v for v in report.violations)


def test_a_run_stranded_by_a_killed_orchestrator_is_flagged() -> None:
    report = Report()
    ledger = [{"event": "pass", "t": 1.0, "pid": 7, "run": "r"},
              {"event": "pass", "t": 3000.0, "pid": 8, "run": "r"},
              {"event": "pass_end", "t": 3000.1, "pid": 8, "run": "r"}]
    _pass_recovery(ledger, [FaultEvent("kill_orchestrator", 2.0, {7})], 16.0, report)
    assert report.pass_recovery_s == [2998.0]
    assert any("next pass 2998.0s after its orchestrator was killed" in v
               for v in report.violations)


def test_a_run_failed_by_exhausted_attempts_is_accepted_only_when_they_are_spent() -> None:
    def step(attempt: int, error: str) -> dict[str, Any]:
        return {"status": "failed", "attempt": attempt, "max_attempts": 4,
                "error": {"type": error}}

    assert _exhausted_by_faults([step(4, "WorkflowStepLeaseExpiredError")])
    assert not _exhausted_by_faults([step(2, "WorkflowStepLeaseExpiredError")])
    assert not _exhausted_by_faults([step(4, "Fatal")])


def test_a_kill_waits_out_a_mongodb_fault_within_its_bound_and_is_not_counted_quiet() -> None:
    ledger = [{"event": "start", "t": 1.0, "pid": 7, "invocation": "i", "attempt": 1,
               "step": "s", "run": "r"},
              {"event": "start", "t": 20.0, "pid": 8, "invocation": "i", "attempt": 2,
               "step": "s", "run": "r"}]
    stall = FaultEvent("stall_primary", 3.0, end_t=10.0)  # 7 s with no writable primary
    report = Report()
    _recovery(ledger, [FaultEvent("kill_worker", 2.0, {7}), stall], 12.5, report)
    assert report.recovery_s == [18.0] and report.recovery_quiet_s == []
    assert report.violations == []  # 18.0 <= 12.5 + 7.0
    report = Report()
    _recovery(ledger, [FaultEvent("kill_worker", 2.0, {7}),
                       FaultEvent("stall_primary", 3.0, end_t=4.0)], 12.5, report)
    assert any("came back 18.0s after a kill (bound 12.5s + 1.0s" in v
               for v in report.violations)


def _big(attempts: dict[str, Any], status: str = "failed",
         error: str = "InvalidInputError") -> dict[str, Any]:
    return {"_id": "b", "run_id": "r", "step_name": "big", "status": status,
            "attempt": len(attempts), "error": {"type": error}, "attempts": attempts}


def test_an_oversized_outcome_fails_for_good_after_attempts_lost_to_faults_only() -> None:
    lost = {"status": "failed", "error": {"type": "WorkflowStepLeaseExpiredError"}}
    too_big = {"status": "failed", "error": {"type": "InvalidInputError"}}
    report = Report()
    _check_oversized("r", [_big({"1": lost, "2": too_big})], report)
    assert report.violations == []
    _check_oversized("r", [_big({"1": too_big, "2": too_big})], report)
    assert any("was retried after attempts [1]" in v for v in report.violations)
    report = Report()
    _check_oversized("r", [_big({"1": too_big}, status="running")], report)
    assert any("must fail its attempt for good" in v for v in report.violations)



def _compensation_report(steps: list[dict[str, Any]], *, recorded: int) -> Report:
    from tests.chaos.checker import _check_compensation

    raw = [*steps, *({"step_name": "ship:on_error", "status": "succeeded"}
                     for _ in range(recorded))]
    report = Report()
    run = SimpleNamespace(run_id="r", status="failed")
    _check_compensation(run, {"order": 1, "fatal": True}, raw, [], report)
    return report


def test_a_failed_ship_step_owes_exactly_one_compensation() -> None:
    ship_failed = [{"step_name": "reserve", "status": "succeeded"},
                   {"step_name": "ship", "status": "failed"}]
    assert _compensation_report(ship_failed, recorded=1).violations == []
    assert _compensation_report(ship_failed, recorded=0).violations == [
        "run r: compensation recorded 0 times"]


def test_a_run_failed_before_ship_owes_no_compensation() -> None:
    # A fatal order whose 'charge' lost its worker on every attempt fails before 'ship'
    # runs: nothing is compensated (found by the short profile on the replica set).
    exhausted_early = [{"step_name": "reserve", "status": "succeeded"},
                       {"step_name": "charge", "status": "failed"}]
    assert _compensation_report(exhausted_early, recorded=0).violations == []


# --- issue 21: outcomes after a run's end, and a cancelled run's children --------------------

CANCELLED = {"type": "WorkflowCancelledError", "message": "chaos cancel"}


class EndedScene:
    """One order run with one step: the step is claimed, the run is cancelled, and the
    step settles at times each test picks (the store takes whatever clock it is given, so
    a broken store's order of writes is planted by the timestamps)."""

    def __init__(self) -> None:
        self.store = MongoWorkflowStore(mongomock.MongoClient()[f"c_{uuid.uuid4().hex[:8]}"])
        self.db = self.store.db
        self.run_id = str(uuid.uuid4())
        self.store.create_run(NewRun(self.run_id, "chaos.order", {"order": 1}), T0)
        self.specs: dict[str, dict[str, Any]] = {self.run_id: {"order": 1, "fatal": False}}
        self.cancelled = {self.run_id}
        self.ledger: list[dict[str, Any]] = []
        self.cancel_times: dict[str, tuple[int, int]] = {}
        self.faults: list[FaultEvent] = []

    def step(self, name: str, *, claim_ms: int, pid: int = FRESH,
             run_id: str | None = None) -> str:
        run_id = run_id or self.run_id
        self.store.insert_step(NewStep(run_id=run_id, step_name=name, function="chaos.work",
                                       max_attempts=4), T0)
        self.store.claim_step(run_id, name, "chaos.work", claim_ms, LEASE, worker=f"h:{pid}")
        inv = keys.invocation_id(run_id, name)
        self.ledger.append(self.line("start", run_id, name, inv, pid, claim_ms + 5))
        return inv

    def settle(self, name: str, at_ms: int, *, pid: int = FRESH,
               run_id: str | None = None) -> None:
        run_id = run_id or self.run_id
        inv = keys.invocation_id(run_id, name)
        self.ledger.append(self.line("end", run_id, name, inv, pid, at_ms - 5))
        assert self.store.set_result(run_id, name, 1, {"attempt": 1, "pid": pid,
                                                       "invocation": inv}, at_ms)

    def line(self, event: str, run_id: str, name: str, inv: str, pid: int,
             at_ms: int) -> dict[str, Any]:
        return {"event": event, "t": mono(at_ms), "pid": pid, "run": run_id, "step": name,
                "attempt": 1, "invocation": inv}

    def cancel(self, at_ms: int, run_id: str | None = None) -> None:
        """The run's end write alone (the fence of its steps is left to each test)."""
        assert self.store.transition_run(run_id or self.run_id, ["running"], "cancelled",
                                         at_ms, error=CANCELLED)

    def check(self) -> Report:
        pikku = SimpleNamespace(engine=SimpleNamespace(store=self.store),
                                get_run=self.store.get_run)
        return check(pikku, self.specs, self.cancelled, self.ledger, self.faults, [], 30.0,
                     30.0,
                     alive_pids={STALE, FRESH}, wall_offset_s=OFFSET_S,
                     cancel_times=self.cancel_times)


def test_an_outcome_settled_in_the_documented_window_is_counted_not_flagged() -> None:
    scene = EndedScene()
    scene.step("reserve", claim_ms=T0 + 100)  # running when the run ends
    scene.cancel(T0 + 1_000)
    scene.settle("reserve", T0 + 1_300)  # before the fence landed
    report = scene.check()
    assert report.violations == []
    assert report.settled_after_end_ms == [300]
    assert "outcomes recorded after their run ended 1 of 1 ended runs" in report.summary()


def test_an_outcome_recorded_past_the_window_after_the_run_ended_is_flagged() -> None:
    scene = EndedScene()
    scene.step("reserve", claim_ms=T0 + 100)
    scene.cancel(T0 + 1_000)
    scene.settle("reserve", T0 + 1_000 + ENDED_WINDOW_MS + CLOCK_SLACK_MS + 2_000)
    assert flagged(scene.check(), "past the documented window")


def test_the_driver_s_cancel_bounds_the_end_a_later_touch_would_move() -> None:
    scene = EndedScene()
    scene.step("reserve", claim_ms=T0 + 100)
    scene.cancel(T0 + 1_000)
    scene.store.touch_run(scene.run_id, T0 + 60_000)  # $max: the run's updated_ms moves on
    scene.settle("reserve", T0 + 30_000)
    assert scene.check().violations == []  # updated_ms alone hides it
    scene.cancel_times = {scene.run_id: (T0 + 990, T0 + 1_010)}
    assert flagged(scene.check(), "past the documented window")


def test_a_claim_after_the_run_ended_that_ran_its_body_is_flagged() -> None:
    scene = EndedScene()
    scene.step("reserve", claim_ms=T0 + 9_000)  # planted: the claim did not fence itself
    scene.cancel(T0 + 1_000)
    scene.settle("reserve", T0 + 9_500)
    report = scene.check()
    assert flagged(report, "claimed 8000 ms after the run ended and ran its body")
    assert flagged(report, "recorded succeeded 8500 ms after the end")


def test_a_worker_with_a_skewed_wall_clock_stamps_on_the_shared_clock() -> None:
    """pikku stamps with its ServerClock (the lease server's time), so a worker's skewed
    wall clock (its ledger's ``wall``) does not move its stamps: a claim before the end
    stays before it on a slow clock, and a claim after the end is caught on a fast one."""
    for skew in (120_000, -30_000):
        scene = EndedScene()
        scene.step("reserve", claim_ms=T0 + 100, pid=STALE)
        scene.cancel(T0 + 1_000)
        scene.settle("reserve", T0 + 800, pid=STALE)  # before the end
        for line in scene.ledger:
            line["wall"] = line["t"] + OFFSET_S + skew / 1000
        assert scene.check().violations == [], skew
        late = EndedScene()
        late.step("reserve", claim_ms=T0 + 9_000, pid=STALE)  # after the end
        late.cancel(T0 + 1_000)
        late.settle("reserve", T0 + 9_500, pid=STALE)
        for line in late.ledger:
            line["wall"] = line["t"] + OFFSET_S + skew / 1000
        assert flagged(late.check(), "ms after the run ended and ran its body"), skew


def _parent_scene(child_status: str, child_settle_ms: int | None) -> EndedScene:
    scene = EndedScene()
    parent = scene.run_id
    child = keys.child_run_id(parent, "invoice")
    scene.store.insert_step(NewStep(run_id=parent, step_name="invoice",
                                    function="workflow:chaos.invoice", status="running",
                                    child_run_id=child), T0)
    scene.specs = {parent: {"kind": "parent", "expect": "completed"}}
    scene.store.create_run(NewRun(child, "chaos.invoice", {"order": -1},
                                  parent_run_id=parent, parent_step_name="invoice"), T0 + 10)
    scene.step("bill", claim_ms=T0 + 20, run_id=child)
    scene.cancel(T0 + 1_000)
    if child_settle_ms is not None:
        scene.settle("bill", child_settle_ms, run_id=child)
    if child_status != "running":
        assert scene.store.transition_run(child, ["running"], child_status,
                                          (child_settle_ms or T0 + 1_100) + 10,
                                          error=CANCELLED if child_status == "cancelled"
                                          else None)
    return scene


def test_a_cancelled_run_s_child_is_cancelled() -> None:
    report = _parent_scene("cancelled", None).check()
    assert report.violations == [] and report.children_of_cancelled == {"cancelled": 1}
    # a child that had finished before its parent's cancel
    assert _parent_scene("completed", T0 + 500).check().violations == []


def test_a_cancelled_run_s_child_still_running_is_flagged() -> None:
    report = _parent_scene("running", None).check()
    assert flagged(report, "of cancelled run") and flagged(report, "is still running")


def test_a_cancelled_run_s_child_that_ran_on_after_the_cancel_is_flagged() -> None:
    report = _parent_scene("completed", T0 + 30_000).check()
    assert flagged(report, "step 'bill' of completed run") and flagged(
        report, "past the documented window")


def test_a_child_the_cancel_came_before_is_counted_never_created() -> None:
    scene = EndedScene()
    scene.store.insert_step(NewStep(run_id=scene.run_id, step_name="invoice",
                                    function="workflow:chaos.invoice", status="running",
                                    child_run_id=keys.child_run_id(scene.run_id, "invoice")),
                            T0)
    scene.specs = {scene.run_id: {"kind": "parent", "expect": "completed"}}
    scene.cancel(T0 + 1_000)  # the pass creating the child died before it wrote it
    report = scene.check()
    assert report.violations == [] and report.children_of_cancelled == {"never created": 1}


def test_a_child_whose_paused_creation_nothing_stopped_must_exist() -> None:
    scene = EndedScene()
    child = keys.child_run_id(scene.run_id, "invoice")
    scene.store.insert_step(NewStep(run_id=scene.run_id, step_name="invoice",
                                    function="workflow:chaos.invoice", status="running",
                                    child_run_id=child), T0)
    scene.specs = {scene.run_id: {"kind": "parent", "expect": "completed"}}
    scene.ledger.append({"event": "child_creating", "t": mono(T0 + 500), "pid": FRESH,
                         "run": scene.run_id, "child": child, "seconds": 1.0})
    scene.cancel(T0 + 1_000)
    assert flagged(scene.check(), "was never created, though the pass creating it")
    scene.faults = [FaultEvent("kill_worker", mono(T0 + 1_200), {FRESH})]
    report = scene.check()
    assert report.violations == []
    assert report.children_of_cancelled == {"never created (kill_worker stopped its pass)": 1}


# --- issue 26: events, the schedule, the concurrency limit, transactional bookings ------------


def _check(store: MongoWorkflowStore, specs: dict[str, dict[str, Any]],
           ledger: list[dict[str, Any]] | None = None, **kwargs: Any) -> Report:
    pikku = SimpleNamespace(engine=SimpleNamespace(store=store), get_run=store.get_run)
    return check(pikku, specs, set(), ledger or [], [], [], 30.0, 30.0, alive_pids={FRESH},
                 wall_offset_s=OFFSET_S, **kwargs)


def _store() -> MongoWorkflowStore:
    return MongoWorkflowStore(mongomock.MongoClient()[f"c_{uuid.uuid4().hex[:8]}"])


def _gate(store: MongoWorkflowStore, run_id: str, name: str, result: Any, at_ms: int) -> None:
    """A settled gate (an event wait, a publish), as the pass leaves it."""
    store.insert_step(NewStep(run_id=run_id, step_name=name, function=None,
                              status="scheduled", due_ms=None), at_ms)
    store.db[keys.STEPS].update_one({"run_id": run_id, "step_name": name},
                                    {"$set": {"status": "succeeded", "result": result}})


class EventsScene:
    """An events run that waited for 'paid' twice and for 'late' (timeout): the driver sent
    'paid' n=1 before the first wait, then 'paid' n=2 twice with one key; 'late' timed out.
    The run completed with the three payloads."""

    WAITS = [["paid", None], ["paid", None], ["late", 1.0]]

    def __init__(self) -> None:
        self.store = _store()
        self.db = self.store.db
        self.run_id = str(uuid.uuid4())
        self.store.create_run(NewRun(self.run_id, "chaos.awaiter", {}), T0)
        self.sent: list[dict[str, Any]] = []
        self.send("paid", 1, None, T0 + 10)
        self.p = [self.payload(1)]
        _gate(self.store, self.run_id, "__event:paid", self.taken(1, 1), T0 + 100)
        _gate(self.store, self.run_id, "__event:paid#2", self.taken(2, 2), T0 + 200)
        self.send("paid", 2, "k", T0 + 300)
        self.send("paid", 2, "k", T0 + 400)
        _gate(self.store, self.run_id, "__event:late", {"event": "late", "timed_out": True},
              T0 + 500)
        for reach in (1, 2, 3):
            _gate(self.store, self.run_id, "__publish:progress" + ("" if reach == 1 else
                                                                   f"#{reach}"), reach, T0)
        self.output = {"taken": [self.payload(1), self.payload(2), {"timed_out": "late"}]}
        self.store.transition_run(self.run_id, ["running"], "completed", T0 + 2_000,
                                  output=self.output)

    def payload(self, n: int) -> dict[str, Any]:
        return {"n": n, "name": "paid"}

    def taken(self, seq: int, n: int) -> dict[str, Any]:
        return {"seq": seq, "payload": self.payload(n), "sent_at_ms": T0}

    def send(self, name: str, n: int, key: str | None, at_ms: int) -> None:
        event, _ = self.store.send_event(self.run_id, name, self.payload(n), at_ms, key=key)
        self.sent.append({"run": self.run_id, "name": name, "key": key, "n": n,
                          "seq": event.seq, "ambiguous": False, "outcome": "sent"})

    def set_wait(self, step_name: str, result: Any) -> None:
        self.db[keys.STEPS].update_one({"run_id": self.run_id, "step_name": step_name},
                                       {"$set": {"result": result}})

    def check(self) -> Report:
        return _check(self.store, {self.run_id: {"kind": "events", "expect": "completed",
                                                 "waits": self.WAITS}},
                      sent_events=self.sent)


def test_events_taken_once_each_in_the_order_sent_pass() -> None:
    report = EventsScene().check()
    assert report.violations == []
    assert report.events["sends"] == 3 and report.events["kept"] == 2
    assert report.events["keyed sends repeated"] == 1
    assert report.events["waits timed out"] == 1
    assert report.events["taken, sent before the run waited"] == 1  # n=1: before its wait
    assert report.events["taken, sent while the run waited"] == 1


def test_an_event_taken_by_two_waits_is_flagged() -> None:
    scene = EventsScene()
    scene.set_wait("__event:paid#2", scene.taken(1, 1))
    report = scene.check()
    assert flagged(report, "event seq 1 taken by two waits")
    assert flagged(report, "returned")  # its output names another payload than taken


def test_events_taken_out_of_the_order_sent_are_flagged() -> None:
    scene = EventsScene()
    scene.set_wait("__event:paid", scene.taken(2, 2))
    scene.set_wait("__event:paid#2", scene.taken(1, 1))
    assert flagged(scene.check(), "took seqs [2, 1], not the first events sent ([1, 2])")


def test_a_keyed_event_delivered_twice_is_flagged() -> None:
    scene = EventsScene()
    scene.db[keys.EVENTS].insert_one({"_id": "dup", "run_id": scene.run_id, "name": "paid",
                                      "seq": 3, "payload": scene.payload(2), "key": "k",
                                      "sent_ms": T0 + 400, "wake_ms": None})
    report = scene.check()
    assert flagged(report, "keyed event 'k' delivered more than once")
    assert flagged(report, "one send kept twice")
    scene.sent[-1]["seq"] = 3  # the second send with the key was given an event of its own
    assert flagged(scene.check(), "returned seqs [2, 3]")


def test_an_event_lost_or_never_sent_is_flagged() -> None:
    scene = EventsScene()
    scene.db[keys.EVENTS].delete_one({"run_id": scene.run_id, "seq": 1})
    report = scene.check()
    assert flagged(report, "the send of 'paid' n=1 returned seq 1, the store holds None")
    assert flagged(report, "the send n=1 ('paid', key None; sent) was kept 0 times")
    scene = EventsScene()
    scene.sent = scene.sent[1:]  # the store holds an event the driver never sent
    assert flagged(scene.check(), "event seq 1 (paid) was never sent")
    scene = EventsScene()  # a send whose outcome the driver never learnt: kept at most once
    scene.db[keys.EVENTS].insert_one({"_id": "again", "run_id": scene.run_id, "name": "paid",
                                      "seq": 3, "payload": scene.payload(3), "key": None,
                                      "sent_ms": T0 + 600, "wake_ms": None})
    scene.sent.append({"run": scene.run_id, "name": "paid", "key": None, "n": 3, "seq": None,
                       "ambiguous": True, "outcome": "gave up"})
    assert scene.check().violations == []


def test_a_send_without_a_key_kept_twice_is_flagged_even_when_its_call_was_retried() -> None:
    """Issue 31: a send is one event per call, key or no key (its retries are inside the
    call, and the driver re-sends a failed call only when the event was not kept): an
    event kept twice is a violation, whatever failed on the way."""
    scene = EventsScene()
    scene.sent[0]["ambiguous"] = True  # the driver's call failed once before it returned
    scene.db[keys.EVENTS].insert_one({"_id": "again", "run_id": scene.run_id, "name": "paid",
                                      "seq": 3, "payload": scene.payload(1), "key": None,
                                      "sent_ms": T0 + 600, "wake_ms": None})
    report = scene.check()
    assert flagged(report, "the send n=1 ('paid', key None; sent) was kept 2 times")
    assert flagged(report, "one send kept twice (payload n by seq: [1, 2, 1])")


def test_a_refused_send_that_was_kept_is_flagged() -> None:
    scene = EventsScene()
    scene.sent.append({"run": scene.run_id, "name": "paid", "key": None, "n": 3, "seq": None,
                       "ambiguous": False, "outcome": "refused: the run has ended"})
    scene.db[keys.EVENTS].insert_one({"_id": "late", "run_id": scene.run_id, "name": "paid",
                                      "seq": 3, "payload": scene.payload(3), "key": None,
                                      "sent_ms": T0 + 600, "wake_ms": None})
    assert flagged(scene.check(), "the send n=3 ('paid', key None; refused: the run has "
                                  "ended) was kept 1 times")


def test_a_timeout_wait_that_took_an_event_and_a_wrong_output_are_flagged() -> None:
    scene = EventsScene()
    scene.set_wait("__event:late", scene.taken(2, 2))
    report = scene.check()
    assert flagged(report, "though no event 'late' was sent")
    assert flagged(report, "wait '__event:late' took seq 2")
    assert flagged(report, "event seq 2 taken by two waits")
    scene = EventsScene()
    scene.db[keys.RUNS].update_one({"_id": scene.run_id},
                                   {"$set": {"output": {"taken": [scene.payload(1)]}}})
    assert flagged(scene.check(), "returned [{'n': 1, 'name': 'paid'}], its waits took")
    scene = EventsScene()
    scene.db[keys.STEPS].delete_one({"run_id": scene.run_id,
                                     "step_name": "__publish:progress#3"})
    assert flagged(scene.check(), "published progress 2 times, last 2, for 3 waits")


SCHEDULE = {"name": "tick", "every_ms": 2_000, "paused_ms": T0 + 20_000}


def _ticks(ticks: list[int], *, status: str = "completed") -> tuple[MongoWorkflowStore,
                                                                     dict[str, Any]]:
    store = _store()
    specs = {}
    for tick in ticks:
        run_id = keys.scheduled_run_id("tick", tick)
        store.create_run(NewRun(run_id, "chaos.ticked", None, schedule="tick",
                                scheduled_ms=tick), tick)
        if status != "running":
            iso = keys.scheduled_for(run_id).isoformat()  # type: ignore[union-attr]
            store.transition_run(run_id, ["running"], status, tick + 500,
                                 output={"tick": iso})
        specs[run_id] = {"kind": "ticked", "expect": "completed"}
    return store, specs


def test_a_schedule_s_ticks_one_run_each_pass_and_gaps_are_counted() -> None:
    store, specs = _ticks([T0, T0 + 2_000, T0 + 8_000])
    report = _check(store, specs, schedule=SCHEDULE)
    assert report.violations == []
    assert report.ticks["runs"] == 3 and report.ticks["ticks skipped (catch_up latest)"] == 2


def test_a_tick_started_twice_or_under_another_id_is_flagged() -> None:
    store, specs = _ticks([T0, T0 + 2_000])
    twin = "not-a-tick-id"  # a second run for the tick T0, under an id it was not derived from
    store.create_run(NewRun(twin, "chaos.ticked", None, schedule="tick", scheduled_ms=T0), T0)
    store.transition_run(twin, ["running"], "completed", T0 + 500, output={"tick": None})
    specs[twin] = {"kind": "ticked", "expect": "completed"}
    report = _check(store, specs, schedule=SCHEDULE)
    assert flagged(report, f"tick {T0} started 2 runs")
    assert flagged(report, "run not-a-tick-id (tick")


def test_a_tick_run_for_another_tick_unseen_or_after_the_pause_is_flagged() -> None:
    store, specs = _ticks([T0, T0 + 30_000])
    run_id = keys.scheduled_run_id("tick", T0)
    store.db[keys.RUNS].update_one({"_id": run_id}, {"$set": {"output": {"tick": "x"}}})
    store.db[keys.RUNS].update_one({"_id": run_id}, {"$set": {
        "output": {"tick": "2023-11-14T22:13:22+00:00"}}})
    del specs[keys.scheduled_run_id("tick", T0 + 30_000)]
    report = _check(store, specs, schedule=SCHEDULE)
    assert flagged(report, "ran for tick 2023-11-14T22:13:22+00:00")
    assert flagged(report, "was never checked")
    assert flagged(report, "10000 ms after the schedule was paused")


def test_a_tick_run_that_never_ended_is_flagged() -> None:
    store, specs = _ticks([T0], status="running")
    assert flagged(_check(store, specs, schedule=SCHEDULE), "stuck running")


class LimitedScene:
    """Runs of ``chaos.limited`` (limit 1 per key), each one recorded step whose body's
    ledger lines the test places in time."""

    def __init__(self) -> None:
        from pikku_celery.store._slots import slot_id

        self.store = _store()
        self.db = self.store.db
        self.specs: dict[str, dict[str, Any]] = {}
        self.ledger: list[dict[str, Any]] = []
        self.slot = slot_id("chaos.limited", "k0")

    def run(self, name: str, created_ms: int, body: tuple[int, int], *,
            status: str = "completed") -> str:
        run_id = f"{name}-{uuid.uuid4().hex[:6]}"
        self.store.create_run(NewRun(run_id, "chaos.limited", {"key": "k0"}, slot=self.slot),
                              created_ms)
        self.store.insert_step(NewStep(run_id=run_id, step_name="hold", function="chaos.work",
                                       max_attempts=4), body[0])
        self.store.claim_step(run_id, "hold", "chaos.work", body[0], LEASE, worker="h:102")
        inv = keys.invocation_id(run_id, "hold")
        self.store.set_result(run_id, "hold", 1, {"attempt": 1, "pid": FRESH,
                                                  "invocation": inv}, body[1] + 5)
        for event, at in (("start", body[0] + 1), ("end", body[1])):
            self.ledger.append({"event": event, "t": mono(at), "pid": FRESH, "run": run_id,
                                "step": "hold", "attempt": 1, "invocation": inv})
        self.db[keys.RUNS].update_one({"_id": run_id}, {"$set": {"status": status}})
        self.specs[run_id] = {"kind": "limited", "expect": "completed", "key": "k0"}
        return run_id

    def check(self) -> Report:
        return _check(self.store, self.specs, self.ledger)


def test_limited_runs_one_at_a_time_in_order_pass_and_queueing_is_counted() -> None:
    scene = LimitedScene()
    scene.run("a", T0, (T0 + 10, T0 + 1_000))
    scene.run("b", T0 + 5, (T0 + 1_100, T0 + 2_000))  # created while a ran: it waited
    report = scene.check()
    assert report.violations == []
    assert report.limited["runs"] == 2 and report.limited["waited for a slot"] == 1


def test_two_runs_of_a_key_at_once_and_out_of_order_are_flagged() -> None:
    scene = LimitedScene()
    a = scene.run("a", T0, (T0 + 10, T0 + 1_000))
    scene.run("b", T0 + 5, (T0 + 900, T0 + 2_000))
    assert flagged(scene.check(), f"ran while ['{a}'] still ran (limit 1)")
    scene = LimitedScene()
    a = scene.run("a", T0 + 5, (T0 + 10, T0 + 1_000))
    scene.run("b", T0, (T0 + 1_100, T0 + 2_000))  # created first, but admitted after a
    assert flagged(scene.check(), f"started after ['{a}'], created after it")


def test_a_run_left_queued_and_a_slot_held_by_an_ended_run_are_flagged() -> None:
    scene = LimitedScene()
    a = scene.run("a", T0, (T0 + 10, T0 + 1_000))
    b = scene.run("b", T0 + 5, (T0 + 1_100, T0 + 2_000), status="queued")
    scene.db[keys.SLOTS].insert_one({"_id": scene.slot, "workflow": "chaos.limited",
                                     "key": "k0", "holders": [a], "held": 1})
    report = scene.check()
    assert flagged(report, f"limited run {b} (key k0) never left the queue")
    assert flagged(report, "stuck queued")
    assert flagged(report, f"still held by run {a}, which is completed")


def test_a_cancelled_limited_run_s_late_body_is_not_held_against_the_next() -> None:
    scene = LimitedScene()
    scene.run("a", T0, (T0 + 10, T0 + 1_500), status="cancelled")  # freed at its cancel
    scene.run("b", T0 + 5, (T0 + 1_100, T0 + 2_000))
    scene.specs = {r: s for r, s in scene.specs.items()}
    scene.specs[next(iter(scene.specs))]["expect"] = "cancelled"
    assert not flagged(scene.check(), "still ran")


def _booking_scene(attempts: list[int], status: str = "succeeded") -> Report:
    store = _store()
    run_id = str(uuid.uuid4())
    store.create_run(NewRun(run_id, "chaos.limited", {"key": "k0"}), T0)
    store.insert_step(NewStep(run_id=run_id, step_name="book", function="chaos.book",
                              max_attempts=4), T0)
    store.claim_step(run_id, "book", "chaos.book", T0, LEASE, worker="h:102")
    store.claim_step(run_id, "book", "chaos.book", T0 + LEASE + 1, LEASE, worker="h:102")
    inv = keys.invocation_id(run_id, "book")
    if status == "succeeded":
        store.set_result(run_id, "book", 2, {"attempt": 2}, T0 + LEASE + 100)
    store.transition_run(run_id, ["running"], "completed" if status == "succeeded"
                         else "cancelled", T0 + LEASE + 200)
    for attempt in attempts:
        store.db["chaos_bookings"].insert_one({"_id": f"{inv}:{attempt}", "run": run_id,
                                               "attempt": attempt})
    return _check(store, {run_id: {"kind": "limited-bookings", "expect": "completed"
                                   if status == "succeeded" else "cancelled"}})


def test_bookings_of_exactly_the_recorded_attempt_pass() -> None:
    report = _booking_scene([2])
    assert not flagged(report, "bookings of attempts")
    assert report.bookings["steps"] == 1 and report.bookings["bookings"] == 1
    assert not flagged(_booking_scene([], status="running"), "bookings of attempts")


def test_a_booking_of_a_superseded_or_unrecorded_attempt_is_flagged() -> None:
    assert flagged(_booking_scene([1, 2]), "bookings of attempts [1, 2], expected [2]")
    assert flagged(_booking_scene([]), "bookings of attempts [], expected [2]")
    assert flagged(_booking_scene([1], status="running"),
                   "bookings of attempts [1], expected []")


# --- issue 31: retry and fork in the mix (tests/chaos/composed.py) -----------------------------

RETRY_MS = T0 + 10_000  # when the driver retried a run its cancel ended at T0 + 1_000
CANCELLED = {"type": "WorkflowCancelledError", "message": "run cancelled"}


def _raw_step(store: MongoWorkflowStore, run_id: str, name: str, at_ms: int,
              **fields: Any) -> str:
    """A step as a store leaves it, every field written raw (``function`` None: no body)."""
    store.insert_step(NewStep(run_id=run_id, step_name=name, function=None), at_ms)
    step_id = keys.invocation_id(run_id, name)
    store.db[keys.STEPS].update_one({"_id": step_id}, {"$set": fields})
    return step_id


def _entry(status: str, started: int, ended: int | None, error: Any = None) -> dict[str, Any]:
    return {"status": status, "started_ms": started, "ended_ms": ended, "error": error,
            "worker": f"h:{FRESH}", "task_id": None}


class RetriedScene:
    """An order run whose step 'reserve' ran attempt 1 when the driver cancelled the run
    (T0 + 1 s: the cancel's fence failed it); the driver retried the run (T0 + 10 s), its
    attempt 2 succeeded and the run completed."""

    def __init__(self) -> None:
        self.store = _store()
        self.db = self.store.db
        self.run_id = str(uuid.uuid4())
        self.store.create_run(NewRun(self.run_id, "chaos.order", {"order": 1}), T0)
        self.inv = keys.invocation_id(self.run_id, "reserve")
        self.store.insert_step(NewStep(run_id=self.run_id, step_name="reserve",
                                       function="chaos.work", max_attempts=4), T0)
        self.db[keys.STEPS].update_one({"_id": self.inv}, {"$set": {
            "status": "succeeded", "attempt": 2, "max_attempts": 8, "worker": f"h:{FRESH}",
            "started_ms": RETRY_MS + 100, "updated_ms": RETRY_MS + 500,
            "result": {"attempt": 2, "pid": FRESH, "invocation": self.inv},
            "attempts": {"1": _entry("failed", T0 + 10, T0 + 1_000, CANCELLED),
                         "2": _entry("succeeded", RETRY_MS + 100, RETRY_MS + 500)}}})
        self.set_run("completed", RETRY_MS + 1_000)
        self.ledger = [{"event": event, "t": mono(at), "pid": FRESH, "run": self.run_id,
                        "step": "reserve", "attempt": attempt, "invocation": self.inv}
                       for event, attempt, at in (("start", 1, T0 + 20),
                                                  ("start", 2, RETRY_MS + 110),
                                                  ("end", 2, RETRY_MS + 490))]
        self.ops = Operations(retries={self.run_id: [
            {"before": RETRY_MS, "after": RETRY_MS + 10, "done": True, "status": "cancelled",
             "end_ms": T0 + 1_000}]})
        self.cancels = {self.run_id: (T0 + 990, T0 + 1_000)}

    def set_run(self, status: str, at_ms: int) -> None:
        self.db[keys.RUNS].update_one({"_id": self.run_id}, {"$set": {
            "status": status, "updated_ms": at_ms}})

    def check(self) -> Report:
        pikku = SimpleNamespace(engine=SimpleNamespace(store=self.store),
                                get_run=self.store.get_run)
        return check(pikku, {self.run_id: {"order": 1, "fatal": False}}, {self.run_id},
                     self.ledger, [], [], 30.0, 30.0, alive_pids={FRESH},
                     wall_offset_s=OFFSET_S, cancel_times=self.cancels, operations=self.ops)


def test_a_run_retried_after_its_cancel_passes_and_its_new_attempt_is_explained() -> None:
    report = RetriedScene().check()
    assert report.violations == []
    assert report.attempts_by_reason == {"the run's end, then a retry": 1}
    assert report.operations["runs retried"] == 1
    assert report.operations["order runs retried after cancelled, then completed"] == 1


def test_a_run_retried_after_its_cancel_that_ends_cancelled_is_flagged() -> None:
    scene = RetriedScene()  # the retry ran it again: nothing but its own end may stop it
    scene.set_run("cancelled", RETRY_MS + 1_000)
    assert flagged(scene.check(), "ended cancelled, expected ['completed']")
    scene.cancels[scene.run_id] = (RETRY_MS + 900, RETRY_MS + 1_000)  # cancelled again
    assert scene.check().violations == []


def test_a_step_failed_by_the_fence_of_the_end_a_retry_undid_is_flagged() -> None:
    scene = RetriedScene()  # issue 31, defect 4: the cancel's fence landed after the retry
    scene.db[keys.STEPS].update_one({"_id": scene.inv}, {"$set": {
        "status": "failed", "error": CANCELLED, "result": None,
        "attempts.2": _entry("failed", RETRY_MS + 100, RETRY_MS + 500, CANCELLED)}})
    scene.ledger = scene.ledger[:2]
    scene.set_run("failed", RETRY_MS + 1_000)
    report = scene.check()
    assert flagged(report, "failed by a cancel (run cancelled) though no cancel came after "
                           "the retry")


def test_a_step_claimed_between_a_run_s_end_and_its_retry_is_flagged() -> None:
    scene = RetriedScene()  # a claim after the cancel ran its body before the retry
    step_id = _raw_step(scene.store, scene.run_id, "charge", T0, status="succeeded",
                        attempt=1, result={}, started_ms=T0 + 5_000,
                        attempts={"1": _entry("succeeded", T0 + 5_000, T0 + 5_100)})
    scene.ledger.append({"event": "start", "t": mono(T0 + 5_001), "pid": FRESH,
                         "run": scene.run_id, "step": "charge", "attempt": 1,
                         "invocation": step_id})
    report = scene.check()
    assert flagged(report, "step 'charge' attempt 1 was claimed 4000 ms after the run ended, "
                           "before its retry")


def test_event_waits_a_retry_ended_at_once_are_flagged() -> None:
    """Issue 31, defect 1: a reopened wait waits again, until its own deadline."""
    scene = EventsScene()  # 'late' timed out at T0 + 500, its expiry T0 + 5_000
    scene.db[keys.STEPS].update_one({"run_id": scene.run_id, "step_name": "__event:late"},
                                    {"$set": {"data": {"event": "late",
                                                       "expires_at_ms": T0 + 5_000}}})
    scene.db[keys.STEPS].update_one({"run_id": scene.run_id, "step_name": "__event:paid#2"},
                                    {"$set": {"data": {"event": "paid", "expires_at_ms": None},
                                              "result": {"event": "paid", "timed_out": True}}})
    specs = {scene.run_id: {"kind": "events", "expect": "completed", "waits": scene.WAITS}}
    report = _check(scene.store, specs, sent_events=scene.sent, operations=Operations())
    assert flagged(report, "wait '__event:late' of events run")
    assert flagged(report, "timed out 4500 ms before its own expiry")
    assert flagged(report, "wait '__event:paid#2' of events run")
    assert flagged(report, "has no timeout, yet it timed out")
    scene = EventsScene()  # the default of a wait without a timeout: no event, no timeout
    scene.set_wait("__event:paid#2", None)
    assert flagged(scene.check(), "wait '__event:paid#2' settled with None: no event")


def _approval_scene(gate_result: Any, approved_ms: int) -> tuple[Report, str]:
    store = _store()
    run_id = str(uuid.uuid4())
    store.create_run(NewRun(run_id, "chaos.approver", {}), T0)
    _raw_step(store, run_id, "__approval:go", T0, status="succeeded", result=gate_result,
              updated_ms=T0 + 3_000)
    store.transition_run(run_id, ["running"], "completed", T0 + 4_000,
                         output={"decision": gate_result})
    ops = Operations(approvals={run_id: [{"decision": {"n": 5}, "before": approved_ms,
                                          "after": approved_ms + 50, "outcome": "recorded"}]})
    return _check(store, {run_id: {"kind": "approver", "expect": "completed"}},
                  operations=ops), run_id


def test_an_approval_holds_a_decision_the_driver_gave_after_it_gave_it() -> None:
    report, _ = _approval_scene({"n": 5}, T0 + 2_900)
    assert report.violations == []
    assert report.operations["approvals given"] == 1
    report, _ = _approval_scene({"expired": True}, T0 + 2_900)  # decided by nobody
    assert flagged(report, "its gate holds {'expired': True}, a decision the driver never "
                           "gave")
    report, _ = _approval_scene({"n": 5}, T0 + 6_000)  # decided before it was given
    assert flagged(report, "its gate was decided 3000 ms before the driver gave the decision")


def test_limit_breaches_at_one_moment_are_named() -> None:
    slots = [{"_id": "g", "holders": ["a"]}]
    assert limit_breaches([{"_id": "a", "slot": "g", "status": "running"}], slots, 1,
                          "t+1s") == []
    found = limit_breaches([{"_id": "a", "slot": "g", "status": "running"},
                            {"_id": "b", "slot": "g", "status": "suspended"}], slots, 1, "t+1s")
    assert found == ["t+1s: run b is suspended in life 0 holding no slot of its group g "
                     "(holders ['a'])",
                     "t+1s: group g has 2 live runs ['a', 'b'], limit 1"]
    retried = {"_id": "a", "slot": "g", "status": "running", "lineage": [{"op": "retry"}]}
    assert limit_breaches([retried], [{"_id": "g", "holders": ["a #1"]}], 1, "t+2s") == []
    assert limit_breaches([retried], slots, 1, "t+2s") == [  # its ended life's slot only
        "t+2s: run a is running in life 1 holding no slot of its group g (holders ['a'])"]
    report = _check(_store(), {}, operations=Operations(breaches=found, samples=3))
    assert flagged(report, "limit breached: t+1s: group g has 2 live runs")
    assert report.operations["limit samples"] == 3


def test_a_retried_limited_run_s_lives_are_each_held_to_the_limit() -> None:
    scene = LimitedScene()  # a: cancelled at T0 + 1 s (its body settled in the window),
    a = scene.run("a", T0, (T0 + 10, T0 + 1_500))  # retried at T0 + 2.5 s; b ran between
    scene.run("b", T0 + 5, (T0 + 1_100, T0 + 2_000))
    inv = keys.invocation_id(a, "book")
    _raw_step(scene.store, a, "book", T0 + 2_600, status="succeeded", attempt=1,
              result={"attempt": 1, "pid": FRESH, "invocation": inv},
              attempts={"1": _entry("succeeded", T0 + 2_600, T0 + 2_900)})
    scene.ledger += [{"event": e, "t": mono(at), "pid": FRESH, "run": a, "step": "book",
                      "attempt": 1, "invocation": inv}
                     for e, at in (("start", T0 + 2_601), ("end", T0 + 2_890))]
    retry = {"before": T0 + 2_500, "after": T0 + 2_510, "done": True, "status": "cancelled",
             "end_ms": T0 + 1_000}
    ops = Operations(retries={a: [retry]})
    cancels = {a: (T0 + 990, T0 + 1_000)}
    report = _check(scene.store, scene.specs, scene.ledger, operations=ops,
                    cancel_times=cancels)
    assert not flagged(report, "still ran"), report.violations
    retry["before"] = T0 + 1_700  # its second life began while b still ran
    ledger = [e if e["step"] != "book" or e["event"] != "start" else {**e, "t": mono(T0 + 1_800)}
              for e in scene.ledger]
    report = _check(scene.store, scene.specs, ledger, operations=ops, cancel_times=cancels)
    assert flagged(report, f"key k0: run {a} ran while")


class ForkScene:
    """Run ``src`` recorded 'reserve', took event seq 1 ('__event:paid') and recorded
    'charge'; the driver forked it from 'charge' without keeping decisions: the fork copied
    'reserve' alone, with its result."""

    def __init__(self) -> None:
        self.store = _store()
        self.db = self.store.db
        self.src, self.fork = str(uuid.uuid4()), str(uuid.uuid4())
        for run_id in (self.src, self.fork):
            self.store.create_run(NewRun(run_id, "chaos.order", {"order": 1}), T0)
        self.store.send_event(self.src, "paid", {"n": 1}, T0)
        for i, (name, result) in enumerate((("reserve", {"r": 1}),
                                            ("__event:paid", {"seq": 1, "payload": {"n": 1}}),
                                            ("charge", {"c": 1}))):
            _raw_step(self.store, self.src, name, T0 + i, status="succeeded", result=result)
        self.copy("reserve", {"r": 1})
        self.db[keys.RUNS].update_one({"_id": self.fork}, {"$set": {"forked_from": self.src}})
        self.record: dict[str, Any] = {
            "source": self.src, "from_step": "charge", "keep": False, "returned": self.fork,
            "source_order": ["reserve", "__event:paid", "charge"],
            "source_steps": step_fingerprints(self.db, self.src),
            "source_events": event_fingerprints(self.db, self.src)}
        self.ops = Operations(forks={self.fork: self.record})
        for run_id in (self.src, self.fork):
            self.store.transition_run(run_id, ["running"], "completed", T0 + 5_000)

    def copy(self, name: str, result: Any) -> None:
        _raw_step(self.store, self.fork, name, T0 + 100, status="succeeded", result=result,
                  forked_from=self.src)

    def check(self) -> Report:
        spec = {"kind": "forked", "expect": "completed"}
        return _check(self.store, {self.src: spec, self.fork: spec}, operations=self.ops)


def test_a_fork_that_copied_what_it_may_from_its_unchanged_source_passes() -> None:
    report = ForkScene().check()
    assert report.violations == []
    assert report.operations["forks"] == 1 and report.operations["steps copied by forks"] == 1


def test_a_fork_copying_a_decision_a_later_step_or_another_result_is_flagged() -> None:
    """Issue 31, defect 6: without keep_decisions, decided gates and taken events are
    asked again; and a fork copies only succeeded steps recorded before its step."""
    scene = ForkScene()
    scene.copy("__event:paid", {"seq": 1, "payload": {"n": 1}})
    scene.copy("charge", {"c": 1})
    scene.db[keys.STEPS].update_one({"run_id": scene.fork, "step_name": "reserve"},
                                    {"$set": {"result": {"r": 2}}})
    report = scene.check()
    assert flagged(report, "the decided gate '__event:paid' was copied, though the fork did "
                           "not keep decisions")
    assert flagged(report, "step 'charge' copied from")
    assert flagged(report, "step 'reserve' copied as {'r': 2}, the source's is succeeded")
    scene = ForkScene()
    scene.record["keep"] = True
    scene.copy("__event:paid", {"seq": 1, "payload": {"n": 1}})
    assert scene.check().violations == []


def test_a_fork_that_changed_its_source_or_names_none_is_flagged() -> None:
    """A fork shares nothing mutable with its source, and names it."""
    scene = ForkScene()
    scene.db[keys.STEPS].update_one({"run_id": scene.src, "step_name": "reserve"},
                                    {"$set": {"result": {"r": 9}}})
    scene.db[keys.EVENTS].insert_one({"_id": "after", "run_id": scene.src, "name": "paid",
                                      "seq": 2, "payload": {"n": 2}, "key": None,
                                      "sent_ms": T0 + 6_000})
    scene.db[keys.RUNS].update_one({"_id": scene.fork}, {"$unset": {"forked_from": ""}})
    scene.record["repeat"] = "another"
    report = scene.check()
    assert flagged(report, "the fork changed its source's steps ['reserve']")
    assert flagged(report, "the fork changed its source's events")
    assert flagged(report, "the run names None as its source")
    assert flagged(report, "its repeat returned another")


def test_a_fork_that_wrote_into_another_run_is_flagged() -> None:
    """Issue 31, defect 5: a fork under another run's id must be refused, that run left as
    it was; no run but a fork holds a copied step."""
    scene = ForkScene()
    scene.ops.probes.append({"source": scene.src, "from_step": "__event:paid",
                             "target": scene.fork, "outcome": f"returned {scene.fork}",
                             "target_steps": step_fingerprints(scene.db, scene.fork)})
    scene.copy("__event:paid", {"seq": 1, "payload": {"n": 1}})
    scene.db[keys.STEPS].update_one({"run_id": scene.src, "step_name": "charge"},
                                    {"$set": {"forked_from": scene.fork}})
    report = scene.check()
    assert flagged(report, f"returned {scene.fork}, not WorkflowRunConflictError")
    assert flagged(report, "wrote into that run (steps ['__event:paid'])")
    assert flagged(report, f"step 'charge' of run {scene.src}, which is no fork, was copied "
                           f"from {scene.fork}")


def test_a_fork_s_own_waits_take_its_first_events_whatever_it_copied() -> None:
    """Issue 31, defect 2: a wait the fork copied holds its source's seq 1; the fork's own
    wait must still take the fork's own seq 1 first."""
    scene = EventsScene()
    scene.db[keys.STEPS].update_one({"run_id": scene.run_id, "step_name": "__event:paid"},
                                    {"$set": {"forked_from": "source-run"}})
    scene.db[keys.STEPS].update_one({"run_id": scene.run_id, "step_name": "__event:paid#2"},
                                    {"$set": {"result": scene.taken(1, 1)}})
    scene.output["taken"][1] = scene.payload(1)
    scene.db[keys.RUNS].update_one({"_id": scene.run_id},
                                   {"$set": {"output": scene.output}})
    assert scene.check().violations == []  # the copy's seq 1 is its source's, not the fork's
    scene.set_wait("__event:paid#2", scene.taken(2, 2))  # its seq 1 hidden by the copy
    assert flagged(scene.check(), "the waits of 'paid' took seqs [2], not the first events "
                                  "sent ([1, 2])")


def test_a_death_after_the_window_does_not_explain_a_lost_lease() -> None:
    """Issue 37: attempt 1's worker lost its lease with no fault in the window and died a
    minute later; "the process died" explained it. Its ledger shows it alive past the
    window: a live worker was robbed. One with no line after the window still counts."""
    scene = Scene()
    scene.faults = []
    scene.alive = {FRESH}
    scene.ledger.append(scene.body("start", 9, STALE, T0 + LEASE + 60_000))
    assert flagged(scene.check(), "a live worker was robbed")
    scene.ledger = [e for e in scene.ledger if e["attempt"] != 9 and not (
        e["pid"] == STALE and e["event"] == "end")]
    report = scene.check()
    assert not flagged(report, "a live worker was robbed")
    assert report.attempts_by_reason.get("process died") == 1
