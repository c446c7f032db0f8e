"""Hardening of issue 8, infrastructure side: state that survives a fork (10), counters and
names bounded before they reach Redis (14), nesting depth refused before it recurses (16),
an unreachable store named clearly (20), what the distribution ships (21), and indexes that
serve every store query (22)."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore
from pikku_celery.clock import ServerClock
from pikku_celery.heartbeat import Heartbeat, HeldStep
from pikku_celery.leases.base import Lease

# --- 10: locks created before a fork ------------------------------------------------------

CHILD_HANG_LIMIT_S = 30.0  # a guard against a hung child, never a timing assertion


class _FixedSource:
    def now_ms(self) -> int:
        return 1_700_000_000_000


@contextmanager
def _held_by_another_thread(lock: threading.Lock) -> Iterator[None]:
    """Hold ``lock`` in a second thread for the duration of the block, as the worker's
    reaper or heartbeat thread holds it at the moment the prefork pool forks."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join()


def _in_forked_child(body: Callable[[], None]) -> None:
    """Run ``body`` in a forked child; fail if it raises or does not finish."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            body()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + CHILD_HANG_LIMIT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the forked child failed"
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung: it inherited a lock held by a parent thread")
        time.sleep(0.01)


def test_a_child_forked_while_a_thread_holds_the_clock_lock_can_read_the_clock() -> None:
    clock = ServerClock(_FixedSource())
    assert clock.now_ms() >= 1_700_000_000_000

    def child() -> None:
        assert clock.now_ms() >= 1_700_000_000_000
        clock.observe(1_700_000_001_000, time.monotonic())
        assert clock.now_ms() >= 1_700_000_001_000

    with _held_by_another_thread(clock._lock):
        _in_forked_child(child)


def test_a_forked_child_gets_a_usable_heartbeat_without_the_parents_steps() -> None:
    leases = InMemoryLeaseService()
    heartbeat = Heartbeat(InMemoryWorkflowStore(), leases, ServerClock(leases))
    lease = Lease("workflow-step:r:s", "parent", 1, 0, 0)
    parents = HeldStep("r", "s", 1, 600_000, lease, held_until=time.monotonic() + 600)
    heartbeat.add(parents)

    def child() -> None:
        # The parent's step is renewed by the parent; a child renewing it too would keep
        # a dead parent's lease alive.
        assert heartbeat.held() == []
        mine = HeldStep("r", "t", 1, 600_000, lease, held_until=time.monotonic() + 600)
        heartbeat.add(mine)
        assert heartbeat.held() == [mine]
        heartbeat.remove(mine)

    try:
        with _held_by_another_thread(heartbeat._lock):
            _in_forked_child(child)
    finally:
        heartbeat.remove(parents)
    assert heartbeat.held() == []
