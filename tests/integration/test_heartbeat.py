"""The per-process heartbeat on real Redis and MongoDB over the wire: renewing 1, 10 or 100
held leases costs the same number of round trips, and a superseded attempt is told.

Tests that drive ``beat()`` by hand run without the background thread (``manual_beats``),
so no beat of its own can race theirs; the one test of the thread waits on the lease
clock, never on a sleep of a guessed length."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from pikku_celery import MongoWorkflowStore, RedisLeaseService
from pikku_celery.engine.claims import Claimed, Claimer
from pikku_celery.engine.heartbeat import Heartbeat, HeldStep
from pikku_celery.model.clock import ServerClock
from pikku_celery.store.base import NewRun, NewStep
from tests.conftest import REDIS_URL
from tests.support.counting import CountingRedis, counting_mongo
from tests.support.mongod import MongoTarget

LEASE_MS = 30_000


@pytest.fixture
def manual_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    """No heartbeat thread: only the test's own ``beat()`` calls renew."""
    monkeypatch.setattr(Heartbeat, "_ensure_thread", lambda self: None)


def _claim_many(n: int, server: MongoTarget, prefix: str) -> tuple[list[Claimed], Any, Any, Any]:
    client, mongo = counting_mongo(server.url)
    store = MongoWorkflowStore(client[f"pikku_hb_{uuid.uuid4().hex[:10]}"])
    redis_client = CountingRedis.from_url(REDIS_URL)
    leases = RedisLeaseService(redis_client, key_prefix=prefix)
    clock = ServerClock(leases)
    heartbeat = Heartbeat(store, leases, clock)
    claimer = Claimer(store, leases, clock, heartbeat)
    now = leases.now_ms()
    store.create_run(NewRun("run", "wf", None), now)
    claimed = []
    for i in range(n):
        store.insert_step(NewStep(run_id="run", step_name=f"s{i}", function="f",
                                  max_attempts=3), now)
        outcome = claimer.claim("run", f"s{i}", "f", LEASE_MS)
        assert isinstance(outcome, Claimed)
        claimed.append(outcome)
    return claimed, heartbeat, redis_client, mongo


@pytest.mark.parametrize("n", [1, 10, 100])
def test_one_beat_costs_the_same_round_trips_for_any_number_of_leases(
        n: int, mongo_server: MongoTarget, key_prefix: str,
        manual_beats: None) -> None:
    _claimed, heartbeat, redis_client, mongo = _claim_many(n, mongo_server, key_prefix)
    held = heartbeat.held()
    assert len(held) == n
    redis_client.commands.clear()
    mongo.commands.clear()
    heartbeat.beat(held)
    assert sum(redis_client.commands.values()) == 1, redis_client.commands
    assert dict(mongo.commands) == {"update": 1}
    assert not any(h.lost.is_set() for h in held)


def test_a_superseded_attempt_is_told_and_dropped(
        mongo_server: MongoTarget, key_prefix: str,
        manual_beats: None) -> None:
    claimed, heartbeat, _, _ = _claim_many(2, mongo_server, key_prefix)
    victim: HeldStep = claimed[0].held
    store = heartbeat._store  # the test reaches in to cancel one step behind its back
    store.cancel_steps("run", {"type": "WorkflowCancelledError"}, victim.lease.granted_at_ms)
    heartbeat.beat(heartbeat.held())
    assert victim.lost.is_set() and "superseded" in (victim.lost_reason or "")
    assert victim not in heartbeat.held()


class FlakyStore:
    """A store whose renewals fail (MongoDB unreachable) while ``down`` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.down = False

    def renew_leases(self, *args: Any) -> Any:
        if self.down:
            raise ConnectionError("mongodb unreachable")
        return self.inner.renew_leases(*args)


def test_an_unreachable_store_is_tolerated_until_the_confirmed_deadline(
        mongo_server: MongoTarget, key_prefix: str,
        manual_beats: None) -> None:
    claimed, heartbeat, _, _ = _claim_many(1, mongo_server, key_prefix)
    held = claimed[0].held
    flaky = FlakyStore(heartbeat._store)
    heartbeat._store = flaky
    flaky.down = True
    heartbeat.beat([held])
    assert not held.lost.is_set()  # not proof of loss yet
    held.held_until = 0.0  # the last confirmed deadline has passed
    heartbeat.beat([held])
    assert held.lost.is_set() and "deadline" in (held.lost_reason or "")


def test_the_heartbeat_thread_keeps_a_short_lease_alive(mongo_server: MongoTarget,
                                                        key_prefix: str) -> None:
    """A 1.5 s lease renewed every 0.5 s by the thread alone outlives its first deadline
    twice over (a thread starved for up to a second still keeps it)."""
    from pikku_celery.engine.claims import NotClaimed

    client, _ = counting_mongo(mongo_server.url)
    store = MongoWorkflowStore(client[f"pikku_hb_{uuid.uuid4().hex[:10]}"])
    leases = RedisLeaseService(CountingRedis.from_url(REDIS_URL), key_prefix=key_prefix)
    clock = ServerClock(leases)
    claimer = Claimer(store, leases, clock, Heartbeat(store, leases, clock))
    store.create_run(NewRun("run", "wf", None), leases.now_ms())
    store.insert_step(NewStep(run_id="run", step_name="s", function="f", max_attempts=3),
                      leases.now_ms())
    first = claimer.claim("run", "s", "f", 1500)
    assert isinstance(first, Claimed)
    deadline_ms = first.held.lease.granted_at_ms + 1500
    for _ in range(2):  # two lease lengths, judged by the server clock
        wait_until_server_passes(leases, deadline_ms)
        assert isinstance(claimer.claim("run", "s", "f", 1500), NotClaimed)
        assert store.claim_step("run", "s", "f", leases.now_ms(), 1500).state is None
        deadline_ms += 1500
    assert not first.held.lost.is_set()
    claimer.succeed(first, "done")
    state = store.get_step("run", "s")
    assert state is not None and state.result == "done" and state.attempt == 1


def wait_until_server_passes(leases: RedisLeaseService, deadline_ms: int) -> None:
    import time

    give_up = time.monotonic() + 30
    while leases.now_ms() <= deadline_ms:
        assert time.monotonic() < give_up, "the Redis clock never passed the deadline"
        time.sleep(0.02)


class DownLeases:
    """Redis unreachable: every renewal raises."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def refresh_many(self, leases: Any) -> Any:
        raise ConnectionError("redis unreachable")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_an_unreachable_redis_is_tolerated_until_the_confirmed_deadline(
        mongo_server: MongoTarget, key_prefix: str,
        manual_beats: None) -> None:
    claimed, heartbeat, _, _ = _claim_many(1, mongo_server, key_prefix)
    held = claimed[0].held
    heartbeat._leases = DownLeases(heartbeat._leases)
    heartbeat.beat([held])
    assert not held.lost.is_set()
    held.held_until = 0.0
    heartbeat.beat([held])
    assert held.lost.is_set() and "deadline" in (held.lost_reason or "")
