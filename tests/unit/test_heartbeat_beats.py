"""One heartbeat beat, on the in-memory store and leases with a clock the test moves: what
it renews, what it calls lost and why, and what it gives back (``./dev mutate`` found these
unchecked by the fast tests; tests/integration/test_heartbeat.py runs the same beats on
real Redis and MongoDB over the wire). Beats are driven by hand: no background thread."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore
from pikku_celery.engine.claims import Claimed, Claimer
from pikku_celery.engine.heartbeat import Heartbeat, HeldStep
from pikku_celery.leases.base import Lease
from pikku_celery.model import keys
from pikku_celery.model.clock import ServerClock
from pikku_celery.store.base import NewRun, NewStep

T0 = 1_700_000_000_000


class Clock:
    def __init__(self) -> None:
        self.ms = T0

    def __call__(self) -> int:
        return self.ms


class Leases(InMemoryLeaseService):
    """In-memory leases whose ``refresh_many`` can be made to fail or to find nothing."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock_ms=clock)
        self.down = False
        self.vanish = False

    def refresh_many(self, leases: Sequence[tuple[Lease, int]]) -> list[Lease | None]:
        if self.down:
            raise ConnectionError("redis unreachable")
        if self.vanish:  # Redis restarted: every lease key is gone
            for lease, _ in leases:
                self.release(lease)
        return super().refresh_many(leases)


class Store(InMemoryWorkflowStore):
    """The in-memory store, counting renewals, failing them while ``down``."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.renewals: list[tuple[list[tuple[str, str, int]], int, int]] = []

    def renew_leases(self, held: Sequence[tuple[str, str, int]], now_ms: int,
                     lease_ms: int) -> set[tuple[str, str]]:
        if self.down:
            raise ConnectionError("mongodb unreachable")
        self.renewals.append((list(held), now_ms, lease_ms))
        return super().renew_leases(held, now_ms, lease_ms)


class Rig:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(Heartbeat, "_ensure_thread", lambda self: None)
        self.clock = Clock()
        self.store = Store()
        self.leases = Leases(self.clock)
        clock = ServerClock(self.leases, resync_s=0)
        self.lost: list[HeldStep] = []
        self.heartbeat = Heartbeat(self.store, self.leases, clock, on_lost=self.lost.append)
        self.claimer = Claimer(self.store, self.leases, clock, self.heartbeat)
        self.store.create_run(NewRun("run", "wf", None), T0)

    def claim(self, name: str, lease_ms: int = 1_000) -> Claimed:
        self.store.insert_step(NewStep(run_id="run", step_name=name, function="f",
                                       max_attempts=3), self.clock.ms)
        claimed = self.claimer.claim("run", name, "f", lease_ms)
        assert isinstance(claimed, Claimed)
        return claimed

    def store_deadline(self, name: str) -> int:
        state = self.store.get_step("run", name)
        assert state is not None and state.lease_expires_at is not None
        return int(state.lease_expires_at.timestamp() * 1000)

    def redis_lease(self, name: str) -> Lease | None:
        return self.leases.get(keys.step_lease_key("run", name))


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Rig:
    return Rig(monkeypatch)


def test_a_beat_renews_both_leases_from_now(rig: Rig) -> None:
    held = rig.claim("a").held
    rig.clock.ms += 600
    before = time.monotonic()
    rig.heartbeat.beat([held])
    assert rig.store_deadline("a") == T0 + 600 + 1_000
    redis = rig.redis_lease("a")
    assert redis is not None and redis.expires_at_ms == T0 + 600 + 1_000
    assert held.lease.expires_at_ms == T0 + 600 + 1_000
    assert before + 1.0 <= held.held_until <= time.monotonic() + 1.0  # sent + lease
    assert not held.lost.is_set() and rig.lost == []


def test_one_store_write_per_lease_length_each_fenced_by_its_attempt(rig: Rig) -> None:
    a, b, c = rig.claim("a").held, rig.claim("b").held, rig.claim("c", 3_000).held
    rig.clock.ms += 100
    rig.heartbeat.beat([a, b, c])
    by_length = {lease_ms: (sorted(held), now) for held, now, lease_ms in rig.store.renewals}
    assert by_length == {1_000: ([("run", "a", 1), ("run", "b", 1)], T0 + 100),
                         3_000: ([("run", "c", 1)], T0 + 100)}
    assert rig.store_deadline("c") == T0 + 100 + 3_000


def test_a_refused_renewal_is_a_superseded_attempt(rig: Rig) -> None:
    held = rig.claim("a").held
    rig.store.cancel_steps("run", {"type": "WorkflowCancelledError"}, T0 + 1)
    rig.heartbeat.beat([held])
    assert held.lost.is_set() and "superseded" in (held.lost_reason or "")
    assert rig.lost == [held] and rig.heartbeat.held() == []
    assert rig.redis_lease("a") is None  # its own Redis lease given back


def test_a_refused_renewal_while_settling_is_not_a_loss(rig: Rig) -> None:
    held = rig.claim("a").held
    held.settling = True  # the refusal is the settle's own write landing first
    rig.store.set_result("run", "a", 1, "done", T0 + 1)
    rig.heartbeat.beat([held])
    assert not held.lost.is_set() and rig.lost == []


def test_a_failed_store_renewal_keeps_the_lease_until_its_deadline_only(rig: Rig) -> None:
    held = rig.claim("a").held
    rig.store.down = True
    rig.heartbeat.beat([held])
    assert not held.lost.is_set()  # an outage is no proof of loss
    held.held_until = time.monotonic() - 0.001  # the last confirmed deadline passed
    rig.heartbeat.beat([held])
    assert held.lost.is_set() and "deadline" in (held.lost_reason or "")
    assert rig.lost == [held] and rig.redis_lease("a") is None


def test_a_failed_redis_renewal_renews_the_store_but_confirms_nothing(rig: Rig) -> None:
    held = rig.claim("a").held
    confirmed = held.held_until
    rig.leases.down = True
    rig.clock.ms += 500
    rig.heartbeat.beat([held])
    assert rig.store_deadline("a") == T0 + 500 + 1_000  # the store lease is the authority
    assert held.held_until == confirmed and not held.lost.is_set()
    held.held_until = time.monotonic() - 0.001
    rig.heartbeat.beat([held])
    assert held.lost.is_set() and "deadline" in (held.lost_reason or "")


def test_a_vanished_redis_lease_is_taken_back_when_free(rig: Rig) -> None:
    held = rig.claim("a").held
    holder = held.lease.holder
    rig.leases.vanish = True  # Redis restarted under a live worker
    rig.heartbeat.beat([held])
    rig.leases.vanish = False
    again = rig.redis_lease("a")
    assert again is not None and again.holder == holder and held.lease == again
    assert not held.lost.is_set()


def test_a_vanished_redis_lease_taken_by_another_is_left_to_the_store(rig: Rig) -> None:
    held = rig.claim("a").held
    rig.leases.vanish = True
    original: Any = rig.leases.refresh_many

    def taken_meanwhile(leases: Sequence[tuple[Lease, int]]) -> list[Lease | None]:
        out = original(leases)
        rig.leases.acquire(keys.step_lease_key("run", "a"), "thief", 60_000)
        return list(out)

    rig.leases.refresh_many = taken_meanwhile  # type: ignore[method-assign]
    rig.heartbeat.beat([held])
    thief = rig.redis_lease("a")
    assert thief is not None and thief.holder == "thief"  # not stolen back
    assert not held.lost.is_set()  # the store still says attempt 1 holds the step


class _StepClock:
    def __init__(self) -> None:
        self.ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.ms

    def now_ms(self) -> int:
        return self.ms

    def observe(self, *args: Any) -> None:
        pass


def test_a_superseded_attempt_never_takes_the_redis_lease_back_from_a_retry() -> None:
    """A pauses past its lease; B claims attempt 2, fails it and frees the Redis lease for
    the retry. When A wakes, its beat must not re-grab that free lease before the store
    tells it it was superseded: the retry delivered meanwhile would find it taken and be
    dropped, and the step would wait for the reaper."""
    clock = _StepClock()
    leases = InMemoryLeaseService(clock_ms=clock)
    during: dict[str, Any] = {}

    class Store(InMemoryWorkflowStore):
        def renew_leases(self, held: Any, now_ms: int, lease_ms: int) -> Any:
            if "retry" in during:  # the retry is delivered while A's beat is in flight
                during["claimed"] = during.pop("retry")()
            return super().renew_leases(held, now_ms, lease_ms)

    store = Store()

    def claimer(host: str) -> Claimer:
        return Claimer(store, leases, clock, Heartbeat(store, leases, clock),  # type: ignore[arg-type]
                       host=host)

    a, b, c = claimer("a"), claimer("b"), claimer("c")
    store.create_run(NewRun("run", "wf", None), clock.ms)
    store.insert_step(NewStep(run_id="run", step_name="s", function="f", max_attempts=4),
                      clock.ms)
    first = a.claim("run", "s", "f", 1_000)
    assert isinstance(first, Claimed)
    clock.ms += 1_500  # A is paused past its lease
    second = b.claim("run", "s", "f", 1_000)
    assert isinstance(second, Claimed) and second.state.attempt == 2
    b.fail(second, {"type": "E", "message": "down"}, retry_delay_ms=100)
    clock.ms += 200  # attempt 3 is due
    during["retry"] = lambda: c.claim("run", "s", "f", 1_000)
    a.heartbeat.beat(a.heartbeat.held())  # A wakes
    assert isinstance(during["claimed"], Claimed) and during["claimed"].state.attempt == 3
    assert first.held.lost.is_set()
    assert leases.get(keys.step_lease_key("run", "s")).holder == during["claimed"].held.lease.holder  # type: ignore[union-attr]


def test_one_cluster_node_down_costs_only_the_steps_whose_leases_it_holds(
        redis_client: Any, key_prefix: str) -> None:
    """On a Redis Cluster the renewals go one call per slot; a node that does not answer
    must leave the other slots' answers standing: those steps keep their leases, and only
    the ones on the silent node wait for their last confirmed deadline."""
    import redis as redis_lib

    from pikku_celery.leases.redis import RedisLeaseService
    from pikku_celery.store.base import NewRun, NewStep

    class OneNodeDown(RedisLeaseService):
        def _refresh_group(self, leases: Any) -> Any:
            if any(lease.key.startswith("workflow-step:run-bad:") for lease, _ in leases):
                raise redis_lib.ConnectionError("the node of this slot is failing over")
            return super()._refresh_group(leases)

    leases = OneNodeDown(redis_client, key_prefix=key_prefix)
    leases._cluster = True  # one call per slot, as on a cluster
    store = InMemoryWorkflowStore()
    clock = ServerClock(leases)
    heartbeat = Heartbeat(store, leases, clock)
    claimer = Claimer(store, leases, clock, heartbeat, host="a")
    held = {}
    for run in ("run-good", "run-bad"):
        store.create_run(NewRun(run, "wf", None), leases.now_ms())
        store.insert_step(NewStep(run_id=run, step_name="s", function="f", max_attempts=3),
                          leases.now_ms())
        claimed = claimer.claim(run, "s", "f", 60_000)
        assert isinstance(claimed, Claimed)
        held[run] = claimed.held
    heartbeat.stop()
    for h in heartbeat.held():  # the last confirmed deadline has just passed
        h.held_until = time.monotonic() - 0.001
    heartbeat.beat(heartbeat.held())
    good, bad = held["run-good"], held["run-bad"]
    assert not good.lost.is_set() and good.held_until > time.monotonic() + 30
    assert leases.get(good.lease.key) is not None
    assert bad.lost.is_set()
    for h in (good, bad):
        heartbeat.remove(h)


def test_a_step_in_a_transaction_keeps_its_redis_lease_and_leaves_its_store_lease_alone(
        rig: Rig) -> None:
    """A store renewal would be a write conflict with the transaction's settle
    (``pikku_celery.engine.transactional``); the Redis lease is still renewed."""
    in_txn, plain = rig.claim("txn").held, rig.claim("plain").held
    in_txn.in_transaction = True
    before = rig.store_deadline("txn")
    rig.clock.ms += 600
    rig.heartbeat.beat([in_txn, plain])
    assert [names for names, _, _ in rig.store.renewals] == [[("run", "plain", 1)]]
    assert rig.store_deadline("txn") == before
    assert rig.store_deadline("plain") == rig.clock.ms + 1_000
    redis = rig.redis_lease("txn")
    assert redis is not None and redis.expires_at_ms == rig.clock.ms + 1_000
    assert not in_txn.lost.is_set()
