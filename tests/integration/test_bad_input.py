"""The bad-input suite: forged and malformed messages, unknown names, unreachable services.
Each gets a clear typed error (or a logged refusal) and MongoDB stays byte-for-byte the same.
Runs on the MongoDB wire stand-in and the real Redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
import redis
from celery import Celery
from celery.exceptions import Ignore

from pikku_celery import (
    InvalidInputError,
    MongoWorkflowStore,
    PikkuCelery,
    RedisLeaseService,
    WorkflowNotFoundError,
    WorkflowStepFunctionMismatchError,
    WorkflowStepNotFoundError,
)
from pikku_celery.engine.claims import Claimer
from pikku_celery.engine.heartbeat import Heartbeat
from pikku_celery.model import keys
from pikku_celery.model.clock import ServerClock
from pikku_celery.worker.tasks import internal_task
from tests.conftest import REDIS_URL
from tests.support.mongod import MongoTarget
from tests.unit.test_engine import Recorder


@pytest.fixture
def env(mongo_server: MongoTarget, key_prefix: str) -> Iterator[dict[str, Any]]:
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(mongo_server.url)
    db = client[f"pikku_bad_{uuid.uuid4().hex[:10]}"]
    pikku = PikkuCelery(Celery(f"bad-{key_prefix}", broker="memory://"),
                        store=MongoWorkflowStore(db),
                        leases=RedisLeaseService.from_url(REDIS_URL, key_prefix=key_prefix),
                        worker_reaper=False)
    pikku.engine.dispatcher = Recorder()

    @pikku.step(name="bad.charge")
    def charge(data: Any) -> str:
        return "charged"

    @pikku.step(name="bad.refund")
    def refund(data: Any) -> str:
        return "refunded"

    @pikku.workflow("bad.order")
    def order(wf: Any, data: Any) -> Any:
        return wf.do("charge", charge, data)

    run_id = pikku.start("bad.order", {"amount": 5})
    pikku.engine.advance(run_id)
    yield {"pikku": pikku, "db": db, "run_id": run_id, "prefix": key_prefix}
    client.drop_database(db.name)


def snapshot(db: Any) -> dict[str, list[dict[str, Any]]]:
    return {name: sorted(db[name].find(), key=lambda d: str(d["_id"]))
            for name in sorted(db.list_collection_names())}


def _step_task(env: dict[str, Any], name: str) -> Any:
    return env["pikku"].app.tasks[name]


@pytest.mark.parametrize(("args", "error", "fragment"), [
    (("no-such-run", "charge"), WorkflowStepNotFoundError, "no-such-run"),
    (("{run}", "ghost"), WorkflowStepNotFoundError, "ghost"),
    ((5, "charge"), InvalidInputError, "malformed"),
    (("{run}", {"$gt": ""}), InvalidInputError, "malformed"),
    (("", "charge"), InvalidInputError, "malformed"),
])
def test_malformed_and_unknown_step_messages(env: dict[str, Any], args: tuple[Any, ...],
                                             error: type[Exception], fragment: str) -> None:
    args = tuple(env["run_id"] if a == "{run}" else a for a in args)
    before = snapshot(env["db"])
    with pytest.raises(error, match=fragment):
        _step_task(env, "bad.charge").run(*args)
    assert snapshot(env["db"]) == before


def test_a_message_missing_fields_is_refused(env: dict[str, Any]) -> None:
    before = snapshot(env["db"])
    with pytest.raises(InvalidInputError, match="runs inside a workflow"):
        _step_task(env, "bad.charge").run(env["run_id"])
    assert snapshot(env["db"]) == before


def test_a_forged_message_naming_another_function(env: dict[str, Any]) -> None:
    before = snapshot(env["db"])
    with pytest.raises(WorkflowStepFunctionMismatchError, match=r"bad\.charge"):
        _step_task(env, "bad.refund").run(env["run_id"], "charge")
    assert snapshot(env["db"]) == before


def test_a_replayed_old_message_for_a_settled_step_changes_nothing(env: dict[str, Any]) -> None:
    task = _step_task(env, "bad.charge")
    assert task.run(env["run_id"], "charge") == "charged"
    before = snapshot(env["db"])
    with pytest.raises(Ignore):
        task.run(env["run_id"], "charge")  # the old message, delivered again
    assert snapshot(env["db"]) == before


def test_orchestrator_messages_for_unknown_or_malformed_runs(env: dict[str, Any]) -> None:
    orchestrate = internal_task(env["pikku"].app, "orchestrate")
    before = snapshot(env["db"])
    with pytest.raises(Ignore):
        orchestrate.run("no-such-run")
    for bad in (None, {"$gt": ""}, ["x"]):
        with pytest.raises(InvalidInputError, match="malformed"):
            orchestrate.run(bad)
    assert snapshot(env["db"]) == before


def test_unknown_workflow_names_write_nothing(env: dict[str, Any]) -> None:
    before = snapshot(env["db"])
    with pytest.raises(WorkflowNotFoundError, match="nope"):
        env["pikku"].start("nope", {})
    with pytest.raises(InvalidInputError, match="workflow input"):
        env["pikku"].start("bad.order", {"$where": "1"})
    assert snapshot(env["db"]) == before


def test_redis_unreachable_at_claim_time_writes_nothing(env: dict[str, Any]) -> None:
    store = env["pikku"].engine.store
    dead = RedisLeaseService(redis.Redis(port=1, socket_connect_timeout=0.2))
    claimer = Claimer(store, dead, ServerClock(env["pikku"].engine.leases),
                      Heartbeat(store, dead, ServerClock(env["pikku"].engine.leases)))
    before = snapshot(env["db"])
    with pytest.raises(redis.ConnectionError):
        claimer.claim(env["run_id"], "charge", "bad.charge", 30_000)
    assert snapshot(env["db"]) == before


def test_mongodb_unreachable_at_claim_time_keeps_no_lease(env: dict[str, Any]) -> None:
    dead = MongoWorkflowStore.from_url("mongodb://127.0.0.1:1/x?directConnection=true",
                                       serverSelectionTimeoutMS=200)
    leases = env["pikku"].engine.leases
    clock = ServerClock(leases)
    claimer = Claimer(dead, leases, clock, Heartbeat(dead, leases, clock))
    # The claim tries the store for as long as the lease it would grant (3 s here; it was
    # 30 s, the same refusal after ten times the wait).
    with pytest.raises(pymongo.errors.ServerSelectionTimeoutError):
        claimer.claim(env["run_id"], "charge", "bad.charge", 3_000)
    assert leases.get(keys.step_lease_key(env["run_id"], "charge")) is None
    assert claimer.heartbeat.held() == []
