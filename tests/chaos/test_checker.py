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

from pikku_celery import keys
from pikku_celery.errors import WorkflowStepSupersededError
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


def test_a_settle_on_a_worker_with_a_fast_clock_is_put_back_on_the_shared_clock() -> None:
    scene = EndedScene()
    skew = 120_000
    scene.step("reserve", claim_ms=T0 + 100 + skew, pid=STALE)
    scene.cancel(T0 + 1_000)
    scene.settle("reserve", T0 + 800 + skew, pid=STALE)  # on its clock: before the end
    for line in scene.ledger:
        line["wall"] = line["t"] + OFFSET_S + skew / 1000
    assert scene.check().violations == []
    for line in scene.ledger:
        line["wall"] = line["t"] + OFFSET_S  # no skew known: the claim looks 120 s late
    assert flagged(scene.check(), "ms after the run ended and ran its body")


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
