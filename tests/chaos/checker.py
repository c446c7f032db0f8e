"""Reads what a chaos run left behind and checks the library's promise against it.

The evidence is the raw documents (``workflow_steps`` read straight from MongoDB, with the
history entries each holds in ``attempts``: the merged ``get_history`` view fills missing
attempts in, so it cannot show one missing), the ledger the step bodies wrote outside Redis
and MongoDB, the workers' logs (every refused write is one WARNING line), and the faults injected.

What must hold:

* every run ended, with the status and error its spec calls for;
* every step has exactly one recorded outcome, from the attempt that owns it (its result
  carries the attempt, pid and invocation that produced it), and no attempt beyond
  ``retries + 1``;
* one history entry per attempt, written in the raw step document, each matching the step;
* every attempt exists for a reason: the one before it failed in its body, or lost its
  lease to a fault (its process was killed, crashed or paused, Redis restarted, or the
  MongoDB replica set restarted, lost, stepped down or stalled its primary meanwhile). An
  attempt with no such reason means a live worker was robbed (contract invariant 3);
* every body that ended (or raised) in an attempt whose outcome is not the recorded one was
  refused: a ``WorkflowStepSupersededError`` line names its run, step and attempt, unless a
  fault killed it before it could write;
* no attempt ran twice; compensation recorded once per run that needed it; recovery after
  kills within bounds;
* no step of an ended run records an outcome of its own body (succeeded, or failed by its
  body) after the run ended, except in the window docs/reliability.md leaves: a body
  already running (claimed before the end) that settles before its step's fence, which
  the ender writes within its own round trips (``ENDED_WINDOW_MS``, plus any MongoDB fault
  in between); and no claim made after the run ended runs its body;
* a cancelled run's children are cancelled (or had ended before the cancel reached them);
* issue 26's primitives: every event kept once, in the order sent, a keyed one once; every
  wait took the first event of its name not taken yet, no event taken by two waits, a
  completed run's waits one each and its output their payloads; each schedule tick at most
  one run, under its tick's id, none after the pause; no two runs of one key of the limited
  workflow at once, admitted in creation order, none left queued, no slot held by an ended
  run; the transactional step's app collection holds exactly the recorded attempts' writes;
* issue 31's operations (``tests.chaos.composed``): each send kept exactly once, key or no
  key; a retried run's history intact, nothing run between an end and its retry, no fence
  of an undone end failing what the retry reopened; a reopened wait waited (an event wait
  until its own expiry, an approval for the driver's decision); no key over its limit at
  any sampled moment, a retried limited run's lives apart from the others'; a fork a new
  run that names its source, copied only what it may, changed neither its source nor any
  other run, and its waits took its own first events.

It also checks that the run exercised what it claims to: late writes refused, pauses
applied, a stale write that landed while the newer attempt still ran.
"""

from __future__ import annotations

import itertools
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pikku_celery.model import keys
from pikku_celery.store._docs import written_entries
from pikku_celery.store._slots import holder_run
from tests.chaos.composed import Operations, check_operations, revived
from tests.chaos.faults import FaultEvent
from tests.chaos.netfaults import NET_FAULTS

WORKER_FUNCTIONS = ("chaos.work", "chaos.compensate", "chaos.big")
LEASE_EXPIRED = "WorkflowStepLeaseExpiredError"
CANCEL_ERRORS = ("WorkflowCancelledError", "WorkflowRunEnded")
PID_FAULTS = ("kill_worker", "kill_child", "kill_orchestrator", "pause_worker", "stale_write",
              "worker_crash")
# Faults of a service every worker shares: any holder may lose a lease to them while they
# last (from the fault to ``end_t``: a primary writable again, a stalled one woken).
MONGO_FAULTS = ("restart_mongo", "kill_primary", "step_down_primary", "stall_primary")
RESTART_FAULTS = ("restart_redis", *MONGO_FAULTS)
WINDOW_SLACK_MS = 1_500
# The window docs/reliability.md leaves open ("a body already running when its run ends"):
# a settle landing between the run's end write and its step's fence, which the ender
# writes next (``Engine.cancel``/``finish``: a Redis mark, a read of the steps, a guarded
# write each). The bound is those round trips on a loaded machine; a MongoDB fault in
# between adds its length. Time stamps are taken before each write, on the writer's clock
# (put back on the shared one with the writer's skew, from its ledger lines): a write taken
# before another may land after it by a scheduling delay, hence CLOCK_SLACK_MS.
ENDED_WINDOW_MS = 5_000
CLOCK_SLACK_MS = 1_500
REFUSED = re.compile(r"WorkflowStepSupersededError: step '(?P<step>.+?)' of run "
                     r"(?P<run>\S+?): attempt (?P<attempt>\d+) was")

Doc = dict[str, Any]


@dataclass
class Report:
    runs: int = 0
    steps: int = 0
    attempts: int = 0
    executions: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    faults_not_applied: list[str] = field(default_factory=list)
    late_writes_refused: int = 0
    stale_before_settle: int = 0
    double_recorded: int = 0
    stuck: list[str] = field(default_factory=list)
    compensations_recorded: int = 0
    compensation_executions: int = 0
    recovery_s: list[float] = field(default_factory=list)
    # the same measures, of kills with no MongoDB fault under way between the kill and the
    # recovery (a reclaim waits for a writable primary like any other write)
    recovery_quiet_s: list[float] = field(default_factory=list)
    pass_recovery_quiet_s: list[float] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    worker_crashes: int = 0
    exhausted: int = 0
    pass_recovery_s: list[float] = field(default_factory=list)
    attempts_by_reason: Counter[str] = field(default_factory=Counter)
    # MongoDB fault kind -> seconds until a primary was writable again / until the next
    # step outcome was recorded (a ``settled`` ledger line, sent after the store's write)
    primary_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    settle_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    rollbacks: int = 0  # rollbacks the mongod nodes logged, and the operations reverted
    rolled_back: Counter[str] = field(default_factory=Counter)
    # outcomes of ended runs' steps settled after the run's end inside the documented
    # window: how long after the end (ms); claims after the end (fenced by themselves)
    settled_after_end_ms: list[int] = field(default_factory=list)
    ended_runs_checked: int = 0
    children_of_cancelled: Counter[str] = field(default_factory=Counter)  # by child status
    # issue 26's primitives: events, the schedule, the concurrency limit, bookings
    events: Counter[str] = field(default_factory=Counter)
    ticks: Counter[str] = field(default_factory=Counter)
    limited: Counter[str] = field(default_factory=Counter)
    bookings: Counter[str] = field(default_factory=Counter)
    # issue 31: retries, forks and approvals (``tests.chaos.composed``)
    operations: Counter[str] = field(default_factory=Counter)

    def recovery_summary(self, values: list[float] | None = None) -> str:
        values = sorted(self.recovery_s if values is None else values)
        if not values:
            return "none measured"
        p95 = values[min(len(values) - 1, int(0.95 * len(values)))]
        return (f"n={len(values)} p50={statistics.median(values):.2f}s p95={p95:.2f}s "
                f"max={values[-1]:.2f}s")

    def summary(self) -> str:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(self.by_status.items()))
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.attempts_by_reason.items()))
        lines = [
            f"runs {self.runs} ({statuses})",
            f"steps {self.steps}, attempts {self.attempts}, body executions {self.executions}",
            f"faults {sum(self.faults.values())}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())),
            f"faults that failed to apply {len(self.faults_not_applied)}"
            + "".join(f"{'; ' if i else ': '}{why}" + (f" (x{n})" if n > 1 else "")
                      for i, (why, n) in enumerate(Counter(self.faults_not_applied).items())),
            f"late writes refused {self.late_writes_refused} "
            f"(landing before the newer attempt settled: {self.stale_before_settle})",
            f"attempts after the first, by reason: {reasons or 'none'}",
            f"workers that exited on their own and were restarted {self.worker_crashes}",
            f"double-recorded outcomes {self.double_recorded}",
            f"lost or stuck runs {len(self.stuck)}",
            f"runs failed because a step lost its worker on every attempt {self.exhausted}",
            f"compensations recorded {self.compensations_recorded} "
            f"(bodies executed {self.compensation_executions})",
            f"recovery after a kill: {self.recovery_summary()}; with no MongoDB fault "
            f"meanwhile: {self.recovery_summary(self.recovery_quiet_s)}",
            f"next pass after an orchestrator kill: {self.recovery_summary(self.pass_recovery_s)}"
            f"; with no MongoDB fault meanwhile: "
            f"{self.recovery_summary(self.pass_recovery_quiet_s)}",
            *(f"after {kind}: writable primary {self.recovery_summary(self.primary_s[kind])}; "
              f"next step settled {self.recovery_summary(self.settle_s[kind])}"
              for kind in MONGO_FAULTS if self.faults[kind]),
            *(f"after the heal of {kind}: next step settled "
              f"{self.recovery_summary(self.settle_s[kind])}"
              for kind in NET_FAULTS if self.faults[kind]),
            f"outcomes recorded after their run ended {len(self.settled_after_end_ms)} "
            f"of {self.ended_runs_checked} ended runs (each a body claimed before the end, "
            f"settled within the documented window"
            + (f", at most {max(self.settled_after_end_ms)} ms after the end)"
               if self.settled_after_end_ms else ")"),
            "children of cancelled runs: "
            + (", ".join(f"{k} {v}" for k, v in sorted(self.children_of_cancelled.items()))
               or "none"),
            "events: " + _counts(self.events),
            "schedule ticks: " + _counts(self.ticks),
            "concurrency-limited runs: " + _counts(self.limited),
            "transactional bookings: " + _counts(self.bookings),
            "retries and forks: " + _counts(self.operations),
            f"mongod rollbacks {self.rollbacks} (unacknowledged operations undone: "
            + (", ".join(f"{k} {v}" for k, v in sorted(self.rolled_back.items())) or "none")
            + ")",
            f"violations {len(self.violations)}",
        ]
        return "\n".join(lines + [f"  ! {v}" for v in self.violations[:40]])


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counter.items()) or "none"


@dataclass
class Evidence:
    """Everything the checks read, gathered once."""

    steps: dict[str, list[Doc]]  # run id -> raw step documents
    history: dict[str, dict[int, Doc]]  # step id -> attempt -> raw history entry
    ledger: list[dict[str, Any]]
    refused: set[tuple[str, str, int]]  # (run, step, attempt) of refused-write log lines
    faults: list[FaultEvent]
    alive_pids: set[int]  # processes alive when the run was checked
    wall_offset_s: float  # epoch seconds minus monotonic seconds, in the driver
    bodies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # by invocation
    # pid -> how far its wall clock is ahead of the driver's (ms), from its ledger lines
    # (``wall`` is the process's own clock, ``t`` the system-wide monotonic one)
    skew_ms: dict[int, int] = field(default_factory=dict)
    # run id -> the driver's wall clock (epoch ms) just before and after it cancelled it
    cancels: dict[str, tuple[int, int]] = field(default_factory=dict)
    # run id -> (the driver's wall clock before each retry that ran it again, the run's
    # end that retry undid), epoch ms
    retried: dict[str, list[tuple[int, int | None]]] = field(default_factory=dict)
    # pid -> the driver's wall clock (epoch ms) of its last ledger line: it lived until then
    last_seen_ms: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        by_invocation: dict[str, list[dict[str, Any]]] = defaultdict(list)
        skews: dict[int, list[float]] = defaultdict(list)
        for entry in self.ledger:
            if "invocation" in entry:
                by_invocation[entry["invocation"]].append(entry)
            if "wall" in entry:
                skews[entry["pid"]].append(entry["wall"] - entry["t"] - self.wall_offset_s)
            if isinstance(entry.get("pid"), int) and isinstance(entry.get("t"), int | float):
                seen = int((entry["t"] + self.wall_offset_s) * 1000)
                self.last_seen_ms[entry["pid"]] = max(seen, self.last_seen_ms.get(entry["pid"], 0))
        self.bodies = dict(by_invocation)
        self.skew_ms = {pid: int(statistics.median(v) * 1000) for pid, v in skews.items()}

    def shared_ms(self, at_ms: int | None, worker: str | None) -> int | None:
        """``at_ms``, a stamp ``worker`` wrote in the store, on the driver's clock: as it
        is. A worker stamps with pikku's ``ServerClock`` (the lease server's time, read
        through its monotonic clock), never with its own wall clock, so a worker's wall
        clock skew (``skew_ms``) does not move its stamps. (Putting them back by that skew
        hid a claim after the end on a fast clock and invented one on a slow clock: the
        -30 s libfaketime worker of ``run.py --netns``, issue 37.)"""
        return at_ms


def load_raw(db: Any, run_ids: Iterable[str]) -> tuple[dict[str, list[Doc]],
                                                       dict[str, dict[int, Doc]]]:
    """The raw step documents of ``run_ids`` (a step's data left out) and the history
    entries written in them (``attempts``: only what was written, nothing filled in)."""
    ids = list(run_ids)
    steps: dict[str, list[Doc]] = defaultdict(list)
    history: dict[str, dict[int, Doc]] = defaultdict(dict)
    for start in range(0, len(ids), 200):
        chunk = ids[start:start + 200]
        for doc in db[keys.STEPS].find({"run_id": {"$in": chunk}}, {"data": 0}):
            steps[doc["run_id"]].append(doc)
            history[doc["_id"]] = written_entries(doc)
    return steps, history


def refused_writes(logs: Iterable[str]) -> set[tuple[str, str, int]]:
    return {(m["run"], m["step"], int(m["attempt"])) for log in logs
            for m in REFUSED.finditer(log)}


def check(pikku: Any, specs: dict[str, dict[str, Any]], cancelled: set[str],
          ledger: list[dict[str, Any]], faults: list[FaultEvent], logs: list[str],
          recovery_bound_s: float, pass_bound_s: float, *, alive_pids: set[int],
          wall_offset_s: float, not_applied: list[str] | None = None,
          require_fence: bool = False,
          cancel_times: dict[str, tuple[int, int]] | None = None,
          sent_events: list[dict[str, Any]] | None = None,
          schedule: dict[str, Any] | None = None,
          operations: Operations | None = None) -> Report:
    report = Report(runs=len(specs), executions=sum(e["event"] == "start" for e in ledger))
    # A run retried after its last cancel must end as its spec says.
    cancelled = {r for r in cancelled if not revived(r, cancel_times or {}, operations)}
    report.faults_not_applied = list(not_applied or [])
    db = pikku.engine.store.db
    steps, history = load_raw(db, specs)
    evidence = Evidence(steps, history, ledger, refused_writes(logs), faults, alive_pids,
                        wall_offset_s, cancels=dict(cancel_times or {}),
                        retried={r: [(c["before"], c.get("end_ms"))
                                     for c in operations.done_retries(r)]
                                 for r in operations.retries} if operations else {})
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in ledger:
        if "run" in entry:
            by_run[entry["run"]].append(entry)
    for run_id, spec in specs.items():
        _check_run(pikku, run_id, spec, run_id in cancelled, by_run[run_id], evidence, report)
    _check_ended_runs(db, specs, evidence, report)
    _check_events(db, specs, sent_events or [], evidence, report)
    if schedule is not None:
        _check_schedule(db, specs, schedule, report)
    _check_limited(db, specs, evidence, report)
    _check_bookings(db, specs, evidence, report)
    if operations is not None:
        check_operations(db, specs, operations, dict(cancel_times or {}), evidence, report)
    _ran_twice(ledger, report)
    _recovery(ledger, faults, recovery_bound_s, report)
    _pass_recovery(ledger, faults, pass_bound_s, report)
    _mongo_recovery(ledger, faults, report)
    _heal_recovery(ledger, faults, report)
    if require_fence:
        _exercised(report)
    return report


def _exercised(report: Report) -> None:
    """A chaos run that never reached the fence proves nothing about it."""
    if report.late_writes_refused == 0:
        report.violations.append("the run never exercised the fence: no late write refused")
    if report.faults["pause_worker"] + report.faults["stale_write"] == 0:
        report.violations.append("the run never exercised the fence: no pause applied")
    # A stale write landing before the newer attempt settles is counted, not required: the
    # stale-write fault pauses a body the ledger shows running, which may end just then.


# --- runs ------------------------------------------------------------------------------------


def _check_run(pikku: Any, run_id: str, spec: dict[str, Any], was_cancelled: bool,
               ledger: list[dict[str, Any]], ev: Evidence, report: Report) -> None:
    run = pikku.get_run(run_id)
    report.by_status[run.status] += 1
    if not run.is_terminal:
        report.stuck.append(run_id)
        report.violations.append(f"run {run_id} ({spec.get('kind', 'order')}) stuck "
                                 f"{run.status}" + _stuck_detail(spec, ev.steps.get(run_id, [])))
        return
    raw = sorted(ev.steps.get(run_id, []), key=lambda d: (d["created_ms"], d["step_name"]))
    report.steps += len(raw)
    _check_outcome(run, spec, was_cancelled, raw, report)
    for doc in raw:
        _check_step(doc, ev.history.get(doc["_id"], {}), ev, report)
    if spec.get("kind", "order") == "order":
        _check_compensation(run, spec, raw, ledger, report)
    wanted = spec.get("ledger_event")
    if wanted and not any(e["event"] == wanted for e in ledger):
        report.faults_not_applied.append(f"{spec['kind']} run {run_id}: no {wanted} in the "
                                         "ledger, the fault never fired")


def _stuck_detail(spec: dict[str, Any], steps: list[Doc]) -> str:
    """What a stuck run waits for: its steps not succeeded, and how the mix made it."""
    open_steps = [f"{d['step_name']} {d['status']}#{d['attempt']}"
                  + (f" due {d['due_ms']}" if d.get("due_ms") else "")
                  for d in steps if d["status"] != "succeeded"]
    made = {k: spec[k] for k in ("fork", "waits", "cancel_while_waiting", "cancel_after_s",
                                 "key") if k in spec}
    return f": open steps {open_steps or 'none'}; {made}"


def _check_outcome(run: Any, spec: dict[str, Any], was_cancelled: bool, raw: list[Doc],
                   report: Report) -> None:
    """The run ended as its spec calls for, with the error that explains it."""
    kind = spec.get("kind", "order")
    allowed = {_expected_status(spec)} | ({"cancelled"} if was_cancelled else set())
    error = str(run.error)
    wanted = spec.get("error") or (f"fatal step of order {spec['order']}" if kind == "order"
                                   else None)
    if run.status == "failed" and _exhausted_by_faults(raw):
        report.exhausted += 1  # every attempt of a step lost its worker: the contract's fail
        allowed.add("failed")
    elif run.status == "failed" and wanted and wanted not in error:
        report.violations.append(f"run {run.run_id} ({kind}) failed with the wrong error: "
                                 f"{run.error}")
    if run.status not in allowed:
        report.violations.append(f"run {run.run_id} ({kind}) ended {run.status}, expected "
                                 f"{sorted(allowed)}: {(run.error or {}).get('message')}")
    if kind == "oversized" and run.status != "cancelled":  # a cancel may beat the step
        _check_oversized(run.run_id, [d for d in raw if d["step_name"] == "big"], report)
    if kind == "squatter" and run.status == "completed":
        mine = [d for d in raw if d["step_name"] == "on_error"]
        if not mine or (mine[0].get("result") or {}).get("invocation") != mine[0]["_id"]:
            report.violations.append(f"run {run.run_id} chose a colliding id and got another "
                                     f"run's step: {mine}")


def _check_oversized(run_id: str, big: list[Doc], report: Report) -> None:
    """An outcome too large to store fails the attempt that produced it, for good: the
    step ends failed with InvalidInputError, and no attempt before was retried after that
    error. An earlier attempt may only have lost its lease (a fault took its worker or the
    primary before it could record its failure; ``_check_reason`` asks which)."""
    doc = big[0] if big else None
    if doc is None or doc["status"] != "failed" or (
            doc.get("error") or {}).get("type") != "InvalidInputError":
        report.violations.append(f"run {run_id}: an outcome too large to store must fail "
                                 f"its attempt for good: {doc}")
        return
    earlier = written_entries(doc)
    retried = [a for a in range(1, doc["attempt"])
               if (earlier.get(a, {}).get("error") or {}).get("type") != LEASE_EXPIRED]
    if retried:
        report.violations.append(f"run {run_id}: an outcome too large to store was retried "
                                 f"after attempts {retried} failed with it")


def _needed_compensation(raw: list[Doc]) -> bool:
    """Only the last step ('ship') has a compensation: it is owed when that step failed for
    good (its fatal error, or every attempt lost its worker), not when the run failed
    earlier because another step lost its worker on every attempt and 'ship' never ran."""
    return any(d["step_name"] == "ship" and d["status"] == "failed" for d in raw)


def _expected_status(spec: dict[str, Any]) -> str:
    kind = spec.get("kind", "order")
    if kind == "order":
        return "failed" if spec.get("fatal") else "completed"
    return str(spec["expect"])


def _exhausted_by_faults(steps: list[Any]) -> bool:
    """A step whose every attempt lost its worker fails with WorkflowStepLeaseExpiredError
    once ``retries + 1`` are spent (contract invariant 6): under enough kills that is the
    right outcome, not a violation. Takes raw documents or ``StepState`` objects."""
    def get(s: Any, name: str) -> Any:
        return s.get(name) if isinstance(s, dict) else getattr(s, name)

    return any(get(s, "status") == "failed" and get(s, "attempt") == get(s, "max_attempts")
               and (get(s, "error") or {}).get("type") == LEASE_EXPIRED for s in steps)


# --- steps -----------------------------------------------------------------------------------


def _check_step(doc: Doc, entries: dict[int, Doc], ev: Evidence, report: Report) -> None:
    where = f"step {doc['step_name']!r} of run {doc['run_id']}"
    attempt, status = doc["attempt"], doc["status"]
    report.attempts += len(entries)
    if attempt > doc["max_attempts"]:
        report.violations.append(f"{where}: attempt {attempt} > {doc['max_attempts']}")
    _check_entries(doc, entries, where, report)
    for later in range(2, attempt + 1):
        _check_reason(doc, later, entries, ev, where, report)
    if status == "failed" and (doc.get("error") or {}).get("type") == LEASE_EXPIRED:
        # The last attempt lost its lease too: the same evidence is owed for it.
        pid = _pid(doc.get("worker"))
        if _fault_reason(pid, doc.get("started_ms"), doc.get("updated_ms"), ev) is None:
            report.violations.append(
                f"{where}: its last attempt {attempt} (pid {pid}, alive) expired with no "
                "fault to explain it: a live worker was robbed")
    succeeded = [a for a, e in entries.items() if e["status"] == "succeeded"]
    if len(succeeded) > 1:
        report.double_recorded += 1
        report.violations.append(f"{where}: attempts {succeeded} all recorded succeeded")
    if doc.get("forked_from"):  # a fork's copy: no body of this run made it (composed.py)
        return
    if doc.get("function") in WORKER_FUNCTIONS:
        _check_bodies(doc, entries, ev, where, report)
        if status == "succeeded":
            _check_result(doc, entries.get(attempt), ev, where, report)


def _check_entries(doc: Doc, entries: dict[int, Doc], where: str, report: Report) -> None:
    """One raw history entry per attempt: every earlier attempt has one (it failed, or lost
    its lease), the current one has one once it settled by itself, none beyond it."""
    attempt, status = doc["attempt"], doc["status"]
    beyond = sorted(a for a in entries if a > attempt or a < 1)
    if beyond:
        report.violations.append(f"{where}: history entries for attempts {beyond} "
                                 f"beyond its attempt {attempt}")
    missing = [a for a in range(1, attempt) if a not in entries]
    if missing:
        report.violations.append(
            f"{where}: no history entry written for attempts {missing} (it is {status} at "
            f"attempt {attempt}; entries " + ", ".join(
                f"{a} {e['status']} {(e.get('error') or {}).get('type')}"
                for a, e in sorted(entries.items())) + ")")
    wrong = [a for a in range(1, attempt) if a in entries and entries[a]["status"] != "failed"]
    if wrong:
        report.violations.append(f"{where}: superseded attempts {wrong} recorded "
                                 f"{[entries[a]['status'] for a in wrong]}")
    settled_itself = status == "succeeded" or (
        status == "failed" and (doc.get("error") or {}).get("type") not in CANCEL_ERRORS)
    current = entries.get(attempt)
    if settled_itself and doc.get("started_ms") is not None and current is None:
        report.violations.append(f"{where}: settled attempt {attempt} has no history entry")
    if current is not None and status in ("succeeded", "failed") and (
            current["status"] != status or current.get("result") != doc.get("result")):
        report.violations.append(
            f"{where}: attempt {attempt}'s entry says {current['status']} "
            f"{current.get('result')!r}, the step {status} {doc.get('result')!r}")


def _check_reason(doc: Doc, attempt: int, entries: dict[int, Doc], ev: Evidence,
                  where: str, report: Report) -> None:
    """Attempt ``attempt`` exists: its predecessor must have failed in its body, or lost
    its lease to a fault. Otherwise a live worker was robbed (invariant 3)."""
    previous = entries.get(attempt - 1)
    if previous is None:
        return  # reported as a missing entry
    error = previous.get("error") or {}
    if error.get("type") in CANCEL_ERRORS and ev.retried.get(doc["run_id"]):
        report.attempts_by_reason["the run's end, then a retry"] += 1
        return
    if error.get("type") != LEASE_EXPIRED:
        report.attempts_by_reason["body failed"] += 1
        return
    started = previous.get("started_ms")
    nxt = entries.get(attempt) or (doc if doc["attempt"] == attempt else {})
    ended = nxt.get("started_ms") or doc.get("updated_ms")
    pid = _pid(previous.get("worker"))
    reason = _fault_reason(pid, started, ended, ev)
    if reason is None:
        report.violations.append(
            f"{where}: attempt {attempt} exists but attempt {attempt - 1} (pid {pid}, alive) "
            f"lost its lease with no fault to explain it: a live worker was robbed")
        return
    report.attempts_by_reason[reason] += 1


def _fault_reason(pid: int | None, from_ms: int | None, to_ms: int | None,
                  ev: Evidence) -> str | None:
    """Which fault explains that process ``pid`` lost a lease held from ``from_ms`` to
    ``to_ms`` (epoch ms): it was killed or crashed (no longer alive), paused, or Redis or
    MongoDB restarted in the window."""
    lo = (from_ms or 0) - WINDOW_SLACK_MS
    hi = (to_ms or 2**62) + WINDOW_SLACK_MS
    for fault in ev.faults:
        at = int((fault.t + ev.wall_offset_s) * 1000)
        if fault.kind in PID_FAULTS and pid in fault.pids and lo <= at <= hi:
            return fault.kind
        # A shared service's fault lasts from its start to ``end_t``: overlapping windows.
        until = int(((fault.end_t or fault.t) + ev.wall_offset_s) * 1000)
        if fault.kind in RESTART_FAULTS and lo <= until and at <= hi:
            return fault.kind
        # A partition (issue 37) lasts until its heal, ``end_t``; it names the workers it
        # cut off (``pids``), or none when it cut every worker off from something.
        if (fault.kind in NET_FAULTS and lo <= until and at <= hi
                and (not fault.pids or pid in fault.pids)):
            return fault.kind
    if pid is not None and pid not in ev.alive_pids and ev.last_seen_ms.get(pid, 0) <= hi:
        # A kill or crash the fault list names by worker, not pid; not one that came after
        # the window (its ledger shows it alive past the lease it lost).
        return "process died"
    return None


def _pid(worker: str | None) -> int | None:
    if not worker:
        return None
    try:
        return int(worker.rpartition(":")[2])
    except ValueError:
        return None


def _check_result(doc: Doc, entry: Doc | None, ev: Evidence, where: str,
                  report: Report) -> None:
    result = doc.get("result") or {}
    if result.get("attempt") != doc["attempt"] or result.get("invocation") != doc["_id"]:
        report.violations.append(f"{where}: recorded result {result} is not attempt "
                                 f"{doc['attempt']}'s")
    ended = {(e["attempt"], e["pid"]) for e in ev.bodies.get(doc["_id"], [])
             if e["event"] == "end"}
    if (doc["attempt"], result.get("pid")) not in ended:
        report.violations.append(f"{where}: no ledger end for the recorded attempt")


def _check_bodies(doc: Doc, entries: dict[int, Doc], ev: Evidence, where: str,
                  report: Report) -> None:
    """Every body of this step that finished (end or raise) either recorded its own
    outcome or was refused; only a fault that killed it first excuses neither."""
    finished = [e for e in ev.bodies.get(doc["_id"], []) if e["event"] in ("end", "raise")]
    for body in finished:
        attempt, pid = body["attempt"], body["pid"]
        if _recorded_by(entries.get(attempt), body):
            continue
        if (doc["run_id"], doc["step_name"], attempt) in ev.refused:
            report.late_writes_refused += 1
            newer = [e["t"] for e in finished if e["attempt"] > attempt]
            if doc["attempt"] > attempt and (not newer or min(newer) > body["t"]):
                report.stale_before_settle += 1  # the newer attempt had not settled yet
            continue
        at_ms = int((body["t"] + ev.wall_offset_s) * 1000)
        if _fault_reason(pid, at_ms, at_ms + 10_000, ev) is None:
            report.violations.append(
                f"{where}: attempt {attempt}'s body {body['event']} (pid {pid}) was neither "
                "recorded nor refused, and no fault stopped it")


def _recorded_by(entry: Doc | None, body: dict[str, Any]) -> bool:
    """Is ``entry`` the outcome this body wrote itself?"""
    if entry is None:
        return False
    error_type = (entry.get("error") or {}).get("type")
    if body["event"] == "end" and entry["status"] == "succeeded":
        result = entry.get("result") or {}
        return bool(result.get("pid") == body["pid"]
                    and result.get("attempt") == body["attempt"])
    # A raise records its error; an end whose outcome could not be stored fails its own
    # attempt at once (InvalidInputError).
    own_failure = error_type == "InvalidInputError" if body["event"] == "end" else (
        error_type not in (LEASE_EXPIRED, *CANCEL_ERRORS))
    return entry["status"] == "failed" and own_failure and _pid(entry.get("worker")) == body[
        "pid"]


# --- ended runs ------------------------------------------------------------------------------


def _run_docs(db: Any, run_ids: Iterable[str]) -> dict[str, Doc]:
    ids = list(run_ids)
    docs: dict[str, Doc] = {}
    for start in range(0, len(ids), 200):
        for doc in db[keys.RUNS].find({"_id": {"$in": ids[start:start + 200]}},
                                      {"input": 0, "output": 0, "state": 0}):
            docs[doc["_id"]] = doc
    return docs


def _check_ended_runs(db: Any, specs: dict[str, dict[str, Any]], ev: Evidence,
                      report: Report) -> None:
    """Every ended run of ``specs`` and every child run of theirs: no outcome recorded
    after the end beyond the documented window, no claim after the end running its body.
    A cancelled run's child must have ended, and is held to its parent's end: it ended
    cancelled, or it had finished its steps before the cancel."""
    runs = _run_docs(db, specs)
    children = {doc["child_run_id"]: run_id for run_id in runs
                for doc in ev.steps.get(run_id, []) if doc.get("child_run_id")}
    child_ids = [c for c in children if c not in runs]
    child_steps, child_history = load_raw(db, child_ids)
    ev.steps.update(child_steps)
    ev.history.update(child_history)
    runs.update(_run_docs(db, child_ids))
    ends = {run_id: _end_ms(doc, ev) for run_id, doc in runs.items()}
    for child_id, parent_id in children.items():
        parent, child = runs.get(parent_id), runs.get(child_id)
        if parent is None or parent["status"] != "cancelled":
            continue
        if child is None:  # the cancel came between the child's step and its creation
            _never_created(child_id, parent_id, ev, report)
            continue
        if child.get("parent_run_id") != parent_id:
            continue  # a squatter under the child's id: not this parent's child
        # A cancelled run's child is cancelled too: whatever status it ended with, it is
        # held to its parent's end (no step of it records an outcome after that, beyond
        # the window), and it must have ended.
        report.children_of_cancelled[child["status"]] += 1
        parent_end, child_end = ends[parent_id], ends[child_id]
        if child_end is None:
            report.violations.append(f"child run {child_id} of cancelled run {parent_id} is "
                                     f"still {child['status']}")
        elif parent_end is not None:
            ends[child_id] = min(child_end, parent_end)
    for run_id, doc in runs.items():
        end = ends[run_id]
        if end is not None:
            report.ended_runs_checked += 1
            _no_outcome_after_end(doc, end, ev, report)


def _never_created(child_id: str, parent_id: str, ev: Evidence, report: Report) -> None:
    """A cancelled run's child that does not exist: the cancel came before its creation and
    no pass created it since (a pass of a cancelled run creates no child). When the chaos
    app paused that creation (``child_creating``), the paused pass must have been stopped
    by a fault: once it goes on, it writes the child (and cancels it)."""
    paused = [e for e in ev.ledger if e["event"] == "child_creating"
              and e.get("child") == child_id]
    if not paused:
        report.children_of_cancelled["never created"] += 1
        return
    at_ms = int((paused[0]["t"] + ev.wall_offset_s) * 1000)
    why = _fault_reason(paused[0]["pid"], at_ms,
                        at_ms + int(paused[0].get("seconds", 0) * 1000) + 10_000, ev)
    if why is None:
        report.violations.append(
            f"child run {child_id} of cancelled run {parent_id} was never created, though "
            f"the pass creating it (pid {paused[0]['pid']}, alive) was stopped by no fault")
        return
    report.children_of_cancelled[f"never created ({why} stopped its pass)"] += 1


def _end_ms(run: Doc, ev: Evidence) -> int | None:
    """When an ended run ended (epoch ms): the run's ``updated_ms``, written by the ender on
    its clock; a later touch only moves it later (``$max``), which weakens the checks, never
    flags a false violation. For a run the driver cancelled, no later than the moment its
    ``cancel`` returned (its clock is the shared one)."""
    if run["status"] not in ("completed", "failed", "cancelled"):
        return None
    end = int(run["updated_ms"])
    cancel = ev.cancels.get(run["_id"])
    if cancel is not None and run["status"] == "cancelled":
        end = min(end, cancel[1])
    return end


def _slack_ms(ev: Evidence, from_ms: int, to_ms: int) -> int:
    """CLOCK_SLACK_MS plus however long MongoDB faults lasted between the two moments: a
    write stamped at one moment lands once a primary takes writes."""
    outage = _mongo_outage_s(ev.faults, from_ms / 1000 - ev.wall_offset_s,
                             to_ms / 1000 - ev.wall_offset_s)
    return CLOCK_SLACK_MS + int((outage or 0.0) * 1000)


def _own_outcome(entry: Doc) -> bool:
    """Did this attempt record an outcome of its own body (not a fence, not a lost lease)?"""
    if entry.get("status") == "succeeded":
        return True
    error_type = (entry.get("error") or {}).get("type")
    return entry.get("status") == "failed" and error_type not in (LEASE_EXPIRED,
                                                                  *CANCEL_ERRORS)


def _no_outcome_after_end(run: Doc, end_ms: int, ev: Evidence, report: Report) -> None:
    run_id = run["_id"]
    for doc in ev.steps.get(run_id, []):
        where = f"step {doc['step_name']!r} of {run['status']} run {run_id}"
        for attempt, entry in sorted(ev.history.get(doc["_id"], {}).items()):
            started = ev.shared_ms(entry.get("started_ms"), entry.get("worker"))
            ran = any(e["event"] == "start" and e["attempt"] == attempt
                      for e in ev.bodies.get(doc["_id"], []))
            if started is not None and ran and started > end_ms + _slack_ms(ev, end_ms,
                                                                              started):
                report.violations.append(
                    f"{where}: attempt {attempt} was claimed {started - end_ms} ms after the "
                    "run ended and ran its body (a claim after the end must fence itself)")
            settled = ev.shared_ms(entry.get("ended_ms"), entry.get("worker"))
            if settled is None or not _own_outcome(entry) or settled <= end_ms:
                continue
            late = settled - end_ms
            if started is not None and started > end_ms + _slack_ms(ev, end_ms, started):
                report.violations.append(
                    f"{where}: attempt {attempt}, claimed {started - end_ms} ms after the run "
                    f"ended, recorded {entry['status']} {late} ms after the end")
            elif late > ENDED_WINDOW_MS + _slack_ms(ev, end_ms, settled):
                report.violations.append(
                    f"{where}: attempt {attempt} recorded {entry['status']} {late} ms after "
                    f"the run ended, past the documented window ({ENDED_WINDOW_MS} ms until "
                    "its step's fence)")
            else:
                report.settled_after_end_ms.append(late)


def _ran_twice(ledger: list[dict[str, Any]], report: Report) -> None:
    starts = Counter((e["invocation"], e["attempt"]) for e in ledger if e["event"] == "start")
    for (invocation, attempt), n in starts.items():
        if n > 1:
            report.violations.append(f"attempt {attempt} of invocation {invocation} ran {n} "
                                     "times: two workers held one attempt")


def _check_compensation(run: Any, spec: dict[str, Any], raw: list[Doc],
                        ledger: list[dict[str, Any]], report: Report) -> None:
    comp = [d for d in raw if d["step_name"].endswith(":on_error")]
    executed = sum(e["event"] == "compensate" for e in ledger)
    report.compensation_executions += executed
    recorded = sum(d["status"] == "succeeded" for d in comp)
    report.compensations_recorded += recorded
    if run.status == "failed" and _needed_compensation(raw) and recorded != 1:
        report.violations.append(f"run {run.run_id}: compensation recorded {recorded} times")
    if not spec.get("fatal") and executed:
        report.violations.append(f"run {run.run_id}: compensation ran for a healthy order")


# --- timing ----------------------------------------------------------------------------------


def _recovery(ledger: list[dict[str, Any]], faults: list[FaultEvent], bound_s: float,
              report: Report) -> None:
    starts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    closed: set[tuple[str, int, int]] = set()
    for entry in ledger:
        if entry["event"] == "start":
            starts[entry["invocation"]].append(entry)
        elif entry["event"] in ("end", "raise"):
            closed.add((entry["invocation"], entry["attempt"], entry["pid"]))
    report.faults.update(f.kind for f in faults if f.kind != "worker_crash")  # injected only
    for fault in faults:
        if fault.kind not in ("kill_worker", "kill_child"):
            continue
        for invocation, entries in starts.items():
            for entry in entries:
                if entry["pid"] not in fault.pids or entry["t"] > fault.t:
                    continue
                if (invocation, entry["attempt"], entry["pid"]) in closed:
                    continue
                later = [e for e in entries if e["attempt"] > entry["attempt"]
                         and e["t"] > fault.t]
                if later:
                    _step_recovered(entry, later[0]["t"] - fault.t, fault, faults, bound_s,
                                    report)


def _step_recovered(entry: dict[str, Any], took: float, kill: FaultEvent,
                    faults: list[FaultEvent], bound_s: float, report: Report) -> None:
    """A reclaim is a write: while no primary takes writes it waits, so the bound grows by
    the time a MongoDB fault lasted within the recovery."""
    report.recovery_s.append(took)
    outage = _mongo_outage_s(faults, kill.t, kill.t + took)
    if outage is None:
        report.recovery_quiet_s.append(took)
    if took > bound_s + (outage or 0.0):
        report.violations.append(f"step {entry['step']!r} of run {entry['run']} came back "
                                 f"{took:.1f}s after a kill (bound {bound_s:.1f}s"
                                 f" + {outage or 0.0:.1f}s of MongoDB fault)")


def _pass_recovery(ledger: list[dict[str, Any]], faults: list[FaultEvent], bound_s: float,
                   report: Report) -> None:
    """After a worker is killed mid-pass, the run's next pass must come once the run lease
    lapses (plus a re-wake), not hours later."""
    passes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in ledger:
        if entry["event"] in ("pass", "pass_end"):
            passes[entry["run"]].append(entry)
    for fault in faults:
        if fault.kind != "kill_orchestrator":
            continue
        for run_id, entries in passes.items():
            before = [e for e in entries if e["t"] <= fault.t and e["pid"] in fault.pids]
            if not before or before[-1]["event"] != "pass":
                continue
            later = [e for e in entries if e["event"] == "pass" and e["t"] > fault.t]
            if later:
                took = later[0]["t"] - fault.t
                report.pass_recovery_s.append(took)
                outage = _mongo_outage_s(faults, fault.t, fault.t + took)
                if outage is None:
                    report.pass_recovery_quiet_s.append(took)
                if took > bound_s + (outage or 0.0):
                    report.violations.append(f"run {run_id} had its next pass {took:.1f}s "
                                             f"after its orchestrator was killed")


def _mongo_outage_s(faults: list[FaultEvent], start: float, end: float) -> float | None:
    """How long MongoDB faults lasted within ``start``-``end`` (monotonic seconds; a fault
    lasts from its start until a primary took writes again, ``end_t``), or None when none
    did."""
    overlaps = [min(end, f.end_t or f.t) - max(start, f.t) for f in faults
                if f.kind in (*MONGO_FAULTS, "partition_primary") and f.t <= end
                and (f.end_t or f.t) >= start]
    return sum(max(0.0, o) for o in overlaps) if overlaps else None


def _mongo_recovery(ledger: list[dict[str, Any]], faults: list[FaultEvent],
                    report: Report) -> None:
    """How long after each MongoDB fault a primary took writes again (the harness timed
    it) and the next step outcome was recorded (the first ``settled`` line after it)."""
    settled = sorted(e["t"] for e in ledger if e["event"] == "settled")
    for fault in faults:
        if fault.kind not in MONGO_FAULTS:
            continue
        if fault.new_primary_s is not None:
            report.primary_s[fault.kind].append(fault.new_primary_s)
        later = next((t for t in settled if t > fault.t), None)
        if later is not None:
            report.settle_s[fault.kind].append(later - fault.t)


def _heal_recovery(ledger: list[dict[str, Any]], faults: list[FaultEvent],
                   report: Report) -> None:
    """How long after each partition's heal (``end_t``) the next step outcome was recorded
    (issue 37). A ``partition_primary`` is measured from its heal too, not from the cut."""
    settled = sorted(e["t"] for e in ledger if e["event"] == "settled")
    for fault in faults:
        if fault.kind not in NET_FAULTS or fault.end_t is None:
            continue
        later = next((t for t in settled if t > fault.end_t), None)
        if later is not None:
            report.settle_s[fault.kind].append(later - fault.end_t)


# --- issue 26: events, schedules, concurrency limits, transactional steps --------------------

EVENT_WAIT = "__event:"
PUBLISH = "__publish:"
LIMITED_WORKFLOW = "chaos.limited"
LIMITED_CONCURRENCY = 1  # tests/chaos/chaosapp.py's limit per key
BOOKINGS = "chaos_bookings"
TICK_SLACK_MS = 5_000


def _reach(step_name: str, prefix: str) -> tuple[str, int] | None:
    """``__event:paid#3`` -> ("paid", 3); None for a step of another kind."""
    if not step_name.startswith(prefix):
        return None
    name, sep, tail = step_name[len(prefix):].rpartition("#")
    if sep and tail.isdigit():
        return name, int(tail)
    return step_name[len(prefix):], 1


def _check_events(db: Any, specs: dict[str, dict[str, Any]], sent: list[dict[str, Any]],
                  ev: Evidence, report: Report) -> None:
    """Every event the store kept was sent by the driver, once (a keyed one once however
    often it was sent), in the order sent; every wait took the first event of its name not
    taken yet, no event was taken by two waits, and a run that completed took one event
    per wait (a wait nobody sends to took its default once its timeout passed) and returned
    their payloads."""
    ids = [r for r, spec in specs.items() if spec.get("kind") == "events"]
    if not ids:
        return
    kept: dict[str, list[Doc]] = defaultdict(list)
    for start in range(0, len(ids), 200):
        for doc in db[keys.EVENTS].find({"run_id": {"$in": ids[start:start + 200]}}):
            kept[doc["run_id"]].append(doc)
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in sent:
        by_run[record["run"]].append(record)
    runs = {d["_id"]: d for d in db[keys.RUNS].find({"_id": {"$in": ids}},
                                                    {"status": 1, "output": 1})}
    for run_id in ids:
        _check_run_events(run_id, specs[run_id], runs.get(run_id) or {},
                          sorted(kept[run_id], key=lambda d: d["seq"]), by_run[run_id],
                          ev.steps.get(run_id, []), report)


def _check_run_events(run_id: str, spec: dict[str, Any], run: Doc, kept: list[Doc],
                      sent: list[dict[str, Any]], steps: list[Doc], report: Report) -> None:
    where = f"events run {run_id}"
    report.events["runs"] += 1
    report.events["sends"] += len(sent)
    report.events["kept"] += len(kept)
    report.events["keyed sends repeated"] += sum(
        1 for i, r in enumerate(sent) if r["key"] and any(
            o["key"] == r["key"] for o in sent[:i]))
    report.events["sends retried after a fault"] += sum(r["ambiguous"] for r in sent)
    report.events["sends refused (run ended)"] += sum(
        r["outcome"].startswith("refused") for r in sent)
    by_seq = {d["seq"]: d for d in kept}
    _check_kept(where, kept, by_seq, sent, report)
    waits = _check_waits(where, kept, by_seq, steps, report)
    if run.get("status") == "completed":
        _check_completed_waits(where, spec, run, waits, steps, report)


def _check_kept(where: str, kept: list[Doc], by_seq: dict[int, Doc],
                sent: list[dict[str, Any]], report: Report) -> None:
    """What the store kept against what the driver sent."""
    ns: list[Any] = [(d.get("payload") or {}).get("n") for d in kept]
    if ns != sorted(ns) or len(set(ns)) != len(ns):
        report.violations.append(f"{where}: events kept out of the order sent, or one send "
                                 f"kept twice (payload n by seq: {ns})")
    for doc in kept:
        mine = [r for r in sent if r["name"] == doc["name"]
                and r["n"] == (doc.get("payload") or {}).get("n")]
        if not mine:
            report.violations.append(f"{where}: event seq {doc['seq']} ({doc['name']}) was "
                                     "never sent")
    for record in sent:
        if record["seq"] is None:
            continue
        held = by_seq.get(record["seq"])
        if held is None or held["name"] != record["name"] or (
                held.get("payload") or {}).get("n") != record["n"]:
            report.violations.append(f"{where}: the send of {record['name']!r} n={record['n']}"
                                     f" returned seq {record['seq']}, the store holds {held}")
    for key in {r["key"] for r in sent if r["key"]}:
        seqs = {r["seq"] for r in sent if r["key"] == key and r["seq"] is not None}
        docs = [d for d in kept if d.get("key") == key]
        if len(seqs) > 1 or len(docs) > 1:
            report.violations.append(f"{where}: keyed event {key!r} delivered more than once "
                                     f"(sends returned seqs {sorted(seqs)}, kept {len(docs)})")
    # Kept once, strictly, key or no key: a send is one event per call (its retries inside
    # the call), and the driver re-sends after a failed call only what was not kept.
    kept_n = Counter((d.get("payload") or {}).get("n") for d in kept)
    for n in {r["n"] for r in sent}:
        mine = [r for r in sent if r["n"] == n]
        returned = any(r["seq"] is not None for r in mine)
        unknown = not returned and any(r["outcome"].startswith("gave up") for r in mine)
        if kept_n[n] > 1 or (returned and kept_n[n] != 1) or (
                not returned and not unknown and kept_n[n]):
            report.violations.append(
                f"{where}: the send n={n} ({mine[0]['name']!r}, key {mine[0]['key']!r}; "
                f"{', '.join(r['outcome'] for r in mine)}) was kept {kept_n[n]} times")


def _check_waits(where: str, kept: list[Doc], by_seq: dict[int, Doc], steps: list[Doc],
                 report: Report) -> dict[str, dict[int, Doc]]:
    """What the waits took; the run's waits by name and reach."""
    waits: dict[str, dict[int, Doc]] = defaultdict(dict)
    for doc in steps:
        found = _reach(doc["step_name"], EVENT_WAIT)
        if found is not None:
            waits[found[0]][found[1]] = doc
    taken_by: dict[int, str] = {}
    for name, reached in waits.items():
        of_name = [d["seq"] for d in kept if d["name"] == name]
        took: list[int] = []
        for reach in sorted(reached):
            doc = reached[reach]
            result = _wait_result(where, doc, report)
            if result is None:
                continue
            if result.get("timed_out"):
                _timed_out(where, doc, [by_seq[q] for q in of_name[len(took):]], report)
                continue
            seq = result["seq"]
            if seq in taken_by:
                report.violations.append(f"{where}: event seq {seq} taken by two waits "
                                         f"({taken_by[seq]!r} and {doc['step_name']!r})")
            taken_by[seq] = doc["step_name"]
            took.append(seq)
            event = by_seq.get(seq)
            if event is None or event["name"] != name or result.get("payload") != event.get(
                    "payload"):
                report.violations.append(f"{where}: wait {doc['step_name']!r} took seq {seq}"
                                         f" with {result.get('payload')}, the store holds "
                                         f"{event}")
            elif event["sent_ms"] <= doc.get("created_ms", 0):
                report.events["taken, sent before the run waited"] += 1
            else:
                report.events["taken, sent while the run waited"] += 1
        if took != of_name[:len(took)]:
            report.violations.append(f"{where}: the waits of {name!r} took seqs {took}, not "
                                     f"the first events sent ({of_name})")
    return waits


def _wait_result(where: str, doc: Doc, report: Report) -> dict[str, Any] | None:
    """A settled wait's result when it is the run's own (a fork's copy is its source's
    event, checked there) and names an event or a timeout; ``None`` otherwise (a wait
    that settled with neither is flagged: a default taken with no timeout passed)."""
    result = doc.get("result")
    if doc["status"] != "succeeded" or doc.get("forked_from"):
        return None
    if not isinstance(result, dict) or not (
            result.get("timed_out") or isinstance(result.get("seq"), int)):
        report.violations.append(f"{where}: wait {doc['step_name']!r} settled with "
                                 f"{result!r}: no event, no timeout")
        return None
    return result


def _timed_out(where: str, doc: Doc, untaken: list[Doc], report: Report) -> None:
    """A wait that timed out: no event of its name was left to take when it did."""
    report.events["waits timed out"] += 1
    if untaken and untaken[0]["sent_ms"] < doc.get("updated_ms", 0) - CLOCK_SLACK_MS:
        report.violations.append(f"{where}: wait {doc['step_name']!r} timed out though event "
                                 f"seq {untaken[0]['seq']} was kept before")


def _check_completed_waits(where: str, spec: dict[str, Any], run: Doc,
                           waits: dict[str, dict[int, Doc]], steps: list[Doc],
                           report: Report) -> None:
    """A completed run: one settled wait per wait of its spec, its output their payloads,
    its progress published once per wait."""
    report.events["runs completed"] += 1
    output = (run.get("output") or {}).get("taken")
    expected = []
    counts: Counter[str] = Counter()
    for name, timeout in spec["waits"]:
        counts[name] += 1
        doc = waits.get(name, {}).get(counts[name])
        result = (doc or {}).get("result") or {}
        if doc is None or doc["status"] != "succeeded":
            report.violations.append(f"{where}: completed, but wait {name!r} #{counts[name]} "
                                     f"did not settle: {doc and doc['status']}")
            return
        if timeout is not None and not result.get("timed_out"):
            report.violations.append(f"{where}: wait {name!r} took {result}, though no event "
                                     f"{name!r} was sent: its timeout must have passed")
        expected.append({"timed_out": name} if result.get("timed_out") else result.get(
            "payload"))
    if output != expected:
        report.violations.append(f"{where}: returned {output}, its waits took {expected}")
    published = [(r, d) for d in steps if (r := _reach(d["step_name"], PUBLISH)) is not None
                 and d["status"] == "succeeded"]
    last = max(published, key=lambda p: p[0][1])[1].get("result") if published else None
    if len(published) != len(spec["waits"]) or last != len(spec["waits"]):
        report.violations.append(f"{where}: published progress {len(published)} times, last "
                                 f"{last}, for {len(spec['waits'])} waits")


def _check_schedule(db: Any, specs: dict[str, dict[str, Any]], schedule: dict[str, Any],
                    report: Report) -> None:
    """Each tick started at most one run, under the id derived from it; every run of the
    schedule ended, ran its step for its own tick, and none is for a tick after the
    schedule was paused (beyond the round that read it just before)."""
    name, every = schedule["name"], schedule["every_ms"]
    runs = list(db[keys.RUNS].find({"schedule": name}, {"status": 1, "scheduled_ms": 1,
                                                        "output": 1, "created_ms": 1}))
    report.ticks["runs"] += len(runs)
    per_tick = Counter(d.get("scheduled_ms") for d in runs)
    for tick, n in per_tick.items():
        if n > 1:
            report.violations.append(f"schedule {name}: tick {tick} started {n} runs")
    for doc in runs:
        run_id, tick = doc["_id"], doc.get("scheduled_ms")
        parsed = keys.scheduled_tick(run_id)
        if parsed != (name, tick) or tick is None or tick % every:
            report.violations.append(f"schedule {name}: run {run_id} (tick {tick}) does not "
                                     f"match its tick ({parsed})")
            continue
        if run_id not in specs:
            report.violations.append(f"schedule {name}: run {run_id} was never checked")
        if doc["status"] == "completed":
            report.ticks["completed"] += 1
            got = (doc.get("output") or {}).get("tick")
            if got is None or int(_iso_ms(got)) != tick:
                report.violations.append(f"schedule {name}: run {run_id} ran for tick {got}")
        paused = schedule.get("paused_ms")
        if paused is not None and tick > paused + every + TICK_SLACK_MS:
            report.violations.append(f"schedule {name}: tick {tick} started a run "
                                     f"{tick - paused} ms after the schedule was paused")
    ticks = sorted(t for t in per_tick if t is not None)
    gaps = [(b - a) // every - 1 for a, b in itertools.pairwise(ticks)]
    report.ticks["ticks skipped (catch_up latest)"] += sum(gaps)
    if gaps:
        report.ticks["longest gap s"] = max(gaps) * every // 1000 + every // 1000


def _iso_ms(iso: str) -> int:
    from datetime import datetime

    return round(datetime.fromisoformat(iso).timestamp() * 1000)


def _recorded_span(doc: Doc, ev: Evidence) -> tuple[float, float] | None:
    """From the first to the last ledger line (monotonic s) of the step's recorded attempt:
    the body whose outcome the store holds."""
    if doc["status"] not in ("succeeded", "failed"):
        return None
    lines = [e["t"] for e in ev.bodies.get(doc["_id"], []) if e["attempt"] == doc["attempt"]]
    return (min(lines), max(lines)) if lines else None


def _check_limited(db: Any, specs: dict[str, dict[str, Any]], ev: Evidence,
                   report: Report) -> None:
    """At no moment did more than the limit of one key's runs run: the bodies whose
    outcomes were recorded of two runs of a key never overlap (the runs that were not
    cancelled: a cancel frees the slot while a body may still run, in the window the
    ended-run check bounds); a key's runs started in the order they were created; no run
    of a key was left queued, and at the end no slot is held by a run that ended. A run
    retried after its end lives again (``_lives``): each life holds a slot from its first
    body to its last (the end of a life its retry undid: no later), and a life after a
    retry takes its slot ahead of runs created after it (it was admitted once)."""
    from pikku_celery.store._slots import slot_id

    ids = [r for r, spec in specs.items() if spec.get("kind") == "limited"]
    if not ids:
        return
    runs = {d["_id"]: d for d in db[keys.RUNS].find({"_id": {"$in": ids}},
                                                    {"status": 1, "created_ms": 1, "slot": 1})}
    # (first, last body line, created), monotonic s: the run's creation on the same clock
    spans: dict[str, list[tuple[float, float, float, str]]] = defaultdict(list)
    for run_id in ids:
        spec, doc = specs[run_id], runs.get(run_id) or {}
        report.limited["runs"] += 1
        report.limited[str(doc.get("status"))] += 1
        if doc.get("slot") != slot_id(LIMITED_WORKFLOW, spec["key"]):
            report.violations.append(f"limited run {run_id} is in slot group "
                                     f"{doc.get('slot')}, not its key's")
        if doc.get("status") == "queued":
            report.violations.append(f"limited run {run_id} (key {spec['key']}) never left "
                                     "the queue")
        if doc.get("status") not in ("completed", "failed"):
            continue
        found = [s for d in ev.steps.get(run_id, []) if (s := _recorded_span(d, ev))]
        created = int(doc["created_ms"]) / 1000 - ev.wall_offset_s
        for life, (first, last) in _lives(found, ev.retried.get(run_id, []), ev):
            # a life after a retry: created (for the queue's order) when it was retried
            spans[spec["key"]].append((first, last, created if not life else -1.0, run_id))
    for key, intervals in spans.items():
        intervals.sort()
        for i, (start, _end, created, run_id) in enumerate(intervals):
            running = [r for s, e, _, r in intervals[:i] if e > start]
            if len(running) + 1 > LIMITED_CONCURRENCY:
                report.violations.append(
                    f"key {key}: run {run_id} ran while {running} still ran (limit "
                    f"{LIMITED_CONCURRENCY})")
            later_created = [r for _, _, c, r in intervals[:i] if c > created >= 0]
            if later_created:
                report.violations.append(f"key {key}: run {run_id} started after "
                                         f"{later_created}, created after it")
            if created >= 0 and any(0 <= c < created < e for _, e, c, _ in intervals[:i]):
                report.limited["waited for a slot"] += 1
    _check_slots(db, report)


def _lives(spans: list[tuple[float, float]], retries: list[tuple[int, int | None]],
           ev: Evidence) -> list[tuple[int, tuple[float, float]]]:
    """A run's recorded bodies (monotonic s), by life: life k began with its k-th retry
    (``retries``: the retry's moment and the end it undid, epoch ms); a life a retry
    ended holds its slot until that end at the latest (its slot was given back there)."""
    bounds = [((before / 1000 - ev.wall_offset_s),
               None if end is None else end / 1000 - ev.wall_offset_s)
              for before, end in retries]
    lives: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for first, last in spans:
        lives[sum(first >= b for b, _ in bounds)].append((first, last))
    out = []
    for life, found in sorted(lives.items()):
        first, last = min(s[0] for s in found), max(s[1] for s in found)
        ended = bounds[life][1] if life < len(bounds) else None
        out.append((life, (first, last if ended is None else max(first, min(last, ended)))))
    return out


def _check_slots(db: Any, report: Report) -> None:
    """At the end, no slot is held by a run that ended (or does not exist), nor by a life
    of a run that a retry ended (``store._slots.slot_holder``)."""
    for group in db[keys.SLOTS].find({"held": {"$gt": 0}}):
        for holder in group.get("holders") or []:
            run_id, life = holder_run(holder)
            run = db[keys.RUNS].find_one({"_id": run_id}, {"status": 1, "lineage": 1})
            status = (run or {}).get("status", "missing")
            lives = sum(1 for e in (run or {}).get("lineage") or () if e.get("op") == "retry")
            if run is not None and lives != life:
                status = f"{status} in a later life ({lives})"
            if status in ("completed", "failed", "cancelled", "missing") or lives != life:
                report.violations.append(f"slot group {group['_id']} (key {group.get('key')})"
                                         f" still held by run {holder}, which is {status}")


def _check_bookings(db: Any, specs: dict[str, dict[str, Any]], ev: Evidence,
                    report: Report) -> None:
    """The app collection a transactional step writes in its transaction holds exactly the
    booking of each attempt whose success is recorded, and none of any other attempt."""
    docs = [d for run_id in specs for d in ev.steps.get(run_id, [])
            if d.get("function") == "chaos.book"]
    if not docs:
        return
    bookings: dict[str, list[Doc]] = defaultdict(list)
    for booking in db[BOOKINGS].find():
        bookings[booking["_id"].rpartition(":")[0]].append(booking)
    known = set()
    for doc in docs:
        known.add(doc["_id"])
        mine = bookings.get(doc["_id"], [])
        attempts = sorted(b["attempt"] for b in mine)
        report.bookings["steps"] += 1
        report.bookings["bookings"] += len(mine)
        want = [doc["attempt"]] if doc["status"] == "succeeded" else []
        if attempts != want:
            report.violations.append(
                f"step 'book' of run {doc['run_id']} ({doc['status']}, attempt "
                f"{doc['attempt']}): bookings of attempts {attempts}, expected {want}")
        bodies = {(e["attempt"], round(e["t"], 6)) for e in ev.bodies.get(doc["_id"], [])
                  if e["event"] == "txn_start"}
        report.bookings["bodies run"] += len(bodies)
    for invocation, mine in bookings.items():
        if invocation not in known:
            report.violations.append(f"bookings {[b['_id'] for b in mine]} of no step checked")
