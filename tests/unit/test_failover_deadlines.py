"""Every MongoDB call a worker makes outside a step body ends by a deadline, so a primary
that stops answering (SIGSTOPped, or cut off without a reset: its sockets stay open and
silent) cannot hold a worker thread until it wakes.

The heartbeat's renewal and the settle have theirs (``store._concerns.deadline``); these
are the others ``tests/integration/test_failover.py::test_failover[sigstop_long]`` found
stuck on a stalled ex-primary, each proven here by the deadline pymongo sees in force when
the store is called (``pymongo._csot.get_timeout()``, what ``pymongo.timeout`` sets):

* a claim, within the step lease it would grant;
* every call of an orchestration pass, within the run lease (renewed while the pass runs,
  so a stuck pass held its run from every other pass);
* the reaper's sweep and its service probe, within the reaper interval (10 s at least, to
  ride out an election).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pymongo._csot as csot
import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.worker.tasks import SWEEP_DEADLINE_MIN_S, WorkerReaper

STEP_LEASE_S = 30.0
RUN_LEASE_S = 10.0
PASS_CALLS = ("read_run", "insert_steps", "transition_run")


class Recording(InMemoryWorkflowStore):
    """Records, for every store call, the client-side deadline in force (None: none)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, float | None]] = []

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name.startswith("_") or name == "calls" or not callable(attr):
            return attr

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, csot.get_timeout()))
            return attr(*args, **kwargs)
        return recorded

    # A store that can say whether it answers, as MongoWorkflowStore can.
    def describe(self) -> str:
        return "the recording store"

    def ping(self) -> None:
        return None

    def deadlines(self, name: str) -> list[float | None]:
        return [timeout for called, timeout in self.calls if called == name]


@pytest.fixture
def pikku() -> PikkuCelery:
    app = Celery("deadlines", broker="memory://", set_as_current=False)
    pikku = PikkuCelery(app, store=Recording(), leases=InMemoryLeaseService(),
                        step_lease=STEP_LEASE_S, run_lease=RUN_LEASE_S)

    @pikku.step("deadlines.add")
    def add(data: dict[str, int]) -> int:
        return data["a"] + 1

    @pikku.workflow("two_steps")
    def two_steps(wf: Any, data: Any) -> int:
        return int(wf.do("two", add, {"a": wf.do("one", add, {"a": 1})}))

    return pikku


def store_of(pikku: PikkuCelery) -> Recording:
    store = pikku.engine.store
    assert isinstance(store, Recording)
    return store


def within(limit_s: float) -> Callable[[float | None], bool]:
    return lambda timeout: timeout is not None and 0 < timeout <= limit_s


def test_a_claim_ends_within_the_step_lease(pikku: PikkuCelery) -> None:
    run_id = pikku.start("two_steps", {}, inline=True)
    assert pikku.get_run(run_id).output == 3
    claims = store_of(pikku).deadlines("claim_step")
    assert len(claims) == 2 and all(map(within(STEP_LEASE_S), claims)), claims


def test_every_call_of_a_pass_ends_within_the_run_lease(pikku: PikkuCelery) -> None:
    pikku.start("two_steps", {}, inline=True)
    store = store_of(pikku)
    for name in PASS_CALLS:
        found = store.deadlines(name)
        assert found and all(map(within(RUN_LEASE_S), found)), (name, found)


def test_a_reaper_sweep_and_its_probe_end_within_the_interval(pikku: PikkuCelery) -> None:
    reaper = WorkerReaper(lambda: pikku.engine, 2.0)
    assert reaper.sweep_once() == {"events": 0, "slots": 0, "lapsed": 0, "due": 0, "stalled": 0}
    assert reaper._probe() == {"the recording store": None}
    store = store_of(pikku)
    # A 2 s interval still gets 10 s: a sweep rides out an election (a few seconds).
    swept = [t for name, t in store.calls if name.startswith("find_")]
    assert swept and all(map(within(SWEEP_DEADLINE_MIN_S), swept)), store.calls
    assert all(t is not None and t > SWEEP_DEADLINE_MIN_S - 1 for t in swept), swept
    pings = store.deadlines("ping")
    assert pings and all(map(within(SWEEP_DEADLINE_MIN_S), pings)), pings
    assert all(t is not None and t > SWEEP_DEADLINE_MIN_S - 1 for t in pings), pings
    long = WorkerReaper(lambda: pikku.engine, 40.0)
    long._probe()
    assert all(map(within(40.0), store.deadlines("ping"))), store.deadlines("ping")
    assert max(t for t in store.deadlines("ping") if t is not None) > SWEEP_DEADLINE_MIN_S


def test_a_probe_that_timed_out_names_the_service(pikku: PikkuCelery,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A paused primary fails the probe with the driver's timeout, whose message names no
    service ("Timed out while checking out a connection from connection pool..."): the
    outage line must still say which service does not answer."""
    def timed_out() -> None:
        raise TimeoutError("Timed out while checking out a connection from connection pool")

    monkeypatch.setattr(store_of(pikku), "ping", timed_out)
    found = WorkerReaper(lambda: pikku.engine, 2.0)._probe()
    assert found == {"the recording store": "the recording store does not answer: Timed out "
                                            "while checking out a connection from connection "
                                            "pool (check the store given to "
                                            "PikkuCelery(store=...))"}


def test_the_probe_at_worker_start_has_a_short_deadline(pikku: PikkuCelery) -> None:
    """A worker whose MongoDB does not answer says so a few seconds after it is ready: the
    first probe's deadline is the start one, not a sweep's (at least 10 s, 30 s by
    default), which a pymongo call under a deadline waits whole for a server."""
    from pikku_celery.worker.tasks import START_PROBE_DEADLINE_S

    reaper = WorkerReaper(lambda: pikku.engine, 30.0)
    reaper.stop()  # the loop probes at start, then ends at its first wait
    reaper._loop()
    pings = store_of(pikku).deadlines("ping")
    assert pings == [START_PROBE_DEADLINE_S] and START_PROBE_DEADLINE_S <= 5.0, pings
