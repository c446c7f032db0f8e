"""Marks on a lease (issue 11), on ``InMemoryLeaseService`` and ``RedisLeaseService``.

A caller that finds a key held leaves a mark instead of waiting or re-sending; the holder
takes the marks as it hands the lease back and keeps the lease, or releases it when there
are none. The properties that make this a coalescing of wake-ups that loses none:

* taking and releasing is one atomic step: a mark left before the release is taken by the
  holder, one left after it finds the key free (no mark is left on a free key unseen: the
  next grant carries the marks that were there);
* a hand-back by a stale holder changes nothing (marks stay for the real holder);
* the first mark of a grant arms one watch (``LeaseBusy.watch``), so a holder that dies
  with marks untaken does not strand them: the marker looks again once the lease lapsed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from redis.cluster import key_slot

from pikku_celery.leases.base import Lease, LeaseBusy, LeaseService
from pikku_celery.leases.hold import hold_granted
from pikku_celery.leases.redis import RedisLeaseService
from pikku_celery.model.errors import LeaseLostError
from tests.contract import test_leases as suite
from tests.contract.test_leases import LONG_TTL_MS, expect

# The lease contract suite's fixtures: every service (on its clock), Redis under a prefix.
clock = suite.clock
lease_service = suite.lease_service
let_time_pass = suite.let_time_pass
redis_prefix = suite.redis_prefix
redis_service = suite.redis_service
cluster_client = suite.cluster_client
cluster_service = suite.cluster_service


def granted(got: Lease | LeaseBusy) -> Lease:
    assert isinstance(got, Lease), got
    return got


def busy(got: Lease | LeaseBusy) -> LeaseBusy:
    assert isinstance(got, LeaseBusy), got
    return got


def test_a_free_key_is_granted_with_the_next_token(lease_service: LeaseService) -> None:
    first = granted(lease_service.acquire_or_mark("run", "a", LONG_TTL_MS, "s1"))
    assert (first.token, first.marks) == (1, ())
    assert lease_service.release_or_take_marks(first, LONG_TTL_MS) == ()
    second = granted(lease_service.acquire_or_mark("run", "b", LONG_TTL_MS, "s2"))
    assert (second.token, second.marks) == (2, ())  # its own mark is not handed to it


def test_a_held_key_gets_the_mark_and_the_holder_takes_it_instead_of_releasing(
        lease_service: LeaseService) -> None:
    held = granted(lease_service.acquire_or_mark("run", "holder", LONG_TTL_MS, "$all"))
    first = busy(lease_service.acquire_or_mark("run", "w1", LONG_TTL_MS, "s1"))
    second = busy(lease_service.acquire_or_mark("run", "w2", LONG_TTL_MS, "s2"))
    assert first.watch and not second.watch  # one watch per grant
    assert 0 < first.remaining_ms <= LONG_TTL_MS
    assert lease_service.release_or_take_marks(held, LONG_TTL_MS) == ("s1", "s2")
    assert isinstance(lease_service.acquire_or_mark("run", "w3", LONG_TTL_MS, "s3"),
                      LeaseBusy)  # still held: the holder passes again
    assert lease_service.release_or_take_marks(held, LONG_TTL_MS) == ("s3",)
    assert lease_service.release_or_take_marks(held, LONG_TTL_MS) == ()  # released now
    assert granted(lease_service.acquire("run", "next", LONG_TTL_MS)).token == 2


def test_marks_on_a_free_key_go_to_the_next_grant(lease_service: LeaseService) -> None:
    held = granted(lease_service.acquire_or_mark("run", "a", 300, "x"))
    busy(lease_service.acquire_or_mark("run", "b", LONG_TTL_MS, "left"))
    lease_service.mark("run", "cancelled")  # ``mark`` leaves one whether held or not
    assert lease_service.release(held)  # a plain release takes nothing
    nxt = granted(lease_service.acquire_or_mark("run", "c", LONG_TTL_MS, "mine"))
    assert nxt.marks == ("cancelled", "left")
    assert lease_service.release_or_take_marks(nxt, LONG_TTL_MS) == ()


def test_a_stale_hand_back_changes_nothing(lease_service: LeaseService,
                                           let_time_pass: Any) -> None:
    stale = granted(lease_service.acquire_or_mark("run", "a", 200, "x"))
    let_time_pass(400)
    fresh = granted(lease_service.acquire_or_mark("run", "b", LONG_TTL_MS, "y"))
    busy(lease_service.acquire_or_mark("run", "c", LONG_TTL_MS, "for-b"))
    assert lease_service.release_or_take_marks(stale, LONG_TTL_MS) is None
    assert expect(lease_service.get("run")).holder == "b"
    assert lease_service.release_or_take_marks(fresh, LONG_TTL_MS) == ("for-b",)


def test_a_new_grant_rearms_the_watch(lease_service: LeaseService) -> None:
    first = granted(lease_service.acquire_or_mark("run", "a", LONG_TTL_MS, "x"))
    assert busy(lease_service.acquire_or_mark("run", "m", LONG_TTL_MS, "1")).watch
    lease_service.release_or_take_marks(first, LONG_TTL_MS)
    assert lease_service.release_or_take_marks(first, LONG_TTL_MS) == ()
    granted(lease_service.acquire_or_mark("run", "b", LONG_TTL_MS, "y"))
    assert busy(lease_service.acquire_or_mark("run", "m", LONG_TTL_MS, "2")).watch


def test_racing_markers_and_a_releasing_holder_lose_no_mark(
        lease_service: LeaseService) -> None:
    """Every mark is either taken by a hand-back or carried by a later grant."""
    seen: list[str] = []
    lock = threading.Lock()
    endless: list[str] = []  # grants whose hand-backs never ended

    def worker(n: int) -> None:
        for i in range(30):
            mark = f"{n}-{i}"
            got = lease_service.acquire_or_mark("run", f"w{n}-{i}", LONG_TTL_MS, mark)
            if isinstance(got, LeaseBusy):
                continue
            with lock:
                seen.extend(got.marks)
                seen.append(mark)  # its own change: the grant's pass sees it
            # Bounded: 4 markers leave at most 120 marks, so a holder that is handed marks
            # back more often than that is taking the same ones again (a hand-back that
            # does not clear them): fail, never spin until pytest's timeout.
            for _ in range(200):
                taken = lease_service.release_or_take_marks(got, LONG_TTL_MS)
                if not taken:
                    break
                with lock:
                    seen.extend(taken)
            else:
                endless.append(got.holder)
                return

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60  # one bound for all four, not 60 s each
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a worker never finished"
    assert not endless, f"hand-backs never ended for {endless}"
    last = granted(lease_service.acquire_or_mark("run", "final", LONG_TTL_MS, "final"))
    seen.extend(last.marks)
    assert sorted(set(seen)) == sorted(f"{n}-{i}" for n in range(4) for i in range(30))


def test_hold_granted_hands_back_marks_and_keeps_renewing(lease_service: LeaseService) -> None:
    lease = granted(lease_service.acquire_or_mark("run", "a", 300, "x"))
    with hold_granted(lease_service, lease, 300, time.monotonic()) as held:
        busy(lease_service.acquire_or_mark("run", "b", LONG_TTL_MS, "s"))
        assert held.hand_back() == ("s",)
        time.sleep(0.5)  # past the TTL: the renewal thread kept it
        assert expect(lease_service.get("run")).holder == "a"
        assert held.hand_back() == ()
    assert lease_service.get("run") is None


def test_a_hand_back_of_a_lost_lease_raises(lease_service: LeaseService) -> None:
    lease = granted(lease_service.acquire_or_mark("run", "a", LONG_TTL_MS, "x"))
    with pytest.raises(LeaseLostError), hold_granted(lease_service, lease, LONG_TTL_MS,
                                                     time.monotonic()) as held:
        assert lease_service.release(lease)
        expect(lease_service.acquire("run", "thief", LONG_TTL_MS))
        held.hand_back()
    assert expect(lease_service.get("run")).holder == "thief"


def test_a_bad_mark_is_a_value_error(lease_service: LeaseService) -> None:
    for mark in ("", "x" * 513, None):
        with pytest.raises(ValueError, match="mark"):
            lease_service.acquire_or_mark("run", "a", LONG_TTL_MS, mark)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="mark"):
            lease_service.mark("run", mark)  # type: ignore[arg-type]


def test_marks_and_watch_share_the_lease_slot_and_expire(
        redis_service: RedisLeaseService, redis_client: redis.Redis,
        redis_prefix: str) -> None:
    held = granted(redis_service.acquire_or_mark("run", "a", LONG_TTL_MS, "x"))
    busy(redis_service.acquire_or_mark("run", "b", LONG_TTL_MS, "s"))
    slot = key_slot(redis_service.lease_hash_key("run").encode())
    for key in (redis_service.marks_key("run"), redis_service.watch_key("run")):
        assert key.startswith(f"{redis_prefix}:")
        assert key_slot(key.encode()) == slot
        assert redis_client.pttl(key) > 0  # nothing is kept forever
    assert redis_service.release_or_take_marks(held, LONG_TTL_MS) == ("s",)
    assert redis_client.exists(redis_service.marks_key("run")) == 0


# --- notes: what a holder that released the key leaves for the next grant ------------------


def test_a_released_holder_leaves_its_note_for_the_next_grant_only(
        lease_service: LeaseService) -> None:
    first = granted(lease_service.acquire_or_mark("run", "a", LONG_TTL_MS, "s1"))
    assert first.note is None
    assert lease_service.release_or_take_marks(first, LONG_TTL_MS, b"view at 1") == ()
    second = granted(lease_service.acquire_or_mark("run", "b", LONG_TTL_MS, "s2"))
    assert second.note == b"view at 1"
    assert lease_service.release_or_take_marks(second, LONG_TTL_MS) == ()  # no note
    third = granted(lease_service.acquire_or_mark("run", "c", LONG_TTL_MS, "s3"))
    assert third.note is None  # taken by the second grant, and none left since


def test_a_holder_that_takes_marks_leaves_no_note_yet(lease_service: LeaseService) -> None:
    held = granted(lease_service.acquire_or_mark("run", "a", LONG_TTL_MS, "x"))
    busy(lease_service.acquire_or_mark("run", "b", LONG_TTL_MS, "s"))
    assert lease_service.release_or_take_marks(held, LONG_TTL_MS, b"early") == ("s",)
    assert lease_service.release_or_take_marks(held, LONG_TTL_MS, b"final") == ()
    assert granted(lease_service.acquire_or_mark("run", "b", LONG_TTL_MS, "s")).note == (
        b"final")


def test_a_stale_hand_back_leaves_no_note(lease_service: LeaseService,
                                          let_time_pass: Any) -> None:
    stale = granted(lease_service.acquire_or_mark("run", "a", 50, "x"))
    let_time_pass(200)
    fresh = granted(lease_service.acquire_or_mark("run", "b", LONG_TTL_MS, "y"))
    assert lease_service.release_or_take_marks(stale, LONG_TTL_MS, b"stale") is None
    assert lease_service.release_or_take_marks(fresh, LONG_TTL_MS) == ()
    assert granted(lease_service.acquire_or_mark("run", "c", LONG_TTL_MS, "z")).note is None


def test_a_note_shares_the_lease_slot_and_lapses(
        redis_service: RedisLeaseService, redis_client: redis.Redis) -> None:
    held = granted(redis_service.acquire_or_mark("run", "a", LONG_TTL_MS, "x"))
    redis_service.release_or_take_marks(held, LONG_TTL_MS, b"\x00binary\xff")
    key = redis_service.note_key("run")
    assert key_slot(key.encode()) == key_slot(redis_service.lease_hash_key("run").encode())
    assert 0 < redis_client.pttl(key) <= 60_000
    assert granted(redis_service.acquire_or_mark("run", "b", LONG_TTL_MS, "y")).note == (
        b"\x00binary\xff")
    assert redis_client.exists(key) == 0
