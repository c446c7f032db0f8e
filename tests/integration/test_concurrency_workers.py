"""Concurrency limits on real ``celery -A`` workers and the real replica set (issue 26,
item 3): a per-customer limit of 1 under load runs each customer's runs one at a time, in
the order they were started, another customer's beside them; a worker SIGKILLed in the
middle of a limited run's step does not leak its slot: the run resumes on the survivor
still holding it, and when everything has ended no slot is held and no run is queued."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from pikku_celery.store._slots import slot_id
from tests.integration.test_celery_workers import Cluster, make_cluster, wait_for

__all__ = ["make_cluster"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def _span(c: Cluster, run_id: str) -> tuple[float, float]:
    """From the first attempt of the run's step starting to the run's end (epoch s)."""
    history = [h for h in c.pikku.get_history(run_id) if h.step_name == "slow"]
    first = min(h.started_at for h in history if h.started_at is not None)
    return first.timestamp(), c.pikku.get_run(run_id).updated_at.timestamp()


def test_one_run_per_customer_in_order_and_no_slot_leaks_after_a_sigkill(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis")
    w1, w2 = c.start("a"), c.start("b")
    c.wait_ready(w1, w2)

    def start(customer: str, order: int) -> str:
        return c.pikku.start("limited", {"customer": customer, "order": order,
                                         "seconds": 0.4, "ledger": c.ledger_key})
    ann = [start("ann", i) for i in range(5)]
    bob = [start("bob", i) for i in range(2)]
    statuses = [c.pikku.get_run(r).status for r in ann]
    assert statuses.count("queued") >= 3, statuses  # at most one of ann's runs admitted
    first = wait_for(lambda: c.starts(), 20, "a limited run's step to start",
                     c.diagnostics)[0]
    c.holder_of(first["pid"]).kill()  # SIGKILL in the middle of a step holding a slot
    runs: list[Any] = [c.wait(r, 60) for r in ann + bob]
    assert [r.status for r in runs] == ["completed"] * 7, c.diagnostics()
    spans = [_span(c, r) for r in ann]
    for (_, end), (start_next, _) in itertools.pairwise(spans):
        assert end <= start_next, ("two of ann's runs overlapped", spans)
    assert [c.pikku.get_run(r).output["order"] for r in ann] == list(range(5))
    assert sorted(spans) == spans  # in the order they were started
    store = c.pikku.engine.store
    for customer in ("ann", "bob"):
        assert store.slot_holders(slot_id("limited", customer)) == []
    assert c.pikku.list_runs(status="queued") == []
