"""A fork and a retry as ``pikku`` shows them (issue 31, "Lineage a person can read"):
``pikku fork --keep-decisions --by``, ``pikku retry --by``, and ``pikku show`` naming a
fork's source and a source's forks, who retried and when, and each attempt with the total
it ran under."""

from __future__ import annotations

import json

from pikku_celery import PikkuCelery
from pikku_celery.store.base import NewRun, NewStep
from tests.support.operate import ADD, LEASE_MS, now_ms
from tests.unit.test_cli import one_line_error, pikku, run_cli

__all__ = ["pikku"]  # the fixture


def test_fork_and_retry_by_someone_are_shown_both_ways(pikku: PikkuCelery) -> None:
    done = pikku.start("sum", {"a": 1, "b": 1}, inline=True)
    forked = run_cli(pikku, "fork", done, "--from", "add", "--run-id", "lin-fork",
                     "--keep-decisions", "--by", "ann")
    assert forked.output == f"forked run lin-fork from run {done} at step 'add', " \
                            "decisions kept\n"
    assert pikku.cancel("lin-fork")
    assert run_cli(pikku, "retry", "lin-fork", "--by", "bob").exit_code == 0

    shown = run_cli(pikku, "show", "lin-fork").output
    [made] = [line for line in shown.splitlines() if line.startswith("forked from")]
    assert done in made and "at step 'add'" in made and "by ann" in made
    assert "decisions kept" in made
    [retried] = [line for line in shown.splitlines() if line.startswith("retried")]
    assert "by bob" in retried
    source = run_cli(pikku, "show", done).output
    assert [line.split()[-1] for line in source.splitlines() if line.startswith("forks")] == [
        "lin-fork"]

    data = json.loads(run_cli(pikku, "show", "lin-fork", "--json").output)
    assert data["run"]["forked_from"] == done
    assert [(e["op"], e["by"], e["from_step"], e["run_id"]) for e in data["run"]["lineage"]] \
        == [("fork", "ann", "add", done), ("retry", "bob", None, None)]
    assert json.loads(run_cli(pikku, "show", done, "--json").output)["forks"] == ["lin-fork"]


def test_fork_into_another_runs_id_is_one_line(pikku: PikkuCelery) -> None:
    done = pikku.start("sum", {"a": 1, "b": 1}, inline=True)
    other = pikku.start("sum", {"a": 1, "b": 1}, run_id="lin-other", inline=True)
    line = one_line_error(run_cli(pikku, "fork", done, "--from", "add", "--run-id", other))
    assert "WorkflowRunConflictError" in line and "not the fork of run" in line


def test_show_gives_each_attempt_the_total_it_ran_under(pikku: PikkuCelery) -> None:
    """Before: the attempts of a step of 2 read 1/4 and 2/4 once a retry gave it 4."""
    store = pikku.engine.store
    t0 = now_ms() - 60_000
    store.create_run(NewRun("lin-totals", "sum", {"a": 2, "b": 3}), t0)
    store.insert_step(NewStep("lin-totals", "add", ADD, {"a": 2, "b": 3}, max_attempts=2), t0)
    for attempt in (1, 2):
        at = t0 + 1_000 * attempt
        assert store.claim_step("lin-totals", "add", ADD, at, LEASE_MS).state is not None
        store.set_error("lin-totals", "add", attempt, {"type": "E", "message": "no"}, at + 1,
                        retry_at_ms=at + 2)
    assert store.transition_run("lin-totals", ["running"], "failed", t0 + 5_000)
    assert store.retry_run("lin-totals", t0 + 6_000) is not None
    assert store.claim_step("lin-totals", "add", ADD, t0 + 7_000, LEASE_MS).state is not None
    store.set_result("lin-totals", "add", 3, 5, t0 + 7_500)

    rows = [line.split()[1] for line in run_cli(pikku, "show", "lin-totals").output
            .splitlines() if line.startswith("add ")]
    assert rows == ["1/2", "2/2", "3/4"]
