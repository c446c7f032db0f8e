"""A worker whose wall clock is an hour ahead neither steals a live step nor holds one past
its TTL: lease time is the Redis server's, read through the monotonic clock."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pymongo
import time_machine

from pikku_celery import MongoWorkflowStore, RedisLeaseService
from pikku_celery.engine.claims import Claimed, Claimer, NotClaimed
from pikku_celery.engine.heartbeat import Heartbeat
from pikku_celery.model.clock import ServerClock
from pikku_celery.store.base import NewRun, NewStep
from tests.conftest import REDIS_URL
from tests.support.mongod import MongoTarget


def _claimer(mongo: MongoTarget, db: str, prefix: str) -> tuple[Claimer, MongoWorkflowStore]:
    store = MongoWorkflowStore(pymongo.MongoClient(mongo.url)[db])
    leases = RedisLeaseService.from_url(REDIS_URL, key_prefix=prefix)
    clock = ServerClock(leases)
    return Claimer(store, leases, clock, Heartbeat(store, leases, clock)), store


def test_a_fast_clock_reads_server_time(key_prefix: str) -> None:
    leases = RedisLeaseService.from_url(REDIS_URL, key_prefix=key_prefix)
    with time_machine.travel(time.time() + 3600, tick=True):
        clock = ServerClock(leases)
        skew_ms = abs(clock.now_ms() - leases.now_ms())
    assert skew_ms < 1000


def test_a_worker_an_hour_ahead_cannot_steal_or_over_hold(mongo_server: MongoTarget,
                                                          key_prefix: str) -> None:
    db = f"pikku_skew_{uuid.uuid4().hex[:10]}"
    honest, store = _claimer(mongo_server, db, key_prefix)
    now = honest.leases.now_ms()
    store.create_run(NewRun("run", "wf", None), now)
    store.insert_step(NewStep(run_id="run", step_name="s", function="f", max_attempts=3), now)
    store.insert_step(NewStep(run_id="run", step_name="t", function="f", max_attempts=3), now)
    held = honest.claim("run", "s", "f", 2_000)
    assert isinstance(held, Claimed)
    with time_machine.travel(time.time() + timedelta(hours=1).total_seconds(), tick=True):
        skewed, _ = _claimer(mongo_server, db, key_prefix)
        # Cannot steal: to its clock the honest lease lapsed an hour ago.
        assert isinstance(skewed.claim("run", "s", "f", 2_000), NotClaimed)
        mine = skewed.claim("run", "t", "f", 2_000)
        assert isinstance(mine, Claimed)
        skewed.heartbeat.remove(mine.held)  # it stops renewing: the lease must lapse on time
        lease_ms = int(mine.state.lease_expires_at.timestamp() * 1000)  # type: ignore[union-attr]
    server_now = honest.leases.now_ms()
    assert abs(lease_ms - (server_now + 2_000)) < 2_000  # server time, not an hour ahead
    time.sleep(2.2)
    stolen = honest.claim("run", "t", "f", 2_000)  # cannot over-hold: lapsed on server time
    assert isinstance(stolen, Claimed) and stolen.state.attempt == 2
