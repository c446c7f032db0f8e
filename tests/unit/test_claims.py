"""The claim layer under infrastructure faults: a settle retried through an outage, a write
that landed but whose reply was lost, and a heartbeat racing a settle."""

from __future__ import annotations

from typing import Any

import pytest

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, keys
from pikku_celery.claims import Claimed, Claimer
from pikku_celery.clock import ServerClock
from pikku_celery.heartbeat import Heartbeat
from pikku_celery.store.base import NewRun, NewStep


class Outage(InMemoryWorkflowStore):
    """``set_result`` fails ``fail`` times: before writing, or (``lose_reply``) after."""

    def __init__(self, fail: int, lose_reply: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.lose_reply = lose_reply

    def set_result(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail > 0:
            self.fail -= 1
            if self.lose_reply:
                super().set_result(*args, **kwargs)
            raise ConnectionError("mongodb unreachable")
        return super().set_result(*args, **kwargs)


def _claimed(store: InMemoryWorkflowStore) -> tuple[Claimer, Claimed]:
    leases = InMemoryLeaseService()
    clock = ServerClock(leases)
    claimer = Claimer(store, leases, clock, Heartbeat(store, leases, clock), host="test")
    store.create_run(NewRun("run", "wf", None), leases.now_ms())
    store.insert_step(NewStep(run_id="run", step_name="s", function="f", max_attempts=2),
                      leases.now_ms())
    claimed = claimer.claim("run", "s", "f", 30_000)
    assert isinstance(claimed, Claimed)
    return claimer, claimed


def test_a_settle_is_retried_through_a_short_outage() -> None:
    store = Outage(fail=2)
    claimer, claimed = _claimed(store)
    state = claimer.succeed(claimed, "done")
    assert state.status == "succeeded" and state.result == "done"
    assert claimer.heartbeat.held() == []


def test_a_write_that_landed_with_its_reply_lost_counts_as_recorded() -> None:
    store = Outage(fail=1, lose_reply=True)
    claimer, claimed = _claimed(store)
    state = claimer.succeed(claimed, "done")
    assert state.status == "succeeded" and state.attempt == 1


def test_an_outage_longer_than_the_lease_gives_the_attempt_up() -> None:
    store = Outage(fail=10**6)
    claimer, claimed = _claimed(store)
    claimed.held.held_until = 0.0  # the last confirmed deadline has passed
    with pytest.raises(ConnectionError):
        claimer.succeed(claimed, "done")
    assert claimer.heartbeat.held() == []


def test_a_beat_racing_a_settle_neither_regrabs_the_lease_nor_calls_it_lost() -> None:
    store = InMemoryWorkflowStore()
    claimer, claimed = _claimed(store)
    snapshot = claimer.heartbeat.held()  # a beat took its snapshot before the settle
    claimer.succeed(claimed, "done")
    claimer.heartbeat.beat(snapshot)
    assert claimer.leases.get(keys.step_lease_key("run", "s")) is None
    assert not claimed.held.lost.is_set()


def test_the_worker_is_the_claiming_process() -> None:
    import os

    store = InMemoryWorkflowStore()
    claimer, claimed = _claimed(store)
    claimer.succeed(claimed, "done")
    assert [h.worker for h in store.get_history("run")] == [f"test:{os.getpid()}"]
