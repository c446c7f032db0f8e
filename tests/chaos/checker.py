"""Reads the store and the ledger after a chaos run and checks the library's promise: every
step has exactly one recorded outcome, from the attempt that owned it; no run is lost or
stuck; compensation is recorded once per run that needed it; recovery is timely."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from tests.chaos.faults import FaultEvent

WORKER_FUNCTIONS = ("chaos.work", "chaos.compensate")


@dataclass
class Report:
    runs: int = 0
    steps: int = 0
    attempts: int = 0
    executions: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    late_writes_refused: int = 0
    double_recorded: int = 0
    stuck: list[str] = field(default_factory=list)
    compensations_recorded: int = 0
    compensation_executions: int = 0
    recovery_s: list[float] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    worker_crashes: int = 0
    exhausted: int = 0
    pass_recovery_s: list[float] = field(default_factory=list)

    def recovery_summary(self, values: list[float] | None = None) -> str:
        values = sorted(self.recovery_s if values is None else values)
        if not values:
            return "none measured"
        p95 = values[min(len(values) - 1, int(0.95 * len(values)))]
        return (f"n={len(values)} p50={statistics.median(values):.2f}s p95={p95:.2f}s "
                f"max={values[-1]:.2f}s")

    def summary(self) -> str:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(self.by_status.items()))
        lines = [
            f"runs {self.runs} ({statuses})",
            f"steps {self.steps}, attempts {self.attempts}, body executions {self.executions}",
            f"faults {sum(self.faults.values())}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())),
            f"late writes refused {self.late_writes_refused}",
            f"workers that exited on their own and were restarted {self.worker_crashes}",
            f"double-recorded outcomes {self.double_recorded}",
            f"lost or stuck runs {len(self.stuck)}",
            f"runs failed because a step lost its worker on every attempt {self.exhausted}",
            f"compensations recorded {self.compensations_recorded} "
            f"(bodies executed {self.compensation_executions})",
            f"recovery after a kill: {self.recovery_summary()}",
            f"next pass after an orchestrator kill: {self.recovery_summary(self.pass_recovery_s)}",
            f"violations {len(self.violations)}",
        ]
        return "\n".join(lines + [f"  ! {v}" for v in self.violations[:30]])


def check(pikku: Any, specs: dict[str, dict[str, Any]], cancelled: set[str],
          ledger: list[dict[str, Any]], faults: list[FaultEvent], logs: list[str],
          recovery_bound_s: float, pass_bound_s: float) -> Report:
    report = Report(runs=len(specs), executions=sum(e["event"] == "start" for e in ledger))
    report.late_writes_refused = sum(log.count("superseded by attempt") for log in logs)
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in ledger:
        if "run" in entry:
            by_run[entry["run"]].append(entry)
    for run_id, spec in specs.items():
        _check_run(pikku, run_id, spec, run_id in cancelled, by_run[run_id], report)
    _recovery(ledger, faults, recovery_bound_s, report)
    _pass_recovery(ledger, faults, pass_bound_s, report)
    return report


def _check_run(pikku: Any, run_id: str, spec: dict[str, Any], was_cancelled: bool,
               ledger: list[dict[str, Any]], report: Report) -> None:
    run = pikku.get_run(run_id)
    report.by_status[run.status] += 1
    if not run.is_terminal:
        report.stuck.append(run_id)
        report.violations.append(f"run {run_id} stuck {run.status}")
        return
    steps = pikku.get_steps(run_id)
    expected = {"failed"} if spec.get("fatal") else {"completed"}
    if was_cancelled:
        expected.add("cancelled")
    if run.status == "failed" and _exhausted_by_faults(steps):
        report.exhausted += 1  # every attempt of a step lost its worker: the contract's fail
        expected.add("failed")
    elif run.status == "failed" and f"fatal step of order {spec['order']}" not in str(run.error):
        report.violations.append(f"run {run_id} failed with the wrong error: {run.error}")
    if run.status not in expected:
        report.violations.append(f"run {run_id} ended {run.status}, expected {expected}: "
                                 f"{(run.error or {}).get('message')}")
    history = pikku.get_history(run_id)
    report.steps += len(steps)
    ends = {(e["invocation"], e["attempt"]) for e in ledger if e["event"] == "end"}
    for step in steps:
        _check_step(step, [h for h in history if h.step_name == step.step_name], ends, report)
    _check_compensation(run, spec, steps, ledger, report)


def _exhausted_by_faults(steps: list[Any]) -> bool:
    """A step whose every attempt lost its worker fails with WorkflowStepLeaseExpiredError
    once ``retries + 1`` are spent (contract invariant 6): under enough kills that is the
    right outcome, not a violation."""
    return any(s.status == "failed" and s.attempt == s.max_attempts
               and (s.error or {}).get("type") == "WorkflowStepLeaseExpiredError"
               for s in steps)


def _check_step(step: Any, history: list[Any], ends: set[tuple[str, int]],
                report: Report) -> None:
    report.attempts += len(history)
    where = f"step {step.step_name!r} of run {step.run_id}"
    if step.attempt > step.max_attempts:
        report.violations.append(f"{where}: attempt {step.attempt} > {step.max_attempts}")
    if history and [h.attempt for h in history] != list(range(1, step.attempt + 1)):
        report.violations.append(f"{where}: history attempts {[h.attempt for h in history]}")
    succeeded = [h for h in history if h.status == "succeeded"]
    if len(succeeded) > 1:
        report.double_recorded += 1
        report.violations.append(f"{where}: {len(succeeded)} succeeded attempts recorded")
    if step.status != "succeeded" or step.function not in WORKER_FUNCTIONS:
        return
    result = step.result or {}
    if result.get("attempt") != step.attempt or result.get("invocation") != step.invocation_id:
        report.violations.append(f"{where}: recorded result {result} is not attempt "
                                 f"{step.attempt}'s")
    if (step.invocation_id, step.attempt) not in ends:
        report.violations.append(f"{where}: no ledger end for the recorded attempt")


def _check_compensation(run: Any, spec: dict[str, Any], steps: list[Any],
                        ledger: list[dict[str, Any]], report: Report) -> None:
    comp = [s for s in steps if s.step_name.endswith(":on_error")]
    executed = sum(e["event"] == "compensate" for e in ledger)
    report.compensation_executions += executed
    recorded = sum(s.status == "succeeded" for s in comp)
    report.compensations_recorded += recorded
    if run.status == "failed" and spec.get("fatal") and recorded != 1:
        report.violations.append(f"run {run.run_id}: compensation recorded {recorded} times")
    if not spec.get("fatal") and executed:
        report.violations.append(f"run {run.run_id}: compensation ran for a healthy order")


def _recovery(ledger: list[dict[str, Any]], faults: list[FaultEvent], bound_s: float,
              report: Report) -> None:
    starts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    closed: set[tuple[str, int, int]] = set()
    for entry in ledger:
        if entry["event"] == "start":
            starts[entry["invocation"]].append(entry)
        elif entry["event"] in ("end", "raise"):
            closed.add((entry["invocation"], entry["attempt"], entry["pid"]))
    for fault in faults:
        report.faults[fault.kind] += 1
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
                    took = later[0]["t"] - fault.t
                    report.recovery_s.append(took)
                    if took > bound_s:
                        report.violations.append(
                            f"step {entry['step']!r} of run {entry['run']} came back "
                            f"{took:.1f}s after a kill (bound {bound_s:.1f}s)")


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
                if took > bound_s:
                    report.violations.append(f"run {run_id} had its next pass {took:.1f}s "
                                             f"after its orchestrator was killed")
