"""``retry_run`` on every store (issue 25 item 2): a failed or cancelled run goes live again
and each step its end left failed for good is reopened (``store._retry``), earlier attempts
kept; any other run is refused with nothing written."""

from __future__ import annotations

import pytest

from pikku_celery.model import keys
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.records import RUN_CANCELLED, RUN_FAILED, RUN_RUNNING
from pikku_celery.store.base import NewStep, WorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.contract.test_store import FN, LEASE, T0, add_step, new_run, store

__all__ = ["store"]  # the fixture, parametrized over every store


def test_a_failed_run_goes_live_and_its_failed_step_gets_a_fresh_budget(
        store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, "ok", retries=0)
    add_step(store, run_id, "boom", retries=1)  # 2 attempts
    assert store.claim_step(run_id, "ok", FN, T0, LEASE).state is not None
    store.set_result(run_id, "ok", 1, "fine", T0 + 1)
    for attempt in (1, 2):
        claimed = store.claim_step(run_id, "boom", FN, T0 + 10 * attempt, LEASE).state
        assert claimed is not None and claimed.attempt == attempt
        store.set_error(run_id, "boom", attempt, {"type": "E", "message": f"#{attempt}"},
                        T0 + 10 * attempt + 1, retry_at_ms=T0 + 10 * attempt + 2)
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_FAILED, T0 + 50,
                                error={"type": "E", "message": "boom"})

    reopened = store.retry_run(run_id, T0 + 100)

    assert reopened is not None and [s.step_name for s in reopened] == ["boom"]
    run = store.get_run(run_id)
    assert run is not None and (run.status, run.error, run.output) == (RUN_RUNNING, None, None)
    boom = store.get_step(run_id, "boom")
    assert boom is not None and (boom.status, boom.attempt, boom.max_attempts) == (
        "failed", 2, 4)  # two more attempts: its first budget again
    assert store.get_step(run_id, "ok").status == "succeeded"  # type: ignore[union-attr]
    # The next claim takes attempt 3; attempts 1 and 2 stay in the history.
    again = store.claim_step(run_id, "boom", FN, T0 + 101, LEASE).state
    assert again is not None and again.attempt == 3
    history = [(h.attempt, h.status) for h in store.get_history(run_id) if h.step_name == "boom"]
    assert history == [(1, "failed"), (2, "failed"), (3, "running")]
    # A second retry, after the step failed again, gives the same budget again.
    store.set_error(run_id, "boom", 3, {"type": "E", "message": "#3"}, T0 + 102, final=True)
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_FAILED, T0 + 103)
    assert store.retry_run(run_id, T0 + 104) is not None
    assert store.get_step(run_id, "boom").max_attempts == 5  # type: ignore[union-attr]


def test_a_cancelled_runs_fenced_steps_and_gates_are_reopened(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, "pending")
    add_step(store, run_id, "running")
    assert store.claim_step(run_id, "running", FN, T0, LEASE).state is not None
    store.insert_steps([
        NewStep(run_id=run_id, step_name="nap", function=None, status="scheduled",
                due_ms=T0 + 9_000),
        NewStep(run_id=run_id, step_name="__approval:boss", function=None, status="scheduled",
                data={"approval": "boss", "expires_at_ms": T0 + 99_000}, due_ms=T0 + 99_000)],
        T0)
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_CANCELLED, T0 + 1,
                                cancel_reason="oops")
    store.cancel_steps(run_id, {"type": "WorkflowCancelledError", "message": "x"}, T0 + 2)

    reopened = store.retry_run(run_id, T0 + 10)

    assert reopened is not None
    assert sorted(s.step_name for s in reopened) == ["__approval:boss", "nap", "pending",
                                                     "running"]
    state = {s.step_name: s for s in store.list_steps(run_id)}
    # Fenced before its first claim: it waits for that claim again, as attempt 1 (no
    # attempt that never ran in its numbering, none missing from its history).
    assert (state["pending"].status, state["pending"].attempt) == ("pending", 1)
    first = store.claim_step(run_id, "pending", FN, T0 + 11, LEASE).state
    assert first is not None and first.attempt == 1
    assert [(h.attempt, h.status) for h in store.get_history(run_id)
            if h.step_name == "pending"] == [(1, "running")]
    assert state["running"].status == "failed" and state["running"].attempt == 1
    assert state["nap"].status == "scheduled"  # cut short by the cancel: due at once
    gate = state["__approval:boss"]
    assert gate.status == "scheduled" and gate.due_at is not None  # waits to its expiry
    assert store.claim_step(run_id, "running", FN, T0 + 11, LEASE).state.attempt == 2  # type: ignore[union-attr]
    run = store.get_run(run_id)
    assert run is not None and run.status == RUN_RUNNING and run.cancel_reason is None


@pytest.mark.parametrize("status", ["running", "completed", "suspended"])
def test_only_a_failed_or_cancelled_run_is_retried(store: WorkflowStore, status: str) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    if status != "running":
        assert store.transition_run(run_id, [RUN_RUNNING], status, T0 + 1)
    before = (store.get_run(run_id), store.list_steps(run_id))
    assert store.retry_run(run_id, T0 + 2) is None
    assert (store.get_run(run_id), store.list_steps(run_id)) == before


def test_the_end_mark_goes_with_a_retry(store: WorkflowStore) -> None:
    """MongoDB's end mark: gone once the run is live again, so steps run in place after a
    retry need no run read; a second end writes it again."""
    run_id = new_run(store)
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_CANCELLED, T0 + 1)
    assert store.retry_run(run_id, T0 + 2) == []
    if isinstance(store, MongoWorkflowStore):
        steps = store.db[keys.STEPS]
        assert steps.count_documents({"_id": keys.run_end_mark_id(run_id)}) == 0
    claimed = store.claim_new_step(NewStep(run_id=run_id, step_name="after", function=FN),
                                   T0 + 3, LEASE)
    assert claimed.state is not None and claimed.run_status is None


def test_a_retry_is_recorded_in_the_runs_lineage(store: WorkflowStore) -> None:
    run_id = new_run(store)
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_FAILED, T0 + 1)
    assert store.retry_run(run_id, T0 + 2, by="ops@example.com") == []
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_CANCELLED, T0 + 3)
    assert store.retry_run(run_id, T0 + 4) == []
    doc_lineage = [(e.op, e.by) for e in store.get_run(run_id).lineage]  # type: ignore[union-attr]
    assert doc_lineage == [("retry", "ops@example.com"), ("retry", None)]
    with pytest.raises(InvalidInputError, match="retried by"):
        store.retry_run(run_id, T0 + 5, by="x" * 201)


def test_a_queued_retry_touches_no_step_until_its_admission(store: WorkflowStore) -> None:
    """A run of a limited workflow retried: ``queued`` first, holding no slot and with its
    steps as its end left them (nothing can be claimed: the end's mark stays); its admission
    moves it to ``running`` and reopens them as a retry does (issue 31, defect 3)."""
    run_id = new_run(store)
    add_step(store, run_id, "boom", retries=0)
    assert store.claim_step(run_id, "boom", FN, T0, LEASE).state is not None
    store.set_error(run_id, "boom", 1, {"type": "E", "message": "m"}, T0 + 1, final=True)
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_FAILED, T0 + 2)
    before = store.list_steps(run_id)

    assert store.retry_run(run_id, T0 + 3, queued=True) == []
    assert store.get_run(run_id).status == "queued"  # type: ignore[union-attr]
    assert store.list_steps(run_id) == before
    assert store.claim_step(run_id, "boom", FN, T0 + 4, LEASE).state is None
    assert store.retry_run(run_id, T0 + 4, queued=True) is None  # not ended now

    reopened = store.admit_run(run_id, T0 + 5)
    assert reopened is not None and [s.step_name for s in reopened] == ["boom"]
    assert store.get_run(run_id).status == RUN_RUNNING  # type: ignore[union-attr]
    assert store.admit_run(run_id, T0 + 6) is None  # not queued: nothing written
    assert store.claim_step(run_id, "boom", FN, T0 + 7, LEASE).state.attempt == 2  # type: ignore[union-attr]


def test_admitting_a_run_never_started_reopens_nothing(store: WorkflowStore) -> None:
    run_id = new_run(store)
    assert store.transition_run(run_id, [RUN_RUNNING], "queued", T0 + 1)
    assert store.admit_run(run_id, T0 + 2) == []
    assert store.get_run(run_id).status == RUN_RUNNING  # type: ignore[union-attr]


def test_a_fence_while_ended_leaves_what_a_retry_reopened(store: WorkflowStore) -> None:
    """``cancel_steps(while_ended=True)`` fences only while the end stands: after a retry
    revived the run it fences nothing (issue 31, defect 4); before, it fences as ever."""
    run_id = new_run(store)
    add_step(store, run_id, "waiting")
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_CANCELLED, T0 + 1)
    error = {"type": "WorkflowCancelledError", "message": "x"}
    assert store.cancel_steps(run_id, error, T0 + 2, while_ended=True) == 1
    assert store.retry_run(run_id, T0 + 3) is not None
    reopened = store.get_step(run_id, "waiting")
    assert reopened is not None and reopened.due_at is not None  # due again
    assert store.cancel_steps(run_id, error, T0 + 4, while_ended=True) == 0
    assert store.get_step(run_id, "waiting") == reopened


def test_replayed_steps_are_copied_as_succeeded_once(store: WorkflowStore) -> None:
    """``insert_replayed_steps`` (a fork): the succeeded steps of another run become
    succeeded steps of the new one, with their results and one closed history entry; a
    step the new run has is kept."""
    source = new_run(store)
    add_step(store, source, "a")
    assert store.claim_step(source, "a", FN, T0, LEASE).state is not None
    done = store.set_result(source, "a", 1, {"total": 3}, T0 + 1)
    fork = new_run(store)
    assert store.insert_replayed_steps(fork, [done], T0 + 5, source_run_id=source) == 1
    copied = store.get_step(fork, "a")
    assert copied is not None and (copied.status, copied.result, copied.attempt) == (
        "succeeded", {"total": 3}, 1)
    assert [(h.attempt, h.status) for h in store.get_history(fork)] == [(1, "succeeded")]
    assert store.insert_replayed_steps(fork, [done], T0 + 6, source_run_id=source) == 0
    assert store.get_step(source, "a") == done  # the source is untouched


def test_a_retry_cut_short_after_its_first_write_is_finished_by_resume_retry(
        store: WorkflowStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """MongoDB's ``retry_run`` is several writes: the run goes live first. An election
    interrupting the call after that write left the run live with its steps still failed,
    and a second ``retry`` was refused (not failed any more): the run failed again with
    the stored error. The first write now says a reopen is owed; ``resume_retry`` does it.
    A store whose retry is one atomic step has nothing to resume."""
    run_id = new_run(store)
    add_step(store, run_id, "boom", retries=0)
    assert store.claim_step(run_id, "boom", FN, T0, LEASE).state is not None
    store.set_error(run_id, "boom", 1, {"type": "E", "message": "#1"}, T0 + 1, final=True)
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_FAILED, T0 + 2)
    assert store.resume_retry(run_id, T0 + 3) is None  # nothing owed: the run is failed

    if isinstance(store, MongoWorkflowStore):
        def cut_short(run_id: str, now_ms: int) -> list[object]:
            raise TimeoutError("an election interrupted the call after its first write")
        monkeypatch.setattr(store, "_reopen_steps", cut_short)
        with pytest.raises(TimeoutError):
            store.retry_run(run_id, T0 + 10)
        monkeypatch.undo()
        run = store.get_run(run_id)
        assert run is not None and run.status == RUN_RUNNING
        assert store.get_step(run_id, "boom").status == "failed"  # type: ignore[union-attr]
        assert store.retry_run(run_id, T0 + 11) is None  # live: a plain retry is refused

        reopened = store.resume_retry(run_id, T0 + 12)

        assert reopened is not None and [s.step_name for s in reopened] == ["boom"]
        boom = store.get_step(run_id, "boom")
        assert boom is not None and boom.due_at is not None  # reopened: due again
        assert store.resume_retry(run_id, T0 + 13) is None  # done: nothing owed any more
    else:
        assert store.retry_run(run_id, T0 + 10) is not None
        assert store.resume_retry(run_id, T0 + 11) is None
    again = store.claim_step(run_id, "boom", FN, T0 + 20, LEASE).state
    assert again is not None and again.attempt == 2
