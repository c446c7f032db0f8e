"""The ``pikku`` commands through click's test runner, as ``celery -A proj pikku`` runs them
(the Celery app handed over as Celery's CLI context): each command, and each way it fails
(one line, a non-zero exit, never a traceback). ``tests/integration/test_cli_celery.py``
runs them as real ``celery -A`` subprocesses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    MongoWorkflowStore,
    PikkuCelery,
    RedisLeaseService,
)
from pikku_celery.operate import cli as cli_module
from pikku_celery.operate.cli import pikku as pikku_group
from pikku_celery.store.base import NewRun, NewStep
from pikku_celery.store.mongo import INDEXES
from tests.conftest import mongo_database
from tests.support.mongod import free_port
from tests.support.operate import ADD, LEASE_MS, now_ms, superseded_run
from tests.unit.test_contrib import make_pikku
from tests.unit.test_contrib_flask import CeleryCLIContext

DAY_MS = 86_400_000


@pytest.fixture
def pikku() -> PikkuCelery:
    return make_pikku()


def run_cli(pikku: PikkuCelery | Celery, *args: str) -> Result:
    app = pikku.app if isinstance(pikku, PikkuCelery) else pikku
    return CliRunner().invoke(pikku_group, list(args), obj=CeleryCLIContext(app))


def one_line_error(result: Result, code: int = 1) -> str:
    """The single ``Error: ...`` line a failed command prints (and nothing else)."""
    assert result.exit_code == code, result.output
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit), result.exception
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


# --- runs ---------------------------------------------------------------------------------


def test_runs_lists_newest_first_one_page_at_a_time(pikku: PikkuCelery) -> None:
    # Ids in creation order: runs started in one millisecond are listed by id.
    ids = [pikku.start("sum", {"a": i, "b": 1}, inline=True, run_id=f"run-{i}")
           for i in range(3)]
    failed = pikku.start("fails", None, inline=True, run_id="run-3")
    first = run_cli(pikku, "runs", "--limit", "2")
    assert first.exit_code == 0, first.output
    rows = [line.split()[0] for line in first.output.splitlines()[1:3]]
    assert rows == [failed, ids[2]]
    assert f"next page: --before {ids[2]}" in first.output
    second = run_cli(pikku, "runs", "--limit", "2", "--before", ids[2])
    assert [line.split()[0] for line in second.output.splitlines()[1:3]] == [ids[1], ids[0]]
    assert "RuntimeError" in first.output  # the failed run's error, on one line

    as_json = json.loads(run_cli(pikku, "runs", "--status", "completed", "--json").output)
    assert [r["run_id"] for r in as_json["runs"]] == ids[::-1] and as_json["next"] is None
    only = json.loads(run_cli(pikku, "runs", "--workflow", "fails", "--json").output)
    assert [r["run_id"] for r in only["runs"]] == [failed]
    assert run_cli(pikku, "runs", "--workflow", "none").output.strip() == "no runs"


def test_runs_refuses_bad_options_in_one_line(pikku: PikkuCelery) -> None:
    assert run_cli(pikku, "runs", "--status", "done").exit_code == 2  # click's usage error
    assert run_cli(pikku, "runs", "--limit", "0").exit_code == 2
    line = one_line_error(run_cli(pikku, "runs", "--before", "ghost"))
    assert line == "Error: WorkflowRunNotFoundError: no workflow run with id 'ghost'"


def test_user_data_prints_as_written(pikku: PikkuCelery) -> None:
    run_id = pikku.start("sum", {"a": 1, "b": 2, "note": "[bold red]x[/] \x1b[31m"},
                         inline=True)
    shown = run_cli(pikku, "show", run_id)
    assert '"note": "[bold red]x[/] \\u001b[31m"' in shown.output  # no markup, no escape


# --- show ---------------------------------------------------------------------------------


def test_show_prints_each_attempt_and_marks_the_superseded_one(pikku: PikkuCelery) -> None:
    run_id = superseded_run(pikku)
    shown = run_cli(pikku, "show", run_id)
    assert shown.exit_code == 0, shown.output
    rows = [line for line in shown.output.splitlines() if line.startswith("add ")]
    assert len(rows) == 2
    first, second = rows
    assert "1/4" in first and "superseded ⟲" in first and "worker-a@host1" in first
    assert "WorkflowStepLeaseExpiredError" in first
    assert "2/4" in second and "succeeded" in second and "worker-b@host2" in second
    assert "superseded" not in second
    assert "1/1 steps settled, 2 attempts (1 superseded)" in shown.output
    assert "completed" in shown.output and "5" in shown.output  # status and output

    data = json.loads(run_cli(pikku, "show", run_id, "--json").output)
    attempts = data["attempts"]
    assert [(a["attempt"], a["superseded"], a["worker"]) for a in attempts] == [
        (1, True, "worker-a@host1"), (2, False, "worker-b@host2")]
    # The superseded attempt ends where attempt 2's claim fenced it out.
    assert attempts[0]["ended_at"] == attempts[1]["started_at"]
    assert attempts[0]["duration_s"] == (LEASE_MS + 2_000) / 1000
    assert data["run"]["output"] == 5 and data["steps"][0]["attempt"] == 2


def test_a_last_attempt_that_lost_its_lease_is_lease_expired_not_superseded(
        pikku: PikkuCelery) -> None:
    store = pikku.engine.store
    t0 = now_ms() - 60_000
    store.create_run(NewRun("expired-1", "sum", None), t0)
    store.insert_step(NewStep("expired-1", "add", ADD, max_attempts=1), t0)
    store.claim_step("expired-1", "add", ADD, t0 + 10, LEASE_MS, worker="w1")
    store.claim_step("expired-1", "add", ADD, t0 + LEASE_MS + 20, LEASE_MS)  # expires it
    data = json.loads(run_cli(pikku, "show", "expired-1", "--json").output)
    assert [(a["outcome"], a["superseded"]) for a in data["attempts"]] == [
        ("lease-expired", False)]


def test_show_prints_the_run_state_with_its_version(pikku: PikkuCelery) -> None:
    run_id = "state-run"
    store = pikku.engine.store
    store.create_run(NewRun(run_id=run_id, workflow="w", input=None), now_ms())
    assert "state (v" not in run_cli(pikku, "show", run_id).output
    store.write_run_state(run_id, "tick#2", {"visits": 2}, 0, now_ms())
    shown = run_cli(pikku, "show", run_id)
    assert shown.exit_code == 0, shown.output
    assert "state (v1)" in shown.output and '{"visits": 2}' in shown.output


def test_show_of_an_unknown_run_is_one_line(pikku: PikkuCelery) -> None:
    line = one_line_error(run_cli(pikku, "show", "ghost"))
    assert line == "Error: WorkflowRunNotFoundError: no workflow run with id 'ghost'"
    assert one_line_error(run_cli(pikku, "show", "$bad")).startswith(
        "Error: InvalidInputError:")


def test_show_gives_tracebacks_only_when_asked(pikku: PikkuCelery) -> None:
    run_id = pikku.start("fails", None, inline=True)
    assert "Traceback (most recent call last)" not in run_cli(pikku, "show", run_id).output
    assert "Traceback (most recent call last)" in run_cli(
        pikku, "show", run_id, "--tracebacks").output


# --- watch --------------------------------------------------------------------------------


@pytest.mark.parametrize(("workflow", "code"), [("sum", 0), ("fails", 1)])
def test_watch_of_an_ended_run_exits_with_its_outcome(pikku: PikkuCelery, workflow: str,
                                                      code: int) -> None:
    run_id = pikku.start(workflow, {"a": 1, "b": 1}, inline=True)
    watched = run_cli(pikku, "watch", run_id)
    assert watched.exit_code == code, watched.output
    assert f"run {run_id} {'completed' if code == 0 else 'failed'}" in watched.output


def test_watch_follows_a_live_run_until_it_is_cancelled(
        pikku: PikkuCelery, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = pikku.start("waits", None, inline=True)  # suspended until resumed
    waits: list[float] = []

    def between_reads(interval_s: float) -> None:
        waits.append(interval_s)
        if len(waits) == 3:  # the run ends while watched
            pikku.cancel(run_id, "operator")

    monkeypatch.setattr(cli_module, "_sleep", between_reads)
    watched = run_cli(pikku, "watch", run_id, "--interval", "0.5")
    assert watched.exit_code == 2, watched.output
    assert waits == [0.5, 0.5, 0.5]
    assert f"run {run_id} cancelled" in watched.output


def test_watch_that_cannot_watch_exits_3(pikku: PikkuCelery) -> None:
    line = one_line_error(run_cli(pikku, "watch", "ghost"), code=3)
    assert "WorkflowRunNotFoundError" in line
    unbound = run_cli(Celery("no-pikku", set_as_current=False), "watch", "x")
    assert "no PikkuCelery" in one_line_error(unbound, code=3)


# --- cancel, resume, approve ---------------------------------------------------------------


def test_approve(pikku: PikkuCelery) -> None:
    run_id = pikku.start("gated", None, inline=True)
    bad = one_line_error(run_cli(pikku, "approve", run_id, "manager", "--decision", "yes"))
    assert "--decision is not JSON" in bad
    refused = one_line_error(run_cli(pikku, "approve", run_id, "manager", "--decision",
                                     '"yes"', "--by", "admin"))
    assert "WorkflowApprovalError" in refused and "does not match its schema" in refused
    unauthorized = one_line_error(run_cli(pikku, "approve", run_id, "manager", "--decision",
                                          "true", "--by", "eve"))
    assert "'eve' is not one of its approvers" in unauthorized
    assert pikku.get_run(run_id).status == "suspended"
    done = run_cli(pikku, "approve", run_id, "manager", "--decision", "true", "--by", "admin")
    assert done.exit_code == 0, done.output
    assert done.output == f"approved 'manager' of run {run_id}: true\n"
    assert pikku.get_run(run_id).status == "running"
    again = one_line_error(run_cli(pikku, "approve", run_id, "manager", "--decision", "true",
                                   "--by", "admin", "--json"))
    assert "already decided" in again



def test_cancel_and_resume(pikku: PikkuCelery) -> None:
    suspended = pikku.start("waits", None, inline=True)
    assert run_cli(pikku, "cancel", "--help").exit_code == 0
    line = one_line_error(run_cli(pikku, "resume", pikku.start("sum", {"a": 1, "b": 1},
                                                               inline=True)))
    assert "is completed, not suspended: nothing to resume" in line
    resumed = run_cli(pikku, "resume", suspended)
    assert resumed.exit_code == 0 and resumed.output == f"resumed run {suspended}\n"
    assert pikku.get_run(suspended).status == "running"
    cancelled = run_cli(pikku, "cancel", suspended, "--reason", "duplicate order")
    assert cancelled.exit_code == 0 and cancelled.output == f"cancelled run {suspended}\n"
    run = pikku.get_run(suspended)
    assert run.status == "cancelled" and run.cancel_reason == "duplicate order"
    again = one_line_error(run_cli(pikku, "cancel", suspended))
    assert "has already ended (cancelled): nothing to cancel" in again
    assert "WorkflowRunNotFoundError" in one_line_error(run_cli(pikku, "cancel", "ghost"))


# --- purge --------------------------------------------------------------------------------


def _aged(pikku: PikkuCelery, run_id: str, status: str, age_days: float) -> str:
    store = pikku.engine.store
    at = now_ms() - int(age_days * DAY_MS)
    store.create_run(NewRun(run_id, "sum", None), at)
    store.insert_step(NewStep(run_id, "add", ADD, max_attempts=2), at)
    store.claim_step(run_id, "add", ADD, at, LEASE_MS)
    store.set_result(run_id, "add", 1, 1, at)
    if status != "running":
        store.transition_run(run_id, ["running"], status, at)
    return run_id


def test_purge_deletes_old_ended_runs_and_never_a_live_one(pikku: PikkuCelery) -> None:
    old = [_aged(pikku, f"old-{s}", s, 40) for s in ("completed", "failed", "cancelled")]
    live_old = _aged(pikku, "old-running", "running", 400)
    recent = _aged(pikku, "recent", "completed", 2)

    dry = run_cli(pikku, "purge", "--older-than", "30d", "--dry-run")
    assert dry.output == ("would delete 3 runs (cancelled, completed, failed) that ended "
                          "more than 30d ago\n")
    assert all(pikku.engine.store.get_run(r) is not None for r in old)

    only = run_cli(pikku, "purge", "--older-than", "30d", "--status", "failed")
    assert only.exit_code == 0 and only.output.startswith("deleted 1 run (failed)")
    done = run_cli(pikku, "purge", "--older-than", "30d", "--batch", "1")
    assert done.output.startswith("deleted 2 runs")
    store = pikku.engine.store
    for run_id in old:
        assert store.get_run(run_id) is None and store.get_history(run_id) == []
    assert store.get_run(live_old) is not None and store.list_steps(live_old)
    assert store.get_run(recent) is not None


def test_purge_refuses_a_bad_age_or_a_live_status(pikku: PikkuCelery) -> None:
    assert "invalid older_than" in one_line_error(
        run_cli(pikku, "purge", "--older-than", "a month"))
    assert run_cli(pikku, "purge", "--older-than", "1d", "--status", "running"
                   ).exit_code == 2
    assert run_cli(pikku, "purge").exit_code == 2  # --older-than is required


# --- check --------------------------------------------------------------------------------


def _pikku_on(store: Any, leases: Any) -> PikkuCelery:
    app = Celery("check", set_as_current=False)
    pikku = PikkuCelery(app, store=store, leases=leases, worker_reaper=False)

    @pikku.step(name="check.add")
    def add(data: Any) -> Any:
        return data

    @pikku.workflow("adding")
    def adding(wf: Any, data: Any) -> Any:
        return wf.do("add", add, data)

    return pikku


@pytest.fixture
def mongo_store(mongo_server: Any) -> Iterator[MongoWorkflowStore]:
    """A store without its indexes, on a database of its own on the real MongoDB."""
    db, client = mongo_database("mongod", mongo_server)
    yield MongoWorkflowStore(db, create_indexes=False)
    client.drop_database(db.name)  # type: ignore[attr-defined]
    client.close()  # type: ignore[attr-defined]


def test_check_passes_and_lists_what_is_registered(pikku: PikkuCelery) -> None:
    checked = run_cli(pikku, "check")
    assert checked.exit_code == 0, checked.output
    # Shared declarations of other test modules bind to every instance: check ours are
    # listed, in order, without assuming nothing else was declared in this process.
    listed = {line.split(":", 1)[0].split(" (")[0]: line.split(": ", 1)[1].split(", ")
              for line in checked.output.splitlines()
              if line.startswith(("workflows (", "steps ("))}
    assert [w for w in listed["workflows"] if w in {"fails", "gated", "sum", "waits"}] == [
        "fails", "gated", "sum", "waits"]
    assert {"contrib.add", "contrib.boom", "contrib.undo"} <= set(listed["steps"])


def test_check_names_missing_indexes_and_creates_them(
        mongo_store: MongoWorkflowStore, redis_client: Any, key_prefix: str) -> None:
    pikku = _pikku_on(mongo_store, RedisLeaseService(redis_client, key_prefix=key_prefix))
    checked = run_cli(pikku, "check")
    assert checked.exit_code == 1
    problems = [line for line in checked.output.splitlines() if line.startswith("problem:")]
    declared = sum(len(indexes) for indexes in INDEXES.values())
    assert len(problems) == declared and "workflow_runs (status, updated_ms)" in problems[0]
    assert "ok       Redis at redis://" in checked.output
    fixed = run_cli(pikku, "check", "--create-indexes")
    assert fixed.exit_code == 0, fixed.output
    assert "every index exists" in fixed.output


def test_check_gives_one_line_per_unreachable_service() -> None:
    mongo = MongoWorkflowStore.from_url(f"mongodb://app:s3cret@127.0.0.1:{free_port()}/shop",
                                        server_selection_timeout="200ms")
    redis_port = free_port()
    leases = RedisLeaseService.from_url(f"redis://:pw@127.0.0.1:{redis_port}/0",
                                        key_prefix="check")
    checked = run_cli(_pikku_on(mongo, leases), "check")
    assert checked.exit_code == 1
    problems = [line for line in checked.output.splitlines() if line.startswith("problem:")]
    assert len(problems) == 2, checked.output
    assert problems[0].startswith("problem: MongoUnreachableError: MongoDB at mongodb://"
                                  "127.0.0.1:")
    assert f"Redis at redis://127.0.0.1:{redis_port}/0 is unreachable" in problems[1]
    assert "s3cret" not in checked.output and "Traceback" not in checked.output


def test_check_names_a_missing_setting_and_an_app_without_workflows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pikku_celery.worker import shared

    monkeypatch.setattr(shared, "_hooks", [])  # no shared declaration of another module
    app = Celery("bare", set_as_current=False)
    PikkuCelery(app, worker_reaper=False)
    checked = run_cli(app, "check")
    assert checked.exit_code == 1
    problems = [line for line in checked.output.splitlines() if line.startswith("problem:")]
    assert "PikkuConfigurationError" in problems[0] and "pikku_mongo_url" in problems[0]
    assert "no workflow is registered" in problems[1]


def test_check_names_a_url_the_driver_refused_without_its_password(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A password with an unescaped '/': redis-py's own message quotes its head."""
    from pikku_celery.worker import shared

    monkeypatch.setattr(shared, "_hooks", [])
    app = Celery("leaky", set_as_current=False)
    app.conf.update(pikku_mongo_url="mongodb://127.0.0.1:1/shop",
                    pikku_redis_url="redis://:Xk9pQ2mZ/7vLr@redis.internal:6379/0")
    PikkuCelery(app, worker_reaper=False)
    checked = run_cli(app, "check")
    assert checked.exit_code == 1
    problems = [line for line in checked.output.splitlines() if line.startswith("problem:")]
    assert problems[0].startswith("problem: PikkuConfigurationError: invalid pikku_redis_url")
    assert "redis://:***@redis.internal:6379/0" in problems[0]
    assert "Xk9pQ2mZ" not in checked.output and "7vLr" not in checked.output


class FakeInspect:
    """What ``app.control.inspect(timeout=...)`` answers: the workers' queues and tasks."""

    def __init__(self, queues: dict[str, list[str]], tasks: dict[str, list[str]]) -> None:
        self._queues, self._tasks = queues, tasks

    def active_queues(self) -> dict[str, list[dict[str, Any]]] | None:
        return {node: [{"name": q} for q in names] for node, names in self._queues.items()
                } or None

    def registered(self) -> dict[str, list[str]] | None:
        return self._tasks or None


def _checked_with_workers(monkeypatch: pytest.MonkeyPatch, app: Celery,
                          queues: dict[str, list[str]], tasks: dict[str, list[str]],
                          *args: str) -> tuple[Result, list[str]]:
    from tests.conftest import REDIS_URL

    app.conf.broker_url = REDIS_URL  # answers: only the workers' answers are made up
    monkeypatch.setattr(app.control, "inspect",
                        lambda timeout: FakeInspect(queues, tasks))
    checked = run_cli(app, "check", *args)
    return checked, [line for line in checked.output.splitlines()
                     if line.startswith("warning  ")]


def test_check_warns_of_celerys_default_queue_shared_by_every_app(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36: two apps on Celery's default queue lose each other's tasks; the
    quickstart's own queue is not warned of."""
    pikku = _pikku_on(InMemoryWorkflowStore(), InMemoryLeaseService())
    checked, warnings = _checked_with_workers(monkeypatch, pikku.app, {}, {})
    assert checked.exit_code == 0, checked.output  # a warning, not a problem
    assert "queue: celery" in checked.output
    assert len(warnings) == 1, checked.output
    assert "Celery's default queue 'celery', which every app that names no queue shares" in (
        warnings[0])
    assert "app.conf.task_default_queue = 'check'" in warnings[0]
    assert "workers (0) running this app's workflows from 'celery': - (none answered" in (
        checked.output)

    pikku.app.conf.task_default_queue = "check"
    checked, warnings = _checked_with_workers(monkeypatch, pikku.app, {}, {})
    assert checked.exit_code == 0 and warnings == [], checked.output
    assert "queue: check" in checked.output

    own = _pikku_on(InMemoryWorkflowStore(), InMemoryLeaseService())
    own.app.conf.pikku_queue = "check-pikku"  # pikku's own queue: its tasks go there
    checked, warnings = _checked_with_workers(monkeypatch, own.app, {}, {})
    assert warnings == [] and "queue: check-pikku" in checked.output, checked.output


def test_check_warns_of_a_worker_that_consumes_the_queue_without_this_apps_tasks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pikku_celery import internal_task_names

    pikku = _pikku_on(InMemoryWorkflowStore(), InMemoryLeaseService())
    pikku.app.conf.task_default_queue = "shop"
    ours = internal_task_names(pikku.app)["orchestrate"]
    queues = {"w1@a": ["shop"], "w2@b": ["shop", "other"], "w3@c": ["other"]}
    tasks = {"w1@a": [ours, "check.add"], "w2@b": ["pikku.billing.orchestrate"],
             "w3@c": ["pikku.billing.orchestrate"]}
    checked, warnings = _checked_with_workers(monkeypatch, pikku.app, queues, tasks)
    assert checked.exit_code == 0, checked.output
    assert len(warnings) == 1, checked.output
    assert warnings[0].startswith(f"warning  worker w2@b consumes queue 'shop' but has not "
                                  f"registered this app's {ours}: it discards this app's "
                                  "tasks it takes as unregistered")
    assert "workers (1) running this app's workflows from 'shop': w1@a" in checked.output

    checked, warnings = _checked_with_workers(monkeypatch, pikku.app, queues, tasks,
                                              "--no-workers")
    assert warnings == [] and "workers (" not in checked.output, checked.output


def test_check_says_when_the_broker_cannot_be_asked() -> None:
    pikku = _pikku_on(InMemoryWorkflowStore(), InMemoryLeaseService())
    pikku.app.conf.update(broker_url=f"redis://127.0.0.1:{free_port()}/0",
                          task_default_queue="shop")
    checked = run_cli(pikku, "check")
    assert checked.exit_code == 0, checked.output
    assert "workers: not asked, the broker did not answer (" in checked.output


def test_a_read_with_mongodb_unreachable_is_one_line() -> None:
    mongo = MongoWorkflowStore.from_url(f"mongodb://127.0.0.1:{free_port()}/shop",
                                        server_selection_timeout="200ms")
    line = one_line_error(run_cli(_pikku_on(mongo, InMemoryLeaseService()), "runs"))
    assert line.startswith("Error: MongoUnreachableError: MongoDB at mongodb://127.0.0.1:")


def test_an_app_without_pikku_is_one_line() -> None:
    line = one_line_error(run_cli(Celery("no-pikku", set_as_current=False), "show", "x"))
    assert "no PikkuCelery is bound to Celery app 'no-pikku'" in line


# --- dashboard ----------------------------------------------------------------------------


def test_the_dashboard_binds_beyond_loopback_only_with_authorize_or_token(
        pikku: PikkuCelery) -> None:
    line = one_line_error(run_cli(pikku, "dashboard", "--host", "0.0.0.0"))
    assert "without --authorize or PIKKU_DASHBOARD_TOKEN" in line
    assert cli_module.is_loopback("127.0.0.1") and cli_module.is_loopback("::1")
    assert cli_module.is_loopback("localhost") and not cli_module.is_loopback("10.0.0.1")


def test_in_memory_store_has_nothing_to_ping() -> None:
    pikku = _pikku_on(InMemoryWorkflowStore(), InMemoryLeaseService())
    checked = run_cli(pikku, "check")
    assert "nothing to reach" in checked.output and checked.exit_code == 0


def test_retry(pikku: PikkuCelery) -> None:
    """``pikku retry`` (issue 25 item 2): a cancelled run runs again; any other status is
    one line and exit 1."""
    waiting = pikku.start("waits", None, inline=True)
    line = one_line_error(run_cli(pikku, "retry", waiting))
    assert "is suspended, not failed or cancelled: nothing to retry" in line
    assert pikku.cancel(waiting, "by mistake")
    retried = run_cli(pikku, "retry", waiting)
    assert retried.exit_code == 0 and retried.output == f"retrying run {waiting}\n"
    assert pikku.get_run(waiting).status == "running"
    assert "WorkflowRunNotFoundError" in one_line_error(run_cli(pikku, "retry", "ghost"))


def test_fork(pikku: PikkuCelery) -> None:
    done = pikku.start("sum", {"a": 1, "b": 1}, inline=True)
    step = pikku.get_steps(done)[0].step_name
    forked = run_cli(pikku, "fork", done, "--from", step, "--run-id", "cli-fork")
    assert forked.exit_code == 0, forked.output
    assert forked.output == f"forked run cli-fork from run {done} at step {step!r}\n"
    assert pikku.get_run("cli-fork").input == {"a": 1, "b": 1}
    assert "recorded no step 'nope'" in one_line_error(run_cli(pikku, "fork", done, "--from",
                                                               "nope"))
