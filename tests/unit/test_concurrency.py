"""Concurrency limits per key (issue 26, item 3) through the test kit's inline engine and
the in-memory store: at most N runs per key at once, the rest ``queued`` and started in the
order they came when a slot frees (a run that completes, fails or is cancelled frees it),
keys independent, a cancelled queued run never starts, bad declarations and keys refused by
name, and the sweep that mends what a crash between two writes left."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import InvalidInputError, PikkuCelery
from pikku_celery.engine.concurrency import Admission
from pikku_celery.store._slots import slot_id
from pikku_celery.testing import InlineKit, inline


@pytest.fixture
def pikku() -> Iterator[PikkuCelery]:
    pikku = PikkuCelery(Celery(f"limits-{uuid.uuid4().hex[:8]}", broker="memory://"))
    started: list[str] = []

    @pikku.step()
    def record(data: Any) -> Any:
        started.append(data["order"])
        return data

    @pikku.workflow(concurrency=1, concurrency_key=lambda data: data["customer"])
    def per_customer(wf: Any, data: Any) -> Any:
        wf.do("begin", record, data)
        wf.wait_for_event("done")  # holds its slot until told
        return data["order"]

    @pikku.workflow(concurrency=2)
    def two_at_once(wf: Any, data: Any) -> Any:
        if data.get("fail"):
            raise RuntimeError("boom")
        wf.wait_for_event("done")
        return data["order"]

    pikku.started = started  # type: ignore[attr-defined]
    yield pikku


@pytest.fixture
def kit(pikku: PikkuCelery) -> Iterator[InlineKit]:
    with inline(pikku) as kit:
        yield kit


def _status(pikku: PikkuCelery, run_id: str) -> str:
    return pikku.get_run(run_id).status


def test_one_run_per_key_the_others_queued_in_order(pikku: PikkuCelery, kit: InlineKit) -> None:
    a1 = pikku.start("per_customer", {"customer": "ann", "order": "a1"})
    a2 = pikku.start("per_customer", {"customer": "ann", "order": "a2"})
    b1 = pikku.start("per_customer", {"customer": "bob", "order": "b1"})
    a3 = pikku.start("per_customer", {"customer": "ann", "order": "a3"})
    assert [_status(pikku, r) for r in (a1, a2, b1, a3)] == [
        "suspended", "queued", "suspended", "queued"]  # bob's key is his own
    assert pikku.started == ["a1", "b1"]  # type: ignore[attr-defined]
    assert [r.run_id for r in pikku.list_runs(status="queued")] == [a3, a2]  # newest first
    pikku.send_event(a1, "done")
    assert _status(pikku, a1) == "completed"
    assert [_status(pikku, r) for r in (a2, a3)] == ["suspended", "queued"]  # a2 came first
    pikku.send_event(a2, "done")
    assert _status(pikku, a3) == "suspended"
    assert pikku.started == ["a1", "b1", "a2", "a3"]  # type: ignore[attr-defined]


def test_a_failed_or_cancelled_run_frees_its_slot(pikku: PikkuCelery, kit: InlineKit) -> None:
    failed = pikku.start("two_at_once", {"order": "f", "fail": True})
    assert _status(pikku, failed) == "failed"
    first = pikku.start("two_at_once", {"order": "1"})
    second = pikku.start("two_at_once", {"order": "2"})
    third = pikku.start("two_at_once", {"order": "3"})
    fourth = pikku.start("two_at_once", {"order": "4"})
    assert [_status(pikku, r) for r in (first, second, third, fourth)] == [
        "suspended", "suspended", "queued", "queued"]
    assert pikku.cancel(third, "not wanted")  # a queued run cancelled: it never starts
    assert _status(pikku, third) == "cancelled"
    assert pikku.cancel(first)  # a running one cancelled: its slot goes to the next
    assert _status(pikku, fourth) == "suspended"
    slot = slot_id("two_at_once", None)
    assert sorted(pikku.engine.store.slot_holders(slot)) == sorted([second, fourth])


def test_a_retried_run_takes_a_slot_or_waits(pikku: PikkuCelery, kit: InlineKit) -> None:
    """A retry queues the run like a start: admitted at once with a free slot, else first
    in, first out (it is older than the runs queued after it), never holding a slot
    while it is still failed (issue 31, defect 3)."""
    failed = pikku.start("two_at_once", {"order": "f", "fail": True})
    running = [pikku.start("two_at_once", {"order": str(i)}) for i in range(2)]
    later = pikku.start("two_at_once", {"order": "later"})
    assert _status(pikku, later) == "queued"
    assert pikku.retry(failed)  # both slots taken: it waits for one, queued
    assert _status(pikku, failed) == "queued"
    slot = slot_id("two_at_once", None)
    assert sorted(pikku.engine.store.slot_holders(slot)) == sorted(running)
    pikku.send_event(running[0], "done")  # a slot frees: the retried run, created first
    assert _status(pikku, failed) == "failed"  # admitted, ran again, failed again
    assert _status(pikku, later) == "suspended"  # its end freed the slot for the next
    assert sorted(pikku.engine.store.slot_holders(slot)) == sorted([running[1], later])
    history = [(h.step_name, h.attempt) for h in pikku.get_history(failed)]
    assert history == []  # the body failed before any step: nothing recorded twice


@pytest.mark.parametrize(("options", "message"), [
    ({"concurrency": 0}, "concurrency must be an int from 1"),
    ({"concurrency": True}, "concurrency must be an int from 1"),
    ({"concurrency_key": lambda d: "k"}, "needs concurrency=N"),
    ({"concurrency": 2, "concurrency_key": "customer"}, "must be a callable"),
])
def test_a_bad_declaration_is_refused_by_name(options: dict[str, Any], message: str) -> None:
    pikku = PikkuCelery(Celery(f"limits-{uuid.uuid4().hex[:8]}", broker="memory://"))
    with pytest.raises(InvalidInputError, match=message):
        pikku.workflow("bad", **options)(lambda wf, data: None)


@pytest.mark.parametrize(("data", "message"), [
    ({"customer": 7, "order": "x"}, r"returned 7 \(int\): it must return a string"),
    ({"order": "x"}, r"concurrency_key of workflow 'per_customer' raised KeyError"),
])
def test_a_bad_key_refuses_the_start_and_keeps_nothing(
        pikku: PikkuCelery, kit: InlineKit, data: Any, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        pikku.start("per_customer", data)
    assert pikku.list_runs() == []


def test_the_sweep_mends_what_a_crash_left(pikku: PikkuCelery, kit: InlineKit) -> None:
    engine = pikku.engine
    store = engine.store
    holder = pikku.start("two_at_once", {"order": "1"})
    waiting = [pikku.start("two_at_once", {"order": str(i)}) for i in (2, 3)]
    slot = slot_id("two_at_once", None)
    # An ender that stopped before it gave the slot back: the run ended, its slot held.
    assert store.transition_run(holder, ["suspended"], "completed", engine.now_ms())
    # An admitter that stopped after it took a slot for a queued run, before moving it
    # (the limit given here as 3: the ended run's slot is still held).
    assert store.take_slot(slot, waiting[1], 3)
    assert [_status(pikku, r) for r in waiting] == ["suspended", "queued"]
    counts = pikku.reap()
    assert counts["slots"] == 2
    assert [_status(pikku, r) for r in waiting] == ["suspended", "suspended"]
    assert sorted(store.slot_holders(slot)) == sorted(waiting)
    # A freer that stopped before it admitted: a free slot and a queued run.
    late = pikku.start("two_at_once", {"order": "4"})
    assert _status(pikku, late) == "queued"
    store.give_slot(slot, waiting[0])
    assert Admission(store, lambda wf: 2, engine.now_ms).sweep(engine.dispatcher) == 1
    assert _status(pikku, late) == "suspended"


def test_an_inline_start_returns_a_queued_run_at_once() -> None:
    """``start(inline=True)`` drives a run until it ends or waits: queued is waiting (another
    run's end admits it), not something this call could do."""
    from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore

    limited = PikkuCelery(Celery(f"limits-{uuid.uuid4().hex[:8]}", broker="memory://"),
                          store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                          worker_reaper=False)

    @limited.workflow(concurrency=1)
    def held(wf: Any, data: Any) -> Any:
        wf.wait_for_event("done")
        return data

    first = limited.start("held", 1, inline=True)
    second = limited.start("held", 2, inline=True)  # returns: it waits for a slot
    assert [limited.get_run(r).status for r in (first, second)] == ["suspended", "queued"]


def test_a_queued_run_says_why(pikku: PikkuCelery, kit: InlineKit) -> None:
    """Issue 36 item 5: the key, the limit, the runs holding the slots, the runs ahead (in
    admission order: creation time, then run id for runs of the same millisecond)."""
    a1 = pikku.start("per_customer", {"customer": "ann", "order": "a1"})
    queued = [pikku.start("per_customer", {"customer": "ann", "order": f"a{i}"})
              for i in (2, 3)]
    assert pikku.why_queued(a1) is None  # running (suspended on its event): not queued
    reasons = {run_id: pikku.why_queued(run_id) for run_id in queued}
    first, second = sorted(queued, key=lambda r: reasons[r].ahead)  # type: ignore[union-attr]
    why = reasons[second]
    assert why is not None
    assert (why.run_id, why.workflow, why.key, why.limit, why.holders, why.ahead) == (
        second, "per_customer", "ann", 1, (a1,), 1)
    assert reasons[first].ahead == 0  # type: ignore[union-attr]
    assert why.describe() == (f"waits for a slot: concurrency 1 for key 'ann' is held by "
                              f"{a1}; 1 run ahead")
    pikku.send_event(a1, "done")  # the first in line takes the slot; the other is next
    assert _status(pikku, first) == "suspended"
    why = pikku.why_queued(second)
    assert why is not None and (why.holders, why.ahead) == ((first,), 0)
    assert why.describe().endswith(f"is held by {first}; next in line")
    with pytest.raises(Exception, match="nope"):
        pikku.why_queued("nope")
