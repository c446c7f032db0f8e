"""The lease contract (upstream scenarios 29-38), run on every lease service.

``lease_service`` is parametrized over the in-memory service, the Redis service on one
server and the Redis service on a real three-node Redis Cluster (started by the session's
``redis_cluster`` fixture); ``let_time_pass`` makes leases lapse: the memory service's clock
jumps (deterministic), Redis really waits (short TTLs). Tests at the bottom check what only
Redis has: the server clock, the physical key layout and key prefixes, cluster slots and
URLs. Redis must be reachable: an unreachable server fails the Redis-backed tests, it never
skips them.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
import time_machine
from redis.cluster import RedisCluster
from redis.crc import key_slot

from pikku_celery.leases import (
    HeldLease,
    InMemoryLeaseService,
    Lease,
    LeaseService,
    RedisLeaseService,
    hold_lease,
)
from pikku_celery.model import keys
from pikku_celery.model.errors import LeaseLostError, LeaseTakenError
from tests.support.redis_cluster import RedisClusterServer
from tests.support.threads import race

REDIS_URL = "redis://127.0.0.1:6379/0"
SHORT_TTL_MS = 200  # lapses for real on Redis; long enough to stay live between two calls
LONG_TTL_MS = 60_000


class ShiftableClock:
    """Wall clock plus a manual offset: real time still flows (renewal threads need it),
    and ``advance`` makes a lease lapse without sleeping."""

    def __init__(self) -> None:
        self.offset_ms = 0

    def __call__(self) -> int:
        return time.time_ns() // 1_000_000 + self.offset_ms

    def advance(self, ms: int) -> None:
        self.offset_ms += ms


class ManualClock:
    """A clock that moves only when told: nothing the test does in between can age a lease."""

    def __init__(self) -> None:
        self.ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.ms


class FlakyRefresh:
    """Wraps a lease service; ``refresh`` raises ConnectionError while ``failing`` is set,
    as when the store is briefly unreachable. ``failed`` and ``refreshed`` are set by each
    failed and each successful refresh, so a test waits for what happened, not for time."""

    def __init__(self, inner: LeaseService) -> None:
        self.inner = inner
        self.failing = threading.Event()
        self.failed = threading.Event()
        self.refreshed = threading.Event()
        self.failures = 0
        self.acquires = 0

    def acquire(self, key: str, holder: str, ttl_ms: int) -> Lease | None:
        self.acquires += 1
        return self.inner.acquire(key, holder, ttl_ms)

    def refresh(self, lease: Lease, ttl_ms: int) -> Lease | None:
        if self.failing.is_set():
            self.failures += 1
            self.failed.set()
            raise redis.ConnectionError("store unreachable (injected)")
        renewed = self.inner.refresh(lease, ttl_ms)
        self.refreshed.set()
        return renewed

    def refresh_many(self, leases: Sequence[tuple[Lease, int]]) -> list[Lease | None]:
        return self.inner.refresh_many(leases)

    def release(self, lease: Lease) -> bool:
        return self.inner.release(lease)

    def get(self, key: str) -> Lease | None:
        return self.inner.get(key)

    def now_ms(self) -> int:
        return self.inner.now_ms()


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture
def redis_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A prefix no other test or user shares; every key under it is deleted afterwards."""
    prefix = f"pikku-test-{uuid.uuid4().hex}"
    yield prefix
    keys = list(redis_client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture
def redis_service(redis_client: redis.Redis, redis_prefix: str) -> RedisLeaseService:
    return RedisLeaseService(redis_client, key_prefix=redis_prefix)


@pytest.fixture
def clock() -> ShiftableClock:
    return ShiftableClock()


@pytest.fixture
def cluster_client(redis_cluster: RedisClusterServer) -> Iterator[RedisCluster]:
    client = redis_cluster.client()
    yield client
    client.close()


@pytest.fixture
def cluster_service(cluster_client: RedisCluster) -> Iterator[RedisLeaseService]:
    """A service on the test cluster under a prefix of its own, deleted afterwards (on
    every node: the client scans them all)."""
    prefix = f"pikku-test-{uuid.uuid4().hex}"
    yield RedisLeaseService(cluster_client, key_prefix=prefix)
    for key in list(cluster_client.scan_iter(match=f"{prefix}*", count=1000)):
        cluster_client.delete(key)


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
def lease_service(request: pytest.FixtureRequest, clock: ShiftableClock) -> LeaseService:
    if request.param == "memory":
        return InMemoryLeaseService(clock_ms=clock)
    name = "cluster_service" if request.param == "redis-cluster" else "redis_service"
    service: RedisLeaseService = request.getfixturevalue(name)
    return service


@pytest.fixture
def let_time_pass(lease_service: LeaseService, clock: ShiftableClock) -> Callable[[int], None]:
    """At least ``ms`` pass on the service's clock (a sleep never ends early)."""
    def let_pass(ms: int) -> None:
        if isinstance(lease_service, InMemoryLeaseService):
            clock.advance(ms)
        else:
            time.sleep(ms / 1000)

    return let_pass


def wait_past(service: LeaseService, deadline_ms: int, timeout_s: float = 30.0) -> None:
    """Return once the service's own clock reads later than ``deadline_ms``: synchronise on
    the clock leases are judged by, never on how long a sleep was hoped to take."""
    give_up = time.monotonic() + timeout_s
    while service.now_ms() <= deadline_ms:
        assert time.monotonic() < give_up, f"the service clock never passed {deadline_ms}"
        time.sleep(0.01)


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def expect(lease: Lease | None) -> Lease:
    assert lease is not None
    return lease


# --- scenario 29: one holder at a time, tokens start at 1, keys independent ---------------


def test_one_holder_at_a_time_and_tokens_start_at_one(lease_service: LeaseService) -> None:
    first = expect(lease_service.acquire("job", "a", LONG_TTL_MS))
    assert (first.key, first.holder, first.token) == ("job", "a", 1)
    assert first.expires_at_ms - first.granted_at_ms == LONG_TTL_MS
    assert lease_service.acquire("job", "b", LONG_TTL_MS) is None
    assert expect(lease_service.get("job")).holder == "a"


def test_keys_are_independent(lease_service: LeaseService) -> None:
    assert expect(lease_service.acquire("job-1", "a", LONG_TTL_MS)).token == 1
    second = expect(lease_service.acquire("job-2", "b", LONG_TTL_MS))
    assert (second.holder, second.token) == ("b", 1)
    assert lease_service.get("job-3") is None


def test_get_reports_the_live_lease(lease_service: LeaseService) -> None:
    lease = expect(lease_service.acquire("job", "a", LONG_TTL_MS))
    seen = expect(lease_service.get("job"))
    assert (seen.key, seen.holder, seen.token) == ("job", "a", 1)
    assert seen.granted_at_ms >= lease.granted_at_ms
    assert 0 < seen.expires_at_ms - seen.granted_at_ms <= LONG_TTL_MS
    if isinstance(lease_service, InMemoryLeaseService):
        assert seen.expires_at_ms == lease.expires_at_ms
    else:
        # Redis reports the deadline as TIME + PTTL, and each script reads TIME a moment
        # after Redis fixed its command time: the same deadline, up to how long Redis was
        # descheduled between the two reads (1 ms or less unloaded, more under load).
        assert abs(seen.expires_at_ms - lease.expires_at_ms) < 1000


# --- scenario 30: the same holder re-acquires with its token and a later expiry ----------


def test_same_holder_reacquires_with_same_token_and_later_expiry(
    lease_service: LeaseService, let_time_pass: Callable[[int], None]
) -> None:
    first = expect(lease_service.acquire("job", "a", LONG_TTL_MS))
    let_time_pass(20)
    again = expect(lease_service.acquire("job", "a", LONG_TTL_MS))
    assert again.token == first.token == 1
    assert again.expires_at_ms > first.expires_at_ms


# --- scenario 31: a lapsed lease passes on with token + 1; the old one cannot refresh -----


def test_lapsed_lease_passes_to_next_holder_with_next_token(
    lease_service: LeaseService, let_time_pass: Callable[[int], None]
) -> None:
    old = expect(lease_service.acquire("job", "a", SHORT_TTL_MS))
    let_time_pass(SHORT_TTL_MS + 50)
    assert lease_service.get("job") is None
    new = expect(lease_service.acquire("job", "b", LONG_TTL_MS))
    assert new.token == old.token + 1
    assert lease_service.refresh(old, LONG_TTL_MS) is None
    assert lease_service.acquire("job", "a", LONG_TTL_MS) is None
    assert expect(lease_service.get("job")).holder == "b"


def test_same_holder_after_lapse_gets_new_token_and_old_handle_is_stale(
    lease_service: LeaseService, let_time_pass: Callable[[int], None]
) -> None:
    old = expect(lease_service.acquire("job", "a", SHORT_TTL_MS))
    let_time_pass(SHORT_TTL_MS + 50)
    new = expect(lease_service.acquire("job", "a", LONG_TTL_MS))
    assert new.token == old.token + 1
    assert lease_service.refresh(old, LONG_TTL_MS) is None
    assert lease_service.release(old) is False
    assert expect(lease_service.get("job")).token == new.token


# --- scenario 32: release frees the key; a stale lease cannot release the new holder ------


def test_release_frees_key_and_next_grant_gets_next_token(lease_service: LeaseService) -> None:
    first = expect(lease_service.acquire("job", "a", LONG_TTL_MS))
    assert lease_service.release(first) is True
    assert lease_service.get("job") is None
    second = expect(lease_service.acquire("job", "b", LONG_TTL_MS))
    assert second.token == 2
    assert lease_service.release(first) is False
    assert expect(lease_service.get("job")).holder == "b"
    assert lease_service.release(second) is True
    assert lease_service.get("job") is None


def test_stale_lease_cannot_release_holder_after_lapse(
    lease_service: LeaseService, let_time_pass: Callable[[int], None]
) -> None:
    old = expect(lease_service.acquire("job", "a", SHORT_TTL_MS))
    let_time_pass(SHORT_TTL_MS + 50)
    expect(lease_service.acquire("job", "b", LONG_TTL_MS))
    assert lease_service.release(old) is False
    assert expect(lease_service.get("job")).holder == "b"


# --- scenario 33: refresh extends a live lease; 5 concurrent acquirers admit one ---------


def test_refresh_extends_a_live_lease(
    lease_service: LeaseService, let_time_pass: Callable[[int], None]
) -> None:
    lease = expect(lease_service.acquire("job", "a", SHORT_TTL_MS))
    let_time_pass(20)
    renewed = expect(lease_service.refresh(lease, LONG_TTL_MS))
    assert (renewed.holder, renewed.token) == ("a", lease.token)
    assert renewed.expires_at_ms >= lease.expires_at_ms - SHORT_TTL_MS + LONG_TTL_MS
    if isinstance(lease_service, InMemoryLeaseService):
        let_time_pass(SHORT_TTL_MS)
    wait_past(lease_service, lease.expires_at_ms)  # past the first expiry
    assert expect(lease_service.get("job")).token == lease.token
    assert lease_service.acquire("job", "b", LONG_TTL_MS) is None


def race_to_acquire(service: LeaseService, key: str, contenders: int) -> list[Lease | None]:
    """``contenders`` threads released together by a barrier, each acquiring ``key``; a
    contender that raised fails the test (it is not a loser)."""
    results: list[Lease | None] = [None] * contenders

    def contend(i: int) -> None:
        results[i] = service.acquire(key, f"holder-{i}", LONG_TTL_MS)

    race(contend, contenders)
    return results


def test_concurrent_acquirers_admit_exactly_one(lease_service: LeaseService) -> None:
    for round_no in range(5):
        key = f"race-{round_no}"
        winners = [lease for lease in race_to_acquire(lease_service, key, 5) if lease]
        assert len(winners) == 1
        assert winners[0].token == 1
        assert expect(lease_service.get(key)).holder == winners[0].holder


# --- refresh_many: per-lease results, one round trip ---------------------------------------


def make_leases(service: LeaseService, n: int) -> tuple[list[Lease], dict[int, Lease]]:
    """``n`` leases held by ``worker``; every index ``i % 3 != 0`` is made stale: ``1`` taken
    over by another holder, ``2`` re-granted to the same holder under a newer token."""
    leases = [expect(service.acquire(f"k{i}", "worker", LONG_TTL_MS)) for i in range(n)]
    successors: dict[int, Lease] = {}
    for i, lease in enumerate(leases):
        if i % 3 == 0:
            continue
        assert service.release(lease)
        holder = "other" if i % 3 == 1 else "worker"
        successors[i] = expect(service.acquire(lease.key, holder, LONG_TTL_MS))
    return leases, successors


class CommandLog:
    """Counts the commands a Redis client sends by wrapping its ``execute_command``."""

    def __init__(self, client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
        self.commands: list[str] = []
        original: Callable[..., Any] = client.execute_command

        def counting(*args: Any, **options: Any) -> Any:
            self.commands.append(str(args[0]))
            return original(*args, **options)

        monkeypatch.setattr(client, "execute_command", counting)


@pytest.mark.parametrize("n", [1, 10, 100])
def test_refresh_many_refreshes_live_leases_and_refuses_stale_ones(
    lease_service: LeaseService,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    n: int,
) -> None:
    leases, successors = make_leases(lease_service, n)
    log = None
    on_cluster = request.node.callspec.params.get("lease_service") == "redis-cluster"
    if isinstance(lease_service, RedisLeaseService):
        # load the script first (on a cluster, on every node the keys live on)
        lease_service.refresh_many([(lease, LONG_TTL_MS) for lease in leases])
        client = request.getfixturevalue("cluster_client" if on_cluster else "redis_client")
        log = CommandLog(client, monkeypatch)
    results = lease_service.refresh_many([(lease, 2 * LONG_TTL_MS) for lease in leases])
    if log is not None and not on_cluster:
        assert log.commands == ["EVALSHA"]  # one round trip, however many leases
    if log is not None and on_cluster:
        # a script's keys must share a slot: one call per slot, never a cross-slot call
        assert isinstance(lease_service, RedisLeaseService)
        slots = {key_slot(lease_service.lease_hash_key(lease.key).encode()) for lease in leases}
        assert log.commands == ["EVALSHA"] * len(slots)
    assert len(results) == n
    for i, (lease, result) in enumerate(zip(leases, results, strict=True)):
        current = expect(lease_service.get(lease.key))
        if i in successors:
            assert result is None
            assert current.token == successors[i].token  # the successor is untouched:
            assert current.expires_at_ms < successors[i].expires_at_ms + LONG_TTL_MS // 2
        else:
            assert result is not None
            assert (result.key, result.holder, result.token) == (lease.key, "worker", 1)
            assert result.expires_at_ms - result.granted_at_ms == 2 * LONG_TTL_MS
            assert current.expires_at_ms > lease.expires_at_ms + LONG_TTL_MS // 2


def test_refresh_many_of_nothing_is_nothing(lease_service: LeaseService) -> None:
    assert lease_service.refresh_many([]) == []


# --- scenario 34: hold_lease frees the key; refuses a taken key --------------------------


def test_hold_lease_frees_key_after_success_and_after_a_throw(
    lease_service: LeaseService,
) -> None:
    with hold_lease(lease_service, "job", 10) as held:
        assert isinstance(held, HeldLease)
        assert expect(lease_service.get("job")).holder == held.lease.holder
        assert lease_service.acquire("job", "other", LONG_TTL_MS) is None
        held.check()
    assert not held.is_lost
    assert lease_service.get("job") is None

    with pytest.raises(RuntimeError, match="boom"), hold_lease(lease_service, "job", "10s"):
        raise RuntimeError("boom")
    assert lease_service.get("job") is None


def test_hold_lease_refuses_a_taken_key_without_waiting(lease_service: LeaseService) -> None:
    expect(lease_service.acquire("job", "other", LONG_TTL_MS))
    counting = FlakyRefresh(lease_service)
    with pytest.raises(LeaseTakenError) as raised, hold_lease(counting, "job", 10):
        pytest.fail("the body must not run")
    assert raised.value.key == "job"
    assert counting.acquires == 1  # one try, no waiting and trying again
    assert expect(lease_service.get("job")).holder == "other"


def test_hold_lease_uses_the_given_holder(lease_service: LeaseService) -> None:
    with hold_lease(lease_service, "job", 10, holder="me") as held:
        assert held.lease.holder == "me"
        assert expect(lease_service.get("job")).holder == "me"


# --- scenario 35: a lost lease is reported and leaving the block raises ------------------


def test_hold_lease_reports_a_lease_lost_mid_body(lease_service: LeaseService) -> None:
    calls: list[str] = []
    with (
        pytest.raises(LeaseLostError) as raised,
        hold_lease(lease_service, "job", "300ms", on_lost=lambda: calls.append("lost")) as held,
    ):
        assert lease_service.release(held.lease)  # the lease is gone ...
        expect(lease_service.acquire("job", "thief", LONG_TTL_MS))  # ... and taken
        assert held.lost.wait(30), "the renewal thread never noticed the loss"
        assert held.is_lost
        with pytest.raises(LeaseLostError):
            held.check()
    assert raised.value.key == "job"
    assert calls == ["lost"]
    assert expect(lease_service.get("job")).holder == "thief"  # not released by the loser


def test_hold_lease_final_renewal_catches_a_loss_no_renewal_saw(
    lease_service: LeaseService,
) -> None:
    with pytest.raises(LeaseLostError), hold_lease(lease_service, "job", 30) as held:
        assert lease_service.release(held.lease)
        expect(lease_service.acquire("job", "thief", LONG_TTL_MS))
        assert not held.is_lost  # no renewal has run yet (ttl 30 s)
    assert held.is_lost
    assert expect(lease_service.get("job")).holder == "thief"


def test_hold_lease_final_renewal_that_raises_is_a_loss(lease_service: LeaseService) -> None:
    flaky = FlakyRefresh(lease_service)
    with pytest.raises(LeaseLostError) as raised, hold_lease(flaky, "job", 30) as held:
        flaky.failing.set()
    assert isinstance(raised.value.__cause__, redis.ConnectionError)
    assert held.is_lost
    assert lease_service.get("job") is None  # still released


def test_hold_lease_body_exception_wins_over_a_lost_lease(lease_service: LeaseService) -> None:
    with pytest.raises(KeyError), hold_lease(lease_service, "job", 30) as held:
        assert lease_service.release(held.lease)
        raise KeyError("body failed")


# --- scenario 36: the lease outlives its TTL while the body runs -------------------------


def test_hold_lease_keeps_the_lease_alive_past_its_ttl(lease_service: LeaseService) -> None:
    # Renewals every 500 ms keep a 1.5 s lease: a renewal thread starved for up to a second
    # still holds it. The test waits on the service clock, not on a guess of sleep lengths.
    with hold_lease(lease_service, "job", "1500ms") as held:
        first_expiry = held.lease.expires_at_ms
        wait_past(lease_service, first_expiry)
        assert lease_service.acquire("job", "other", LONG_TTL_MS) is None
        assert expect(lease_service.get("job")).holder == held.lease.holder
        assert not held.is_lost
        assert held.lease.expires_at_ms > first_expiry
    assert lease_service.get("job") is None


# --- scenario 37: an unreachable store is tolerated until held_until, not after ---------


def test_transient_refresh_errors_keep_the_lease_within_held_until(
    lease_service: LeaseService,
) -> None:
    flaky = FlakyRefresh(lease_service)
    flaky.failing.set()
    with hold_lease(flaky, "job", "3s") as held:  # renewals every second, deadline at 3 s
        first_expiry = held.lease.expires_at_ms
        assert flaky.failed.wait(30), "no renewal was tried"
        assert not held.is_lost  # unconfirmed is not lost: the deadline is 2 s away
        flaky.failing.clear()
        assert flaky.refreshed.wait(30), "renewals never resumed"
        wait_past(lease_service, first_expiry)  # the first grant alone would be over
        assert not held.is_lost
        assert lease_service.acquire("job", "other", LONG_TTL_MS) is None
    assert lease_service.get("job") is None


def test_refresh_errors_past_held_until_tell_the_body(lease_service: LeaseService) -> None:
    flaky = FlakyRefresh(lease_service)
    told: list[bool] = []  # on being told: was the confirmed deadline really past?
    flaky.failing.set()
    with (
        pytest.raises(LeaseLostError),
        hold_lease(flaky, "job", "1500ms",
                   on_lost=lambda: told.append(time.monotonic() >= held._deadline())) as held,
    ):
        assert flaky.failed.wait(30), "no renewal was tried"
        assert not held.lost.is_set()  # unconfirmed, but still within held_until
        assert held.lost.wait(30), "the body was never told"
        with pytest.raises(LeaseLostError):
            held.check()
    assert told == [True], "the body was told before the lease's confirmed deadline"


def test_hold_lease_refuses_a_bad_ttl(lease_service: LeaseService) -> None:
    for ttl in (0, "soon", -1.0):
        with pytest.raises(ValueError, match="ttl"), hold_lease(lease_service, "job", ttl):
            pytest.fail("the body must not run")
    assert lease_service.get("job") is None


# --- input validation -----------------------------------------------------------------------


@pytest.mark.parametrize("ttl_ms", [0, -5, 1.5, True, "100", None])
def test_bad_ttl_is_a_value_error_naming_it(lease_service: LeaseService, ttl_ms: Any) -> None:
    with pytest.raises(ValueError, match=f"ttl_ms: {ttl_ms!r}"):
        lease_service.acquire("job", "a", ttl_ms)
    lease = expect(lease_service.acquire("job", "a", LONG_TTL_MS))
    with pytest.raises(ValueError, match="ttl_ms"):
        lease_service.refresh(lease, ttl_ms)
    with pytest.raises(ValueError, match="ttl_ms"):
        lease_service.refresh_many([(lease, LONG_TTL_MS), (lease, ttl_ms)])


@pytest.mark.parametrize(("key", "holder"), [("", "a"), (None, "a"), ("job", ""), ("job", 7)])
def test_bad_key_or_holder_is_a_value_error(
    lease_service: LeaseService, key: Any, holder: Any
) -> None:
    bad = key if key in ("", None) else holder
    with pytest.raises(ValueError, match=f"{bad!r}"):
        lease_service.acquire(key, holder, LONG_TTL_MS)
    assert lease_service.get("job") is None


def test_memory_service_judges_expiry_on_its_injected_clock() -> None:
    clock = ManualClock()
    service = InMemoryLeaseService(clock_ms=clock)
    lease = expect(service.acquire("job", "a", 1_000))
    assert service.now_ms() == clock()
    clock.ms += 999
    assert expect(service.refresh(lease, 1_000)).token == 1
    clock.ms += 1_000
    assert service.get("job") is None
    assert expect(service.acquire("job", "b", 1_000)).token == 2


# --- Redis only (scenario 38): server clock, key layout, prefixes --------------------------


def test_a_fast_local_clock_can_neither_steal_nor_overextend(
    redis_service: RedisLeaseService, redis_client: redis.Redis
) -> None:
    expect(redis_service.acquire("held", "honest", LONG_TTL_MS))
    mine_key = redis_service.lease_hash_key("mine")
    one_hour_ahead = datetime.now(timezone.utc) + timedelta(hours=1)
    with time_machine.travel(one_hour_ahead, tick=True):
        assert time.time() * 1000 > server_ms(redis_client) + 3_500_000  # really skewed
        assert redis_service.acquire("held", "skewed", 500) is None
        assert abs(redis_service.now_ms() - server_ms(redis_client)) < 1000

        mine = expect(redis_service.acquire("mine", "skewed", 2000))
        assert mine.expires_at_ms - server_ms(redis_client) <= 2000
        assert 0 < redis_client.pttl(mine_key) <= 2000
        renewed = expect(redis_service.refresh(mine, 2000))
        assert renewed.expires_at_ms - server_ms(redis_client) <= 2000
        assert 0 < redis_client.pttl(mine_key) <= 2000

        wait_past(redis_service, renewed.expires_at_ms)  # by the server's clock
        assert redis_client.exists(mine_key) == 0
        assert redis_service.refresh(renewed, 2000) is None
        assert redis_service.get("mine") is None
    assert expect(redis_service.get("held")).holder == "honest"


def test_token_counter_survives_release_and_shares_the_lease_slot(
    redis_service: RedisLeaseService, redis_client: redis.Redis
) -> None:
    hash_key = redis_service.lease_hash_key("job")
    counter_key = redis_service.token_counter_key("job")
    assert key_slot(hash_key.encode()) == key_slot(counter_key.encode())
    first = expect(redis_service.acquire("job", "a", LONG_TTL_MS))
    assert redis_service.release(first)
    assert redis_client.exists(hash_key) == 0
    assert int(redis_client.get(counter_key) or 0) == 1
    assert redis_client.pttl(counter_key) > 0  # it expires only after a long idle time
    assert expect(redis_service.acquire("job", "b", LONG_TTL_MS)).token == 2


def test_key_prefix_isolates_services(redis_client: redis.Redis, redis_prefix: str) -> None:
    ours = RedisLeaseService(redis_client, key_prefix=f"{redis_prefix}-a")
    theirs = RedisLeaseService(redis_client, key_prefix=f"{redis_prefix}-b")
    assert expect(ours.acquire("job", "a", LONG_TTL_MS)).token == 1
    assert theirs.get("job") is None
    assert expect(theirs.acquire("job", "b", LONG_TTL_MS)).token == 1
    assert expect(ours.get("job")).holder == "a"
    assert len(list(redis_client.scan_iter(match=f"{redis_prefix}-a:*"))) == 2
    assert len(list(redis_client.scan_iter(match=f"{redis_prefix}-b:*"))) == 2


def test_every_key_lives_under_the_prefix(
    redis_service: RedisLeaseService, redis_client: redis.Redis, redis_prefix: str
) -> None:
    expect(redis_service.acquire("job", "a", LONG_TTL_MS))
    keys = sorted(redis_client.scan_iter(match=f"{redis_prefix}*"))
    assert keys == sorted(
        [f"{redis_prefix}:lease:{{job}}".encode(), f"{redis_prefix}:lease-token:{{job}}".encode()]
    )


def test_decoding_clients_work_too(redis_prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        service = RedisLeaseService(client, key_prefix=redis_prefix)
        lease = expect(service.acquire("job", "a", LONG_TTL_MS))
        seen = expect(service.get("job"))
        assert (seen.holder, seen.token) == ("a", 1)
        assert expect(service.refresh(lease, LONG_TTL_MS)).token == 1
        assert service.release(lease)
    finally:
        client.close()


@pytest.mark.parametrize("prefix", ["", "a{b", "a}b"])
def test_bad_key_prefix_is_a_value_error(redis_client: redis.Redis, prefix: str) -> None:
    with pytest.raises(ValueError, match="key_prefix"):
        RedisLeaseService(redis_client, key_prefix=prefix)


def test_from_url_builds_a_working_service(redis_prefix: str) -> None:
    service = RedisLeaseService.from_url(REDIS_URL, key_prefix=redis_prefix)
    assert service.key_prefix == redis_prefix
    assert expect(service.acquire("job", "a", LONG_TTL_MS)).token == 1


# --- Redis Cluster only: slots, URLs, lazy connection ------------------------------------


@pytest.mark.parametrize("run_id", ["r1", "a:b", "x{y", "x}y", "{}", "}{", "run{with}tag"])
def test_every_key_of_one_lease_shares_a_slot(run_id: str) -> None:
    """Each script gets the keys of one lease only (hash, counter, marks, watch): they must
    be in one slot whatever the run id, or a cluster refuses the script."""
    service = RedisLeaseService(redis.Redis(), key_prefix="app")  # nothing connects
    for key in (keys.run_lease_key(run_id), keys.step_lease_key(run_id, "step{1}"),
                keys.REAPER_LEASE_KEY):
        physical = [service.lease_hash_key(key), service.token_counter_key(key),
                    service.marks_key(key), service.watch_key(key)]
        assert len({key_slot(name.encode()) for name in physical}) == 1, physical


def test_refresh_many_on_a_cluster_spans_nodes(cluster_service: RedisLeaseService,
                                               cluster_client: RedisCluster) -> None:
    """Leases on every node of the cluster, refreshed by one call."""
    leases = [expect(cluster_service.acquire(f"job-{i}", "w", LONG_TTL_MS)) for i in range(30)]
    nodes = {cluster_client.get_node_from_key(cluster_service.lease_hash_key(lease.key)).name
             for lease in leases}
    assert len(nodes) == 3
    renewed = cluster_service.refresh_many([(lease, 2 * LONG_TTL_MS) for lease in leases])
    assert [expect(r).key for r in renewed] == [lease.key for lease in leases]
    for lease in leases:
        assert cluster_client.pttl(cluster_service.lease_hash_key(lease.key)) > LONG_TTL_MS


def test_cluster_from_url_builds_a_working_service(redis_cluster: RedisClusterServer,
                                                   cluster_client: RedisCluster) -> None:
    prefix = f"pikku-test-{uuid.uuid4().hex}"
    service = RedisLeaseService.from_url(redis_cluster.url, key_prefix=prefix)
    try:
        assert service.describe() == f"Redis Cluster at {redis_cluster.url}"
        service.ping()
        lease = expect(service.acquire("job", "a", LONG_TTL_MS))
        assert cluster_client.hget(service.lease_hash_key("job"), "holder") == b"a"
        assert service.refresh_many([(lease, LONG_TTL_MS)])[0] is not None
        busy = service.acquire_or_mark("job", "b", LONG_TTL_MS, "m")
        assert not isinstance(busy, Lease)
        assert service.release_or_take_marks(lease, LONG_TTL_MS) == ("m",)
        assert abs(service.now_ms() - server_ms(redis.Redis(port=redis_cluster.ports[0]))) < 1000
    finally:
        for key in list(cluster_client.scan_iter(match=f"{prefix}*")):
            cluster_client.delete(key)


def test_cluster_url_connects_at_the_first_call_and_names_no_password() -> None:
    """An engine opens no connection until used: a cluster URL with no server behind it
    builds a service; its first call fails naming the nodes, never the password."""
    url = "redis+cluster://user:s3cret@127.0.0.1:1,127.0.0.1:2"
    service = RedisLeaseService.from_url(url, key_prefix="app")
    assert service.describe() == "Redis Cluster at redis+cluster://127.0.0.1:1,127.0.0.1:2"
    with pytest.raises(ConnectionError, match=r"127\.0\.0\.1:1") as raised:
        service.ping()
    assert "s3cret" not in str(raised.value)


@pytest.mark.parametrize("url", ["redis+cluster://", "redis+cluster://h:1/2",
                                 "redis+cluster://h:1?decode_responses=true",
                                 "redis+cluster://h:port"])
def test_bad_cluster_url_is_a_value_error(url: str) -> None:
    with pytest.raises(ValueError, match="Redis Cluster URL"):
        RedisLeaseService.from_url(url)


def test_a_cluster_url_whose_password_holds_a_slash_is_refused_without_it() -> None:
    """The address ends at the unescaped '/': the password's head would be read as a node
    (``bad node ':Xk9pQ2mZ'``)."""
    with pytest.raises(ValueError, match="percent-encode") as refused:
        RedisLeaseService.from_url("redis+cluster://:Xk9pQ2mZ/7vLr@10.0.0.1:7000")
    assert "redis+cluster://:***@10.0.0.1:7000" in str(refused.value)
    assert "Xk9pQ2mZ" not in str(refused.value) and "7vLr" not in str(refused.value)


# --- issue 21: the hand-back is fenced by the token, not only by the holder ----------------


def test_a_stale_hand_back_by_the_same_holder_changes_nothing(
        lease_service: LeaseService, let_time_pass: Callable[[int], None]) -> None:
    """The same holder was granted the key again after its lease lapsed (a new token): the
    old grant's hand-back (``release_or_take_marks``) must neither take the new grant's
    marks nor release it. A hand-back judged by holder alone would do both."""
    stale = expect(lease_service.acquire("run", "a", SHORT_TTL_MS))
    let_time_pass(SHORT_TTL_MS + 50)
    wait_past(lease_service, stale.expires_at_ms)
    fresh = expect(lease_service.acquire("run", "a", LONG_TTL_MS))
    assert fresh.token == stale.token + 1
    lease_service.mark("run", "for-the-fresh-grant")
    assert lease_service.release_or_take_marks(stale, LONG_TTL_MS) is None
    assert expect(lease_service.get("run")).token == fresh.token
    assert lease_service.release_or_take_marks(fresh, LONG_TTL_MS) == ("for-the-fresh-grant",)
    assert lease_service.release_or_take_marks(fresh, LONG_TTL_MS) == ()
    assert lease_service.get("run") is None
