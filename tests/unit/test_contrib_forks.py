"""Forks and retries over HTTP (issue 31, defects 5 and 6, and the lineage), on Flask and
Django: ``keep_decisions`` is authorized as ``approve`` of each approval the fork copies,
a fork under another run's id is a 409 that writes nothing, and a run's JSON names its
source, its lineage (who forked or retried it, when) and its forks."""

from __future__ import annotations

from typing import Any

from pikku_celery import PikkuCelery
from tests.unit.test_contrib import PREFIX, Web, reconfigured, web

__all__ = ["web"]  # the fixture, one per framework

asked: list[tuple[str, str | None, str | None]] = []


def _user(request: Any) -> str | None:
    if hasattr(request, "user"):  # Django
        return request.user.username if request.user.is_authenticated else None
    from flask import session

    return session.get("user")


def fork_but_not_approve(request: Any, action: str, run_id: str | None,
                         gate: str | None = None) -> bool:
    """``reader`` may read and fork, never approve; ``admin`` may do anything."""
    asked.append((action, run_id, gate))
    name = _user(request)
    return name == "admin" or (name == "reader" and action in ("read", "fork"))


def _approved_source(pikku: PikkuCelery) -> str:
    """A completed run of a workflow whose step ``add`` ran after approval ``manager``."""
    @pikku.step(name="forks.add")
    def add(data: dict[str, int]) -> int:
        return data["a"] + data["b"]

    @pikku.workflow("approved_sum")
    def approved_sum(wf: Any, data: Any) -> Any:
        wf.approval("manager", approvers=["admin"])
        return wf.do("add", add, data)

    run_id = pikku.start("approved_sum", {"a": 1, "b": 2}, run_id="http-approved")
    pikku.engine.advance(run_id)
    pikku.approve(run_id, "manager", True, by="admin")
    pikku.engine.advance(run_id)
    assert [s.step_name for s in pikku.get_steps(run_id)] == ["__approval:manager", "add"]
    return run_id


def test_keep_decisions_is_authorized_as_approve_of_each_gate_kept(web: Web) -> None:
    pikku = web.pikku
    source = _approved_source(pikku)
    with reconfigured(web, AUTHORIZE=fork_but_not_approve):
        call = web.call  # the reconfigured app's
        asked.clear()
        status, _ = call("POST", f"{PREFIX}/runs/{source}/fork",
                         {"from_step": "add", "keep_decisions": True}, user="reader")
        assert status == 403 and pikku.list_forks(source) == []  # nothing forked
        assert ("approve", source, "manager") in asked
        # Without the decisions: the fork asks the approval again.
        status, _ = call("POST", f"{PREFIX}/runs/{source}/fork",
                         {"from_step": "add", "run_id": "http-asks"}, user="reader")
        assert status == 202
        assert "__approval:manager" not in [s.step_name for s in pikku.get_steps("http-asks")]
        asked.clear()
        status, _ = call("POST", f"{PREFIX}/runs/{source}/fork",
                         {"from_step": "add", "run_id": "http-kept", "keep_decisions": True})
        assert status == 202 and ("approve", source, "manager") in asked
    kept = pikku.get_steps("http-kept")
    assert [(s.step_name, s.forked_from) for s in kept] == [("__approval:manager", source)]
    assert call("POST", f"{PREFIX}/runs/{source}/fork",
                {"from_step": "add", "keep_decisions": "yes"})[0] == 400


def test_a_fork_under_another_runs_id_is_a_409_that_writes_nothing(web: Web) -> None:
    pikku, call = web.pikku, web.call
    source = _approved_source(pikku)
    other = pikku.start("approved_sum", {"a": 1, "b": 2}, run_id="http-other")
    status, payload = call("POST", f"{PREFIX}/runs/{source}/fork",
                           {"from_step": "add", "run_id": other})
    assert (status, payload["error"]) == (409, "WorkflowRunConflictError")
    assert pikku.get_steps(other) == [] and pikku.get_run(other).forked_from is None
    # The same fork twice: the same run.
    for _ in range(2):
        assert call("POST", f"{PREFIX}/runs/{source}/fork",
                    {"from_step": "add", "run_id": "http-again"}) == (
            202, {"run_id": "http-again"})


def test_a_runs_json_names_its_source_lineage_and_forks(web: Web) -> None:
    pikku, call = web.pikku, web.call
    source = _approved_source(pikku)
    assert call("POST", f"{PREFIX}/runs/{source}/fork",
                {"from_step": "add", "run_id": "http-lin"})[0] == 202
    assert call("POST", f"{PREFIX}/runs/http-lin/cancel", {})[0] == 200
    assert call("POST", f"{PREFIX}/runs/http-lin/retry", {})[0] == 200

    status, served = call("GET", f"{PREFIX}/runs/http-lin")
    assert status == 200 and served["forked_from"] == source and served["forks"] == []
    assert [(e["op"], e["by"], e["from_step"], e["run_id"]) for e in served["lineage"]] == [
        ("fork", "admin", "add", source), ("retry", "admin", None, None)]
    status, served = call("GET", f"{PREFIX}/runs/{source}")
    assert (served["forked_from"], served["lineage"], served["forks"]) == (
        None, [], ["http-lin"])
