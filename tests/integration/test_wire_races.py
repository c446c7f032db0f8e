"""Claim races between real processes over the MongoDB wire protocol, on the real MongoDB (the
session's ``mongod`` replica set, or PIKKU_TEST_MONGO_URL's server). Eight processes claim the
same step, round after round, started together by a barrier: every round must have exactly one
winner."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from typing import Any

import pymongo
import pytest

from pikku_celery.model.errors import WorkflowStepSupersededError
from pikku_celery.store.base import NewRun, NewStep
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.support.mongod import MongoTarget

PROCESSES = 8
ROUNDS = 200
T0 = 1_700_000_000_000
LEASE = 60_000
FN = "charge:card"


def _claimer(url: str, db_name: str, run_ids: list[str], now_ms: int, barrier: Any,
             wins: Any) -> None:
    store = MongoWorkflowStore(pymongo.MongoClient(url)[db_name], create_indexes=False)
    for index, run_id in enumerate(run_ids):
        barrier.wait()
        state = store.claim_step(run_id, "charge", FN, now_ms, LEASE).state
        if state is not None:
            wins.put((index, state.attempt))


@pytest.fixture
def wire_url(mongo_server: MongoTarget) -> str:
    return mongo_server.url


def _prepare(store: MongoWorkflowStore, kind: str) -> tuple[list[str], int]:
    run_ids = []
    for _ in range(ROUNDS):
        run_id = str(uuid.uuid4())
        store.create_run(NewRun(run_id, "order", None), T0)
        store.insert_step(NewStep(run_id=run_id, step_name="charge", function=FN,
                                  max_attempts=6), T0)
        if kind != "first":
            store.claim_step(run_id, "charge", FN, T0, LEASE)
        if kind == "failed":
            store.set_error(run_id, "charge", 1, {"message": "boom"}, T0 + 1)
        run_ids.append(run_id)
    return run_ids, (T0 + LEASE + 1 if kind == "lapsed" else T0 + 2)


@pytest.mark.parametrize("kind", ["first", "lapsed", "failed"])
def test_eight_processes_one_winner_per_round(wire_url: str, kind: str) -> None:
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(wire_url)
    db_name = f"pikku_race_{uuid.uuid4().hex[:10]}"
    try:
        store = MongoWorkflowStore(client[db_name])
        run_ids, now_ms = _prepare(store, kind)
        ctx = mp.get_context("spawn")
        barrier, wins = ctx.Barrier(PROCESSES, timeout=60), ctx.Queue()
        procs = [ctx.Process(target=_claimer,
                             args=(wire_url, db_name, run_ids, now_ms, barrier, wins))
                 for _ in range(PROCESSES)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(240)
            assert proc.exitcode == 0
        results = [wins.get(timeout=5) for _ in range(wins.qsize())]
        per_round = sorted(index for index, _ in results)
        assert per_round == list(range(ROUNDS)), "every round must have exactly one winner"
        expected_attempt = 1 if kind == "first" else 2
        assert {attempt for _, attempt in results} == {expected_attempt}
        for run_id in run_ids[:20]:
            state = store.get_step(run_id, "charge")
            assert state is not None and state.attempt == expected_attempt
    finally:
        client.drop_database(db_name)


def test_superseded_writes_leave_the_new_attempt_byte_for_byte(wire_url: str) -> None:
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(wire_url)
    db_name = f"pikku_race_{uuid.uuid4().hex[:10]}"
    try:
        db = client[db_name]
        store = MongoWorkflowStore(db)
        store.create_run(NewRun("r", "order", None), T0)
        store.insert_step(NewStep(run_id="r", step_name="charge", function=FN,
                                  max_attempts=6), T0)
        store.claim_step("r", "charge", FN, T0, LEASE)
        store.claim_step("r", "charge", FN, T0 + LEASE + 1, LEASE)
        before = (list(db["workflow_steps"].find()), list(db["workflow_step_history"].find()),
                  list(db["workflow_runs"].find()))
        with pytest.raises(WorkflowStepSupersededError):
            store.set_result("r", "charge", 1, {"stale": True}, T0 + LEASE + 2)
        with pytest.raises(WorkflowStepSupersededError):
            store.set_error("r", "charge", 1, {"message": "stale"}, T0 + LEASE + 2)
        assert store.renew_leases([("r", "charge", 1)], T0 + LEASE + 2, LEASE)
        assert not store.release_lease("r", "charge", 1)
        after = (list(db["workflow_steps"].find()), list(db["workflow_step_history"].find()),
                 list(db["workflow_runs"].find()))
        assert after == before
    finally:
        client.drop_database(db_name)
