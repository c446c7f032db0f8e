"""A sent event's wake check outlives a wake that failed (issue 31, surviving mutants).

A send keeps the event with a wake check, wakes the run, and only then clears the check
(``events``): cleared first, a wake that fails (the broker down, the sender killed between
the two) leaves a suspended run asleep with an event it could take, and nothing would ever
wake it. The reaper's part (``wake_lost_sends``) has the same order for the same reason.
Both are driven here through their callers, ``pikku.send_event`` and the reaper's sweep,
with a dispatcher whose wake fails, on the in-memory store and the real ``mongod``.

The lease clock is a fake the test moves: the check falls due without sleeping."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    MongoWorkflowStore,
    PikkuCelery,
)
from tests.conftest import pooled_database
from tests.unit.test_engine import Recorder
from tests.unit.test_engine_fencing import FakeClock

STALLED_S = 30  # the wake check falls due this long after the send


class BrokerDown(ConnectionError):
    pass


class WakeFails(Recorder):
    """A dispatcher whose every wake fails, as a broker that is down makes it fail."""

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        super().wake_run(run_id, countdown_s, step_name)
        raise BrokerDown(f"no broker to wake run {run_id}")


def _pikku(clock: FakeClock, store: Any) -> PikkuCelery:
    pikku = PikkuCelery(Celery(f"wake-{uuid.uuid4().hex[:6]}", broker="memory://"),
                        store=store, leases=InMemoryLeaseService(clock_ms=clock),
                        stalled_after=STALLED_S, worker_reaper=False)
    pikku.engine.clock._resync_s = 0  # type: ignore[attr-defined]  # the fake clock, always
    pikku.engine.dispatcher = Recorder()

    @pikku.workflow("awaits_payment")
    def awaits_payment(wf: Any, data: Any) -> Any:
        return wf.wait_for_event("paid")

    return pikku


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "mongod"])
def pikku(request: pytest.FixtureRequest, clock: FakeClock) -> Iterator[PikkuCelery]:
    if request.param == "memory":
        yield _pikku(clock, InMemoryWorkflowStore())
        return
    with pooled_database(request.getfixturevalue("mongo_server")) as db:
        yield _pikku(clock, MongoWorkflowStore(db))


def _suspended_on_its_wait(pikku: PikkuCelery) -> str:
    """A run whose pass has suspended it on ``wait_for_event('paid')``: only a wake moves it
    (a suspended run is not in the stalled-run sweep)."""
    run_id = pikku.start("awaits_payment", None)
    pikku.engine.advance(run_id, Recorder())
    assert pikku.get_run(run_id).status == "suspended"
    return run_id


def _reap_woke(pikku: PikkuCelery, run_id: str) -> bool:
    """One reaper sweep with a working dispatcher: whether it woke ``run_id``."""
    recorder = Recorder()
    pikku.engine.reap(recorder)
    return run_id in [woken for woken, _ in recorder.wakes]


def test_a_send_whose_wake_failed_leaves_the_run_to_the_reaper(
        pikku: PikkuCelery, clock: FakeClock) -> None:
    run_id = _suspended_on_its_wait(pikku)
    failing = WakeFails()
    pikku.engine.dispatcher = failing
    with contextlib.suppress(BrokerDown):  # whether the send reports it is not the point
        pikku.send_event(run_id, "paid", {"amount": 12})
    assert [w for w, _ in failing.wakes] == [run_id]  # the send tried to wake it
    assert [e.payload for e in pikku.list_events(run_id)] == [{"amount": 12}]
    pikku.engine.dispatcher = Recorder()
    assert not _reap_woke(pikku, run_id)  # the check is not due yet
    clock.ms += STALLED_S * 1000 + 1
    assert _reap_woke(pikku, run_id), "the failed wake's check was cleared: run lost"
    # Woken once: the check goes with the wake that worked.
    assert not _reap_woke(pikku, run_id)


def test_a_reaper_wake_that_failed_is_tried_again_by_the_next_sweep(
        pikku: PikkuCelery, clock: FakeClock) -> None:
    run_id = _suspended_on_its_wait(pikku)
    engine = pikku.engine
    # A sender that stopped after keeping the event, before its wake.
    now = engine.now_ms()
    engine.store.send_event(run_id, "paid", {"amount": 7}, now,
                            wake_check_ms=engine.settings.wake_check_ms(now))
    clock.ms += STALLED_S * 1000 + 1
    failing = WakeFails()
    with contextlib.suppress(BrokerDown):
        engine.reap(failing)
    assert [w for w, _ in failing.wakes] == [run_id]  # the sweep found it, and failed
    assert _reap_woke(pikku, run_id), "the failed wake's check was cleared: run lost"
    assert not _reap_woke(pikku, run_id)
