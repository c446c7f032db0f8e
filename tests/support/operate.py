"""Runs with a known history, written through the store with explicit times (the store's
``now_ms`` is the clock: a lease lapses because the next claim says it is later), for the
CLI and dashboard tests.

``superseded_run``: step ``add`` was claimed by ``worker-a`` (attempt 1), its lease lapsed,
``worker-b`` reclaimed it as attempt 2 and succeeded; attempt 1's late result was refused.
``showcase_run``: the same on a step ``charge`` whose attempt 2 then failed and attempt 3
succeeded after a retry delay, beside a quick step, a ``wf.sleep`` and a last step: what
the README's screenshot shows.
"""

from __future__ import annotations

import time
import uuid

import pytest

from pikku_celery import PikkuCelery, WorkflowStepSupersededError
from pikku_celery.store.base import NewRun, NewStep, WorkflowStore

ADD = "contrib.add"
LEASE_MS = 5_000


def now_ms() -> int:
    return int(time.time() * 1000)


def _supersede(store: WorkflowStore, run_id: str, step: str, function: str, at_ms: int,
               worker_a: str, worker_b: str) -> int:
    """Attempt 1 claimed at ``at_ms`` by ``worker_a``; its lease lapses; ``worker_b``
    claims attempt 2 two seconds after the lapse. Returns attempt 2's claim time."""
    first = store.claim_step(run_id, step, function, at_ms, LEASE_MS, worker=worker_a,
                             task_id=f"task-{uuid.uuid4().hex[:8]}")
    assert first.state is not None and first.state.attempt == 1
    again_ms = at_ms + LEASE_MS + 2_000
    second = store.claim_step(run_id, step, function, again_ms, LEASE_MS, worker=worker_b,
                              task_id=f"task-{uuid.uuid4().hex[:8]}")
    assert second.state is not None and second.state.attempt == 2
    with pytest.raises(WorkflowStepSupersededError):  # attempt 1 finishes late: refused
        store.set_result(run_id, step, 1, "late", again_ms + 500)
    return again_ms


def superseded_run(pikku: PikkuCelery, *, run_id: str | None = None,
                   workflow: str = "sum") -> str:
    store = pikku.engine.store
    run_id = run_id or f"superseded-{uuid.uuid4().hex[:8]}"
    t0 = now_ms() - 60_000
    store.create_run(NewRun(run_id, workflow, {"a": 2, "b": 3}), t0)
    store.insert_step(NewStep(run_id, "add", ADD, {"a": 2, "b": 3}, max_attempts=4), t0 + 200)
    again_ms = _supersede(store, run_id, "add", ADD, t0 + 1_000, "worker-a@host1",
                          "worker-b@host2")
    store.set_result(run_id, "add", 2, 5, again_ms + 1_500)
    assert store.transition_run(run_id, ["running"], "completed", again_ms + 2_000, output=5)
    return run_id


def showcase_run(pikku: PikkuCelery, *, live: bool = False) -> str:
    """An ``order`` run: ``reserve`` ok; ``charge`` superseded, failed, then succeeded;
    ``cool-off`` a 20 s sleep; ``ship`` succeeded (or, with ``live``, still running)."""
    store = pikku.engine.store
    run_id = f"order-{uuid.uuid4().hex[:8]}"
    t0 = now_ms() - (60_000 if not live else 45_000)
    store.create_run(NewRun(run_id, "order", {"order_id": 1042, "sku": "TEA-42",
                                              "card": "visa ••42"}), t0)
    store.insert_step(NewStep(run_id, "reserve", "shop.reserve", {"sku": "TEA-42"},
                              max_attempts=4), t0 + 100)
    store.claim_step(run_id, "reserve", "shop.reserve", t0 + 300, LEASE_MS,
                     worker="celery@web-1", task_id="5b1c0e2a")
    store.set_result(run_id, "reserve", 1, {"reserved": True}, t0 + 1_400)
    store.insert_step(NewStep(run_id, "charge", "shop.charge", {"amount": 1299},
                              max_attempts=4, retry_delay_ms=3_000), t0 + 1_600)
    again_ms = _supersede(store, run_id, "charge", "shop.charge", t0 + 1_900,
                          "celery@worker-3", "celery@worker-1")
    store.set_error(run_id, "charge", 2, {"type": "ConnectionError",
                                          "message": "payment gateway timed out"},
                    again_ms + 2_500, retry_at_ms=again_ms + 5_500)
    store.claim_step(run_id, "charge", "shop.charge", again_ms + 5_600, LEASE_MS,
                     worker="celery@worker-2", task_id="9f3d2b77")
    store.set_result(run_id, "charge", 3, {"charged": 1299}, again_ms + 7_000)
    sleep_at = again_ms + 7_200
    store.insert_step(NewStep(run_id, "cool-off", None, {"sleep_ms": 20_000},
                              status="scheduled", due_ms=sleep_at + 20_000), sleep_at)
    assert store.settle_waiting_step(run_id, "cool-off", sleep_at + 20_100)
    ship_at = sleep_at + 20_300
    store.insert_step(NewStep(run_id, "ship", "shop.ship", {"carrier": "post"},
                              max_attempts=4), ship_at)
    store.claim_step(run_id, "ship", "shop.ship", ship_at + 200, 3_600_000 if live
                     else LEASE_MS, worker="celery@worker-1", task_id="c0ffee11")
    if not live:
        store.set_result(run_id, "ship", 1, {"tracking": "JX1042"}, ship_at + 2_500)
        assert store.transition_run(run_id, ["running"], "completed", ship_at + 2_700,
                                    output={"tracking": "JX1042"})
    return run_id
