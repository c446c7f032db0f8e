"""Per-process state after a fork: locks and threads are not inherited in working order.

Celery's prefork pool forks its children from a parent process that keeps running threads
(the in-worker reaper, pymongo's monitors). ``fork`` copies every lock in the state it has
at that instant, but only the forking thread survives in the child:

    t0  parent: the reaper thread enters ``ServerClock.now_ms`` and takes its lock
    t1  parent: the pool forks a child (a replacement for a child that died, say)
    t2  child:  the lock is copied *held*; the thread that would release it does not exist
    t3  child:  the first step claim calls ``now_ms`` and blocks forever

Objects that the parent creates and children use register here; a forked child re-creates
their locks (and drops state that belonged to the parent's threads) before any other code
runs in it. Registration holds a weak reference, so it never keeps an object alive.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class ForkAware(Protocol):
    def _after_fork_in_child(self) -> None: ...


_registered: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def reset_in_forked_child(obj: ForkAware) -> None:
    """Call ``obj._after_fork_in_child()`` in every child forked after this call."""
    _registered.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_registered):
        obj._after_fork_in_child()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere there is no fork to survive
    os.register_at_fork(after_in_child=_after_fork_in_child)
