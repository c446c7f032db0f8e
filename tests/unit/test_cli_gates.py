"""The ``pikku`` commands for an operator new to them (issue 25 items 3 and 6): approval
gates shown as gates and decided by the name shown, ``resume`` refusing a run that waits at
an approval, whole values when the output is not a terminal, ``watch`` printing as it goes
in a pipe, and the dashboard without its extra installed."""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import pytest
from click.testing import CliRunner

import pikku_celery.dashboard
from pikku_celery import PikkuCelery, WorkflowContext
from pikku_celery.operate import cli as cli_module
from tests.unit.test_cli import one_line_error, run_cli
from tests.unit.test_contrib import make_pikku


@pytest.fixture
def pikku() -> PikkuCelery:
    pikku = make_pikku()

    @pikku.workflow("twice")
    def twice(wf: WorkflowContext, data: Any) -> Any:
        return [wf.approval("sign", expiry="2d") for _ in range(2)]

    return pikku


# --- approval gates ------------------------------------------------------------------------


def test_show_prints_an_approval_as_a_gate(pikku: PikkuCelery) -> None:
    run_id = pikku.start("gated", None, inline=True)
    shown = run_cli(pikku, "show", run_id)
    assert shown.exit_code == 0, shown.output
    assert "__approval" not in shown.output and "(sleep)" not in shown.output
    lines = shown.output.splitlines()
    [row] = [line for line in lines if line.startswith("manager (approval)")]
    assert row.split()[2:4] == ["-", "waiting"]
    [gate] = [line for line in lines if line.startswith("manager ")
              and "(approval)" not in line]
    assert gate.split()[:4] == ["manager", "waiting", "admin", "never"]
    assert '{"type": "boolean"}' in gate
    assert "waiting for approval 'manager'" in shown.output
    assert f"pikku approve {run_id} manager --decision JSON --by WHO" in shown.output

    data = json.loads(run_cli(pikku, "show", run_id, "--json").output)
    assert data["gates"] == [{
        "name": "manager", "step_name": "__approval:manager", "status": "waiting",
        "approvers": ["admin"], "expires_at": None, "schema": {"type": "boolean"},
        "decision": None, "decided_by": None}]

    assert run_cli(pikku, "approve", run_id, "manager", "--decision", "true", "--by",
                   "admin").exit_code == 0
    decided = run_cli(pikku, "show", run_id).output
    [gate] = [line for line in decided.splitlines() if line.startswith("manager  ")]
    assert "decided" in gate and gate.rstrip().endswith("true by admin")


def test_approve_takes_every_name_show_printed(pikku: PikkuCelery) -> None:
    run_id = pikku.start("twice", None, inline=True)
    first = run_cli(pikku, "approve", run_id, "__approval:sign", "--decision", '"a"')
    assert first.exit_code == 0, first.output
    assert first.output == f"approved 'sign' of run {run_id}: \"a\"\n"
    pikku.engine.advance(run_id)  # the next pass reaches the loop's second gate
    shown = run_cli(pikku, "show", run_id).output
    assert "sign#2 (approval)" in shown and "waiting for approval 'sign'" in shown
    second = run_cli(pikku, "approve", run_id, "sign#2", "--decision", '"b"')
    assert second.exit_code == 0, second.output
    assert [s.result for s in pikku.get_steps(run_id)] == ["a", "b"]
    unknown = one_line_error(run_cli(pikku, "approve", run_id, "__approval:other",
                                     "--decision", "true"))
    assert "has not reached it" in unknown


def test_resume_of_a_run_waiting_at_an_approval_says_so_and_fails(
        pikku: PikkuCelery) -> None:
    run_id = pikku.start("gated", None, inline=True)
    woken_before = len(pikku.engine.dispatcher.wakes)  # type: ignore[attr-defined]
    line = one_line_error(run_cli(pikku, "resume", run_id))
    assert line == (f"Error: run {run_id} waits for approval 'manager', which resume does "
                    f"not open: decide it with `pikku approve {run_id} manager --decision "
                    "JSON --by WHO`")
    assert pikku.get_run(run_id).status == "suspended"
    assert len(pikku.engine.dispatcher.wakes) == woken_before  # type: ignore[attr-defined]
    suspended = pikku.start("waits", None, inline=True)  # wf.suspend(): resumed as before
    assert run_cli(pikku, "resume", suspended).exit_code == 0


# --- output that is not a terminal --------------------------------------------------------


def test_piped_runs_prints_whole_values(pikku: PikkuCelery) -> None:
    long_id = "order-" + "7" * 150
    pikku.start("fails", None, inline=True, run_id=long_id)
    listed = run_cli(pikku, "runs")  # click's runner: stdout is not a terminal
    assert listed.exit_code == 0, listed.output
    [row] = [line for line in listed.output.splitlines() if line.startswith("order-")]
    assert row.split()[:3] == [long_id, "fails", "failed"]
    assert "…" not in row
    run = pikku.get_run(long_id)
    assert run.error is not None and len(run.error["message"]) > 60
    assert row.rstrip().endswith(run.error["message"])  # the error in full, on its line


def test_watch_in_a_pipe_prints_each_change_as_it_happens(
        pikku: PikkuCelery, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = pikku.start("gated", None, inline=True)
    printed: list[str] = []

    def between_reads(interval_s: float) -> None:
        sys.stdout.flush()
        printed.append(sys.stdout.buffer.getvalue().decode())  # type: ignore[attr-defined]
        if len(printed) == 2:
            pikku.approve(run_id, "manager", True, by="admin")
            pikku.engine.advance(run_id)  # completes

    monkeypatch.setattr(cli_module, "_sleep", between_reads)
    watched = CliRunner().invoke(cli_module.pikku, ["watch", run_id, "--interval", "0.5"],
                                 obj=_context(pikku))
    assert watched.exit_code == 0, watched.output
    # Before the run ended, its progress line was already out (printed once: unchanged).
    assert printed[0] == printed[1]
    assert printed[0].splitlines() == [
        line for line in printed[0].splitlines() if line.startswith(f"run {run_id} ")]
    assert "suspended: 0/1 steps settled" in printed[0]
    assert "waiting for approval 'manager'" in printed[0]
    assert watched.output.startswith(printed[0])
    assert f"run {run_id} completed: 1/1 steps settled" in watched.output
    assert "manager (approval)" in watched.output  # the attempts, once it ended
    assert watched.output.endswith("\n")


def _context(pikku: PikkuCelery) -> Any:
    from tests.unit.test_contrib_flask import CeleryCLIContext

    return CeleryCLIContext(pikku.app)


# --- the dashboard without its extra ----------------------------------------------------------


@pytest.mark.parametrize("missing", ["flask", "waitress"])
def test_the_dashboard_without_its_extra_names_the_extra(
        pikku: PikkuCelery, monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # import fails: ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "pikku_celery.dashboard.standalone", raising=False)
    monkeypatch.delattr(pikku_celery.dashboard, "standalone", raising=False)
    line = one_line_error(run_cli(pikku, "dashboard", "--port", "1"))
    assert f"the pikku dashboard needs '{missing}'" in line
    assert "pip install 'pikku-celery[dashboard]'" in line
    if missing == "flask":
        with pytest.raises(ModuleNotFoundError, match=r"pikku-celery\[dashboard\]"):
            importlib.import_module("pikku_celery.dashboard.standalone")
