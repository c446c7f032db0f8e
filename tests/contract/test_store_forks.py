"""What a fork and a retry leave in the record, on every store (issue 31): a fork's run
names its source and the fork in the insert that creates it, a run's forks are listed
(from an index on MongoDB), a copied event wait holds no seq of the fork's, and an
attempt keeps the total it ran under after a retry."""

from __future__ import annotations

from datetime import datetime, timezone

from pikku_celery.model.records import RUN_FAILED, RUN_RUNNING, STEP_SCHEDULED, RunLineage
from pikku_celery.store._docs import lineage_entry
from pikku_celery.store.base import NewRun, NewStep, WorkflowStore
from tests.contract.test_store import FN, LEASE, T0, add_step, new_run, store

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

__all__ = ["store"]  # the fixture, parametrized over every store


def _fork(store: WorkflowStore, run_id: str, source: str, at: int) -> tuple[bool, str]:
    entry = lineage_entry("fork", at, by="ann", from_step="b", run_id=source)
    run, created = store.create_run(NewRun(run_id=run_id, workflow="order", input={"n": 1},
                                           forked_from=source, lineage=(entry,)), at)
    assert run.forked_from == source
    return created, run.run_id


def test_a_fork_names_its_source_and_a_run_lists_its_forks(store: WorkflowStore) -> None:
    source = new_run(store)
    assert _fork(store, "fork-b", source, T0 + 2) == (True, "fork-b")
    assert _fork(store, "fork-a", source, T0 + 1) == (True, "fork-a")
    assert _fork(store, "fork-c", source, T0 + 2) == (True, "fork-c")
    other = new_run(store)

    run = store.get_run("fork-a")
    assert run is not None and run.forked_from == source
    assert run.lineage == (RunLineage(
        op="fork", at=datetime.fromtimestamp((T0 + 1) / 1000, tz=UTC), by="ann",
        from_step="b", run_id=source),)
    # Oldest first; forks of one millisecond by id.
    assert [r.run_id for r in store.list_forks(source)] == ["fork-a", "fork-b", "fork-c"]
    assert [r.run_id for r in store.list_forks(source, limit=2)] == ["fork-a", "fork-b"]
    assert store.list_forks(other) == [] and store.list_forks("fork-a") == []
    plain = store.get_run(source)
    assert plain is not None and (plain.forked_from, plain.lineage) == (None, ())


def test_a_retry_is_pushed_after_the_fork_in_the_lineage(store: WorkflowStore) -> None:
    source = new_run(store)
    _fork(store, "fork-r", source, T0 + 1)
    assert store.transition_run("fork-r", [RUN_RUNNING], RUN_FAILED, T0 + 2)
    assert store.retry_run("fork-r", T0 + 3, by="bob") is not None
    run = store.get_run("fork-r")
    assert run is not None
    assert [(e.op, e.by, e.from_step) for e in run.lineage] == [
        ("fork", "ann", "b"), ("retry", "bob", None)]


def test_a_copied_event_wait_keeps_its_payload_but_no_seq(store: WorkflowStore) -> None:
    """Defect 2: the copy held the source's seq, which the fork's waits took as taken."""
    source = new_run(store)
    store.insert_steps([NewStep(run_id=source, step_name="__event:paid", function=None,
                                data={"event": "paid", "expires_at_ms": None},
                                status=STEP_SCHEDULED)], T0)
    result = {"event": "paid", "seq": 1, "payload": "p", "sent_at_ms": T0 + 1}
    assert store.settle_waiting_step(source, "__event:paid", T0 + 2, gate=True, result=result)
    gate = store.get_step(source, "__event:paid")
    assert gate is not None and gate.forked_from is None
    fork = new_run(store)

    assert store.insert_replayed_steps(fork, [gate], T0 + 5, source_run_id=source) == 1

    copied = store.get_step(fork, "__event:paid")
    assert copied is not None and copied.forked_from == source
    assert copied.result == {"event": "paid", "payload": "p", "sent_at_ms": T0 + 1,
                             "forked_seq": 1}
    assert store.get_step(source, "__event:paid") == gate  # the source is untouched


def test_an_attempt_keeps_the_total_it_ran_under_after_retries(store: WorkflowStore) -> None:
    """A step of 2 attempts read "1/2, 2/2"; after a retry (4 attempts) it read "1/4, 2/4"."""
    run_id = new_run(store)
    add_step(store, run_id, "boom", retries=1)  # 2 attempts
    at = T0
    for attempt in (1, 2):
        at += 10
        assert store.claim_step(run_id, "boom", FN, at, LEASE).state is not None
        store.set_error(run_id, "boom", attempt, {"type": "E", "message": "no"}, at + 1,
                        retry_at_ms=at + 2)
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_FAILED, at + 5)
    assert [(h.attempt, h.max_attempts) for h in store.get_history(run_id)] == [(1, 2), (2, 2)]

    assert store.retry_run(run_id, at + 10) is not None
    assert store.claim_step(run_id, "boom", FN, at + 11, LEASE).state is not None
    store.set_error(run_id, "boom", 3, {"type": "E", "message": "no"}, at + 12, final=True)
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_FAILED, at + 13)
    assert store.retry_run(run_id, at + 20) is not None
    assert store.claim_step(run_id, "boom", FN, at + 21, LEASE).state is not None

    assert [(h.attempt, h.status, h.max_attempts) for h in store.get_history(run_id)] == [
        (1, "failed", 2), (2, "failed", 2), (3, "failed", 4), (4, "running", 5)]
