"""Hardening of issue 8 against the real Redis: names and counters bounded before they
reach Redis (14)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from pikku_celery import (
    InMemoryWorkflowStore,
    InvalidInputError,
    Lease,
    PikkuCelery,
    RedisLeaseService,
)
from pikku_celery.leases.redis import COUNTER_TTL_FLOOR_MS, counter_ttl_ms
from tests.unit.test_engine import Recorder

HUGE = "x" * 500_000
DAY_MS = 24 * 3600 * 1000


def _keys(client: redis.Redis, prefix: str) -> set[bytes]:
    return set(client.scan_iter(match=f"{prefix}:*", count=1000))


def _expect(lease: Lease | None) -> Lease:
    assert lease is not None
    return lease


# --- 14: names and counters bounded ---------------------------------------------------------


@pytest.fixture
def pikku(redis_client: redis.Redis, key_prefix: str) -> Iterator[PikkuCelery]:
    pikku = PikkuCelery(Celery(f"infra-{key_prefix}", broker="memory://"),
                        store=InMemoryWorkflowStore(),
                        leases=RedisLeaseService(redis_client, key_prefix=key_prefix),
                        worker_reaper=False)
    pikku.engine.dispatcher = Recorder()

    @pikku.step(name="infra.charge")
    def charge(data: Any) -> str:
        return "charged"

    @pikku.workflow("infra.order")
    def order(wf: Any, data: Any) -> Any:
        return wf.do("charge", charge, data)

    yield pikku


@pytest.mark.parametrize(("task", "args"), [
    ("infra.charge", ("{run}", HUGE)),
    ("infra.charge", (HUGE, "charge")),
    ("infra.charge", ("{run}", "$where")),
    ("pikku.timer", ("{run}", HUGE)),
    ("pikku.orchestrate", (HUGE,)),
])
def test_a_forged_message_with_an_oversized_name_writes_no_redis_key(
        pikku: PikkuCelery, redis_client: redis.Redis, key_prefix: str, task: str,
        args: tuple[str, ...]) -> None:
    run_id = pikku.start("infra.order", {"amount": 5})
    before = _keys(redis_client, key_prefix)
    with pytest.raises(InvalidInputError, match="malformed pikku message") as refused:
        pikku.app.tasks[task].run(*(run_id if a == "{run}" else a for a in args))
    assert len(str(refused.value)) < 400  # names the problem, never echoes 500 KB
    assert _keys(redis_client, key_prefix) == before


def test_the_lease_service_refuses_an_oversized_key_before_redis(
        redis_client: redis.Redis, key_prefix: str) -> None:
    leases = RedisLeaseService(redis_client, key_prefix=key_prefix)
    for key, holder in ((HUGE, "h"), ("k" * 513, "h"), ("k", HUGE)):
        with pytest.raises(ValueError, match="at most 512 characters"):
            leases.acquire(key, holder, 1000)
    with pytest.raises(ValueError, match="invalid lease key"):
        leases.get(HUGE)
    assert _keys(redis_client, key_prefix) == set()
    # The longest key pikku itself makes (a step lease of a 200-character run id) fits.
    longest = f"workflow-step:{'r' * 200}:{'i' * 36}"
    assert _expect(leases.acquire(longest, "h", 1000)).token == 1


def test_token_counters_expire_long_after_any_lease_and_every_use_pushes_that_back(
        redis_client: redis.Redis, key_prefix: str) -> None:
    leases = RedisLeaseService(redis_client, key_prefix=key_prefix)
    counter = leases.token_counter_key("job")
    slack_ms = 60_000

    def counter_ttl() -> int:
        return int(redis_client.pttl(counter))

    first = _expect(leases.acquire("job", "a", 500))
    assert COUNTER_TTL_FLOOR_MS - slack_ms < counter_ttl() <= COUNTER_TTL_FLOOR_MS
    # Age the counter by hand: a renewal of the live lease pushes its expiry back...
    redis_client.pexpire(counter, 10_000)
    assert _expect(leases.refresh(first, 500)).token == 1
    assert counter_ttl() > COUNTER_TTL_FLOOR_MS - slack_ms
    # ...and so does the live holder re-acquiring, and a fresh grant after a release.
    redis_client.pexpire(counter, 10_000)
    assert _expect(leases.acquire("job", "a", 500)).token == 1
    assert counter_ttl() > COUNTER_TTL_FLOOR_MS - slack_ms
    assert leases.release(first)
    redis_client.pexpire(counter, 10_000)
    assert _expect(leases.acquire("job", "b", 500)).token == 2  # never backwards in use
    assert counter_ttl() > COUNTER_TTL_FLOOR_MS - slack_ms
    # A refused renewal (a stale handle) extends nothing.
    redis_client.pexpire(counter, 10_000)
    assert leases.refresh(first, 500) is None
    assert counter_ttl() <= 10_000


def test_a_counter_outlives_a_long_lease_by_a_thousand_ttls(
        redis_client: redis.Redis, key_prefix: str) -> None:
    leases = RedisLeaseService(redis_client, key_prefix=key_prefix)
    _expect(leases.acquire("long", "a", 2 * DAY_MS))
    ttl = int(redis_client.pttl(leases.token_counter_key("long")))
    assert counter_ttl_ms(2 * DAY_MS) == 2000 * DAY_MS
    assert 2000 * DAY_MS - 60_000 < ttl <= 2000 * DAY_MS
    # refresh_many pushes back the counter of every lease it renews.
    many = [_expect(leases.acquire(f"m{i}", "a", 500)) for i in range(3)]
    for lease in many:
        redis_client.pexpire(leases.token_counter_key(lease.key), 10_000)
    assert all(leases.refresh_many([(lease, 500) for lease in many]))
    for lease in many:
        assert int(redis_client.pttl(leases.token_counter_key(lease.key))) > 10_000
