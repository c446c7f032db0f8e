"""``pikku.fork`` done right (issue 31, defects 2, 5 and 6) and the lineage of forks and
retries, driven as workers would run them (in-memory store and leases;
``tests.unit.test_in_place.Worker`` delivers every message).

- a fork only creates a run: the same fork repeated returns it, any other run under the
  new id is a conflict and nothing is written into it (defect 5);
- a fork asks approvals and event waits again unless ``keep_decisions`` (defect 6);
- a wait a fork copied never hides one of the fork's own events (defect 2);
- a fork and a retry are in the record (``forked_from``, ``lineage``, ``list_forks``).

(An attempt's total after a retry: ``tests/contract/test_store_forks.py``.)"""

from __future__ import annotations

from typing import Any

import pytest

from pikku_celery.model import keys
from pikku_celery.model.errors import InvalidInputError, WorkflowRunConflictError
from tests.unit.test_in_place import _app


def _three(pikku: Any, ran: list[str]) -> None:
    @pikku.step(name="fk.work")
    def work(name: str) -> str:
        ran.append(name)
        return f"{name} done"

    @pikku.workflow("fk.three")
    def three(wf: Any, data: Any) -> list[str]:
        return [wf.do("a", work, "a"), wf.do("b", work, "b"), wf.do("c", work, "c")]


def test_a_fork_never_writes_into_a_run_it_did_not_create() -> None:
    """Defect 5: naming an existing run of the same workflow and input as the fork's id
    copied the source's results into it (a live run of another tenant then returned the
    forker's results). Now: a conflict, and that run runs on with its own."""
    pikku, _, worker = _app()
    ran: list[str] = []
    _three(pikku, ran)
    source = pikku.start("fk.three", {"owner": "mallory"})
    worker.drain()
    victim = pikku.start("fk.three", {"owner": "mallory"}, run_id="victim")  # live

    with pytest.raises(WorkflowRunConflictError, match="victim"):
        pikku.fork(source, from_step="c", new_run_id="victim")

    assert pikku.get_steps(victim) == [] and pikku.get_run(victim).forked_from is None
    with pytest.raises(InvalidInputError, match="run victim recorded no step 'a' to fork "
                                                "from; its steps: none"):
        pikku.fork(victim, from_step="a")
    worker.drain()
    assert pikku.get_run(victim).status == "completed"
    assert ran == ["a", "b", "c", "a", "b", "c"]  # the victim ran every step itself
    with pytest.raises(WorkflowRunConflictError):  # the source is no fork of itself
        pikku.fork(source, from_step="c", new_run_id=source)


def test_the_same_fork_repeated_returns_its_run_and_another_fork_under_its_id_conflicts(
        ) -> None:
    pikku, _, worker = _app()
    ran: list[str] = []
    _three(pikku, ran)
    source = pikku.start("fk.three", None)
    worker.drain()
    assert pikku.fork(source, from_step="b", new_run_id="f-1", by="ann") == "f-1"
    worker.drain()
    assert ran == ["a", "b", "c", "b", "c"]  # a was replayed from the copy
    assert pikku.fork(source, from_step="b", new_run_id="f-1") == "f-1"  # the same fork
    worker.drain()
    assert ran == ["a", "b", "c", "b", "c"]  # nothing ran again
    with pytest.raises(WorkflowRunConflictError, match="not the fork of run"):
        pikku.fork(source, from_step="c", new_run_id="f-1")  # another step
    with pytest.raises(WorkflowRunConflictError):
        pikku.fork(source, from_step="b", new_run_id="f-1", keep_decisions=True)
    other = pikku.start("fk.three", None)
    worker.drain()
    with pytest.raises(WorkflowRunConflictError):
        pikku.fork(other, from_step="b", new_run_id="f-1")  # another source


def _approved_payment(pikku: Any, paid: list[str]) -> None:
    @pikku.step(name="fk.pay")
    def pay(order: dict[str, Any]) -> str:
        paid.append(order["id"])
        return f"paid {order['id']}"

    @pikku.step(name="fk.ship")
    def ship(receipt: str) -> str:
        return f"shipped after {receipt}"

    @pikku.workflow("fk.order")
    def order(wf: Any, data: dict[str, Any]) -> str:
        decision = wf.approval("payment", approvers=["boss"])
        if not decision:
            return "refused"
        return str(wf.do("ship", ship, wf.do("pay", pay, data)))


def test_a_fork_asks_an_approval_again_unless_keep_decisions() -> None:
    """Defect 6: a fork from the payment, after the approval, copied the decided gate: the
    payment ran again on someone else's approval. Now the fork waits for its own."""
    pikku, _, worker = _app()
    paid: list[str] = []
    _approved_payment(pikku, paid)
    source = pikku.start("fk.order", {"id": "o-1"})
    worker.drain()
    pikku.approve(source, "payment", True, by="boss")
    worker.drain()
    assert pikku.get_run(source).status == "completed" and paid == ["o-1"]

    forked = pikku.fork(source, from_step="pay", by="clerk")
    worker.drain()
    assert pikku.get_run(forked).status == "suspended"  # waits for its own approval
    assert paid == ["o-1"]  # no second payment on the source's approval
    approval = next(s for s in pikku.get_steps(forked) if s.step_name == "__approval:payment")
    assert approval.status == "scheduled" and approval.forked_from is None
    pikku.approve(forked, "payment", False, by="boss")
    worker.drain()
    assert pikku.get_run(forked).output == "refused" and paid == ["o-1"]

    kept = pikku.fork(source, from_step="pay", keep_decisions=True)
    worker.drain()
    assert pikku.get_run(kept).status == "completed"
    assert paid == ["o-1", "o-1"]  # asked for: the source's approval is kept
    copied = next(s for s in pikku.get_steps(kept) if s.step_name == "__approval:payment")
    assert copied.forked_from == source and copied.result is True


def _two_waits(pikku: Any) -> None:
    @pikku.step(name="fk.echo")
    def echo(value: Any) -> Any:
        return value

    @pikku.workflow("fk.waits")
    def waits(wf: Any, data: Any) -> list[Any]:
        first = wf.wait_for_event("paid")
        between = wf.do("between", echo, first)
        return [between, wf.wait_for_event("paid")]


def test_a_fork_asks_for_events_again_unless_keep_decisions() -> None:
    pikku, _, worker = _app()
    _two_waits(pikku)
    source = pikku.start("fk.waits", None)
    worker.drain()
    pikku.send_event(source, "paid", "s-1")
    worker.drain()
    pikku.send_event(source, "paid", "s-2")
    worker.drain()
    assert pikku.get_run(source).output == ["s-1", "s-2"]

    forked = pikku.fork(source, from_step="between")
    worker.drain()
    assert pikku.get_run(forked).status == "suspended"  # its first wait waits again
    pikku.send_event(forked, "paid", "f-1")
    worker.drain()
    pikku.send_event(forked, "paid", "f-2")
    worker.drain()
    assert pikku.get_run(forked).output == ["f-1", "f-2"]


def test_a_wait_a_fork_copied_hides_none_of_the_forks_own_events() -> None:
    """Defect 2: the copied wait's result held the source's seq 1; the fork's own first
    event is seq 1 too, and its next wait skipped it as taken, waiting for a second."""
    pikku, _, worker = _app()
    _two_waits(pikku)
    source = pikku.start("fk.waits", None)
    worker.drain()
    pikku.send_event(source, "paid", "s-1")
    worker.drain()
    pikku.send_event(source, "paid", "s-2")
    worker.drain()

    # From the second wait: the first (and its event) is copied, the second waits again.
    forked = pikku.fork(source, from_step="__event:paid#2", keep_decisions=True)
    worker.drain()
    assert pikku.get_run(forked).status == "suspended"  # at the second wait
    pikku.send_event(forked, "paid", "f-1")  # the fork's seq 1
    worker.drain()
    assert pikku.get_run(forked).output == ["s-1", "f-1"]
    copied = next(s for s in pikku.get_steps(forked) if s.step_name == "__event:paid")
    assert copied.forked_from == source and "seq" not in copied.result
    assert copied.result["forked_seq"] == 1


def test_a_wait_copied_by_an_earlier_version_hides_none_of_the_forks_events() -> None:
    """A fork made before copies dropped the seq left it in the copied wait's result: the
    fork's waits count only the waits it settled itself (``forked_from`` is ``None``)."""
    pikku, store, worker = _app()
    _two_waits(pikku)
    source = pikku.start("fk.waits", None)
    worker.drain()
    pikku.send_event(source, "paid", "s-1")
    worker.drain()
    forked = pikku.fork(source, from_step="between", new_run_id="old-fork",
                        keep_decisions=True)
    gate = store._steps[keys.invocation_id("old-fork", "__event:paid")]
    gate["result"]["seq"] = gate["result"].pop("forked_seq")  # as an earlier version wrote
    worker.drain()
    pikku.send_event(forked, "paid", "f-1")  # the fork's seq 1
    worker.drain()
    assert pikku.get_run(forked).output == ["s-1", "f-1"]


def test_a_fork_and_a_retry_are_in_the_record_with_links_both_ways() -> None:
    pikku, _, worker = _app()
    ran: list[str] = []
    _three(pikku, ran)
    source = pikku.start("fk.three", None)
    worker.drain()
    assert pikku.get_run(source).lineage == () and pikku.list_forks(source) == []
    # Ids in the order made: forks made in one millisecond are listed by id.
    first = pikku.fork(source, from_step="b", new_run_id="fork-1", by="ann")
    second = pikku.fork(source, from_step="c", new_run_id="fork-2", keep_decisions=True)
    assert pikku.cancel(first)  # before it runs, to retry it below
    worker.drain()

    run = pikku.get_run(first)
    assert run.forked_from == source
    [made] = run.lineage
    assert (made.op, made.by, made.from_step, made.run_id, made.keep_decisions) == (
        "fork", "ann", "b", source, False)
    assert made.at <= run.created_at  # written just before the run's insert
    assert pikku.get_run(second).lineage[0].keep_decisions is True
    assert [r.run_id for r in pikku.list_forks(source)] == [first, second]
    assert pikku.list_forks(first) == []

    assert pikku.retry(first, by="bob")
    worker.drain()
    fork_entry, retry_entry = pikku.get_run(first).lineage
    assert fork_entry == made
    assert (retry_entry.op, retry_entry.by, retry_entry.from_step) == ("retry", "bob", None)
    with pytest.raises(InvalidInputError):
        pikku.fork(source, from_step="b", by="")
    with pytest.raises(InvalidInputError):
        pikku.fork(source, from_step="b", keep_decisions="yes")  # type: ignore[arg-type]


def test_a_fork_that_stopped_before_its_copy_is_copied_by_its_first_pass() -> None:
    """The run is inserted, then its steps copied: a fork stopping in between (here a store
    error) left a run that the reaper's stalled sweep wakes, and that ran every step afresh
    (``a`` twice). Its first pass copies them first, from what its document says."""
    pikku, store, worker = _app()
    ran: list[str] = []
    _three(pikku, ran)
    source = pikku.start("fk.three", None)
    worker.drain()

    def broken(*args: Any, **kwargs: Any) -> int:
        raise ConnectionError("the store went away")

    store.insert_replayed_steps = broken  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        pikku.fork(source, from_step="b", new_run_id="half-fork")
    del store.insert_replayed_steps  # the store's own again
    assert pikku.get_steps("half-fork") == [] and pikku.get_run("half-fork").forked_from

    worker.wake_run("half-fork")  # as the stalled-run sweep does
    worker.drain()
    assert pikku.get_run("half-fork").output == ["a done", "b done", "c done"]
    assert ran == ["a", "b", "c", "b", "c"]  # a was replayed from the copy
    assert pikku.get_steps("half-fork")[0].forked_from == source
