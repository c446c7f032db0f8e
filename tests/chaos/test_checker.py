"""The checker itself: it must flag what it exists to find."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests.chaos.checker import Report, _check_step, _recovery
from tests.chaos.faults import FaultEvent


def _step(**kw: Any) -> Any:
    base = dict(step_name="charge", run_id="r", attempt=2, max_attempts=4, status="succeeded",
                function="chaos.work", invocation_id="inv", result={"attempt": 2,
                                                                    "invocation": "inv"})
    return SimpleNamespace(**{**base, **kw})


def _history(*statuses: str) -> list[Any]:
    return [SimpleNamespace(attempt=i + 1, status=s) for i, s in enumerate(statuses)]


def test_a_clean_step_passes() -> None:
    report = Report()
    _check_step(_step(), _history("failed", "succeeded"), {("inv", 2)}, report)
    assert report.violations == []


def test_a_result_from_a_stale_attempt_is_flagged() -> None:
    report = Report()
    _check_step(_step(result={"attempt": 1, "invocation": "inv"}),
                _history("failed", "succeeded"), {("inv", 1), ("inv", 2)}, report)
    assert any("is not attempt 2's" in v for v in report.violations)


def test_two_recorded_successes_and_too_many_attempts_are_flagged() -> None:
    report = Report()
    _check_step(_step(attempt=5, max_attempts=4), _history(*["succeeded"] * 5),
                {("inv", 5)}, report)
    assert report.double_recorded == 1
    assert any("attempt 5 > 4" in v for v in report.violations)


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
    from tests.chaos.checker import _pass_recovery

    report = Report()
    ledger = [{"event": "pass", "t": 1.0, "pid": 7, "run": "r"},
              {"event": "pass", "t": 3000.0, "pid": 8, "run": "r"},
              {"event": "pass_end", "t": 3000.1, "pid": 8, "run": "r"}]
    _pass_recovery(ledger, [FaultEvent("kill_orchestrator", 2.0, {7})], 16.0, report)
    assert report.pass_recovery_s == [2998.0]
    assert any("next pass 2998.0s after its orchestrator was killed" in v
               for v in report.violations)


def test_a_run_failed_by_exhausted_attempts_is_accepted_only_when_they_are_spent() -> None:
    from tests.chaos.checker import _exhausted_by_faults

    spent = _step(status="failed", attempt=4, max_attempts=4,
                  error={"type": "WorkflowStepLeaseExpiredError"})
    assert _exhausted_by_faults([spent])
    assert not _exhausted_by_faults([_step(status="failed", attempt=2, max_attempts=4,
                                           error={"type": "WorkflowStepLeaseExpiredError"})])
    assert not _exhausted_by_faults([_step(status="failed", attempt=4, max_attempts=4,
                                           error={"type": "Fatal"})])
