"""Announcements of a key (``LeaseService.announce`` / ``listen``), on the in-memory
service, one Redis server and a Redis Cluster: what wakes a caller waiting for a run's end.

* a listener hears an announcement made after it began listening, by ``announce`` or by a
  hand-back that asks for it (``release_or_take_marks(announce=True)``, in the same script),
  and hears each one once;
* it hears nothing of another key, nor of an announcement made before it listened (the
  caller reads what the key guards once it listens: that read covers those);
* a hand-back announces whatever becomes of the lease (taken marks, a stale grant): the
  holder announces what it wrote before the call;
* a listener that cannot reach Redis, or whose Redis never answers, waits out its
  timeout and never raises.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Callable

import pytest
import redis

from pikku_celery.leases.announcements import SUBSCRIBE_CONFIRM_S
from pikku_celery.leases.base import LeaseService
from pikku_celery.leases.redis import RedisLeaseService
from tests.contract import test_leases as suite
from tests.contract.test_leases import LONG_TTL_MS

lease_service = suite.lease_service
redis_prefix = suite.redis_prefix
redis_service = suite.redis_service
clock = suite.clock
cluster_client = suite.cluster_client
cluster_service = suite.cluster_service

QUICK_S = 0.2  # a wait that must time out: long enough for a wrongly delivered message
HEARD_S = 10.0  # a wait that must be woken: bounded only so a broken test ends


def _later(action: Callable[[], object], delay_s: float = 0.05) -> threading.Thread:
    def later() -> None:
        time.sleep(delay_s)
        action()

    thread = threading.Thread(target=later)
    thread.start()
    return thread


def test_an_announcement_wakes_the_listener_once(lease_service: LeaseService) -> None:
    with lease_service.listen("run:a") as listener:
        assert not listener.wait(QUICK_S)
        started = time.monotonic()
        thread = _later(lambda: lease_service.announce("run:a"))
        assert listener.wait(HEARD_S)
        assert time.monotonic() - started < HEARD_S / 2
        thread.join()
        assert not listener.wait(QUICK_S), "one announcement was heard twice"


def test_another_keys_announcement_or_an_earlier_one_is_not_heard(
        lease_service: LeaseService) -> None:
    lease_service.announce("run:b")  # before anyone listens: nobody hears it
    with lease_service.listen("run:b") as listener:
        lease_service.announce("run:other")
        assert not listener.wait(QUICK_S)


def test_two_listeners_of_one_key_both_hear(lease_service: LeaseService) -> None:
    with lease_service.listen("run:c") as first, lease_service.listen("run:c") as second:
        lease_service.announce("run:c")
        assert first.wait(HEARD_S) and second.wait(HEARD_S)


@pytest.mark.parametrize("marked", [False, True])
def test_a_hand_back_announces_in_the_same_call(lease_service: LeaseService,
                                                marked: bool) -> None:
    lease = lease_service.acquire("run:d", "h", LONG_TTL_MS)
    assert lease is not None
    if marked:
        lease_service.mark("run:d", "wake")
    with lease_service.listen("run:d") as listener:
        taken = lease_service.release_or_take_marks(lease, LONG_TTL_MS, announce=True)
        assert taken == (("wake",) if marked else ())
        assert listener.wait(HEARD_S)
    other = lease_service.acquire("run:d2", "h", LONG_TTL_MS)
    assert other is not None
    with lease_service.listen("run:d2") as listener:  # no announce asked: none made
        assert lease_service.release_or_take_marks(other, LONG_TTL_MS) == ()
        assert not listener.wait(QUICK_S)


def test_a_stale_hand_back_still_announces(lease_service: LeaseService) -> None:
    lease = lease_service.acquire("run:e", "h", LONG_TTL_MS)
    assert lease is not None and lease_service.release(lease)
    with lease_service.listen("run:e") as listener:
        assert lease_service.release_or_take_marks(lease, LONG_TTL_MS, announce=True) is None
        assert listener.wait(HEARD_S)


def test_a_listener_without_redis_waits_out_its_timeout() -> None:
    unreachable = RedisLeaseService(redis.Redis(host="127.0.0.1", port=1, socket_timeout=0.2,
                                                socket_connect_timeout=0.2),
                                    key_prefix="pikku-test-nowhere")
    with unreachable.listen("run:f") as listener:
        started = time.monotonic()
        assert not listener.wait(QUICK_S)
        assert time.monotonic() - started >= QUICK_S * 0.9  # waited, did not spin or raise


def test_a_redis_that_never_answers_does_not_hold_the_waiter() -> None:
    """A partition that drops packets leaves a connect hanging (redis-py sets no connect
    timeout by default). Here: a server whose accept queue is full, so the kernel drops the
    listener's SYNs. The caller must still get its answer by its own timeout."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    host, port = server.getsockname()
    fillers = []
    for _ in range(3):  # fill the accept queue: later connects hang
        filler = socket.socket()
        filler.settimeout(0.3)
        with contextlib.suppress(OSError):
            filler.connect((host, port))
        fillers.append(filler)
    hanging = RedisLeaseService(redis.Redis(host=host, port=port),
                                key_prefix="pikku-test-hanging")
    try:
        started = time.monotonic()
        with hanging.listen("run:g") as listener:
            assert not listener.wait(QUICK_S)
        took = time.monotonic() - started
        assert took < SUBSCRIBE_CONFIRM_S + QUICK_S + 2.0, f"held the waiter {took:.1f} s"
    finally:
        for filler in fillers:
            filler.close()
        server.close()


def test_a_user_forbidden_the_channel_still_hands_leases_back(
        redis_client: redis.Redis, redis_prefix: str) -> None:
    """Redis ACLs (6.2+) grant pub/sub channels apart from keys: a lease user allowed its
    keys and not the announcement channel loses the announcement, never the hand-back (a
    run lease that could not be released would hold every later pass of the run)."""
    user, password = f"{redis_prefix}-user", uuid.uuid4().hex
    redis_client.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}",
                                 f"~{redis_prefix}*", "+@all", "resetchannels")
    try:
        kwargs = redis_client.connection_pool.connection_kwargs
        limited = redis.Redis(host=kwargs.get("host", "127.0.0.1"),
                              port=kwargs.get("port", 6379), db=kwargs.get("db", 0),
                              username=user, password=password)
        service = RedisLeaseService(limited, key_prefix=redis_prefix)
        lease = service.acquire("run:h", "h", LONG_TTL_MS)
        assert lease is not None
        with service.listen("run:h") as listener:  # refused its SUBSCRIBE: reads instead
            assert service.release_or_take_marks(lease, LONG_TTL_MS, announce=True) == ()
            assert not listener.wait(QUICK_S)
        assert service.get("run:h") is None  # released
        limited.close()
    finally:
        redis_client.execute_command("ACL", "DELUSER", user)
