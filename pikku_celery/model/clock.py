"""The lease service's clock, estimated locally between samples.

Lease deadlines must come from one clock (contract invariant 10): the lease service's (the
Redis server's ``TIME``). Asking Redis for the time before every write would cost a round
trip each, so this clock anchors the server time to the local *monotonic* clock at each
sample and extrapolates. The monotonic clock does not move when someone sets the wall clock,
so a worker whose wall clock is an hour off still reads the server's time. Every lease
operation that returns the server time re-anchors it for free; claims use the exact server
time returned by the lease grant itself.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import Protocol

from pikku_celery.model._fork import reset_in_forked_child


class _TimeSource(Protocol):
    def now_ms(self) -> int: ...


class Clock(Protocol):
    """What the engine needs of a clock: ``ServerClock``, or the test kit's virtual clock."""

    def now_ms(self) -> int:
        """Now on the lease service's clock, epoch milliseconds."""
        ...

    def observe(self, server_ms: int, sent_monotonic: float) -> None:
        """A server time read by a call started at ``sent_monotonic``."""
        ...

    def sleep_until(self, due_ms: int) -> None:
        """Return once ``now_ms()`` has reached ``due_ms`` (inline runs wait on timers)."""
        ...


class ServerClock:
    """``now_ms()`` on the lease service's clock, re-sampled at least every ``resync_s``."""

    def __init__(self, source: _TimeSource, *, resync_s: float = 30.0) -> None:
        self._source = source
        self._resync_s = resync_s
        self._lock = threading.Lock()
        self._offset_ms: float | None = None
        self._sampled_at = 0.0
        # The parent's reaper thread uses this clock while the prefork pool forks children:
        # a child must not inherit the lock held (see ``pikku_celery.model._fork``).
        reset_in_forked_child(self)

    def _after_fork_in_child(self) -> None:
        # The anchor stays valid: the monotonic clock is the machine's, not the process's.
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        with self._lock:
            fresh = self._offset_ms is not None and (
                time.monotonic() - self._sampled_at < self._resync_s)
        if not fresh:
            sent = time.monotonic()
            server_ms = self._source.now_ms()
            self.observe(server_ms, sent)
        with self._lock:
            assert self._offset_ms is not None
            return int(time.monotonic() * 1000 + self._offset_ms)

    def sleep_until(self, due_ms: int) -> None:
        time.sleep(max(0.0, (due_ms - self.now_ms()) / 1000))

    def observe(self, server_ms: int, sent_monotonic: float) -> None:
        """Re-anchor on a server time read by a call started at ``sent_monotonic``; the
        reading is placed half-way through the round trip."""
        received = time.monotonic()
        midpoint = (sent_monotonic + received) / 2
        with self._lock:
            self._offset_ms = server_ms - midpoint * 1000
            self._sampled_at = received


def epoch_ms(when: datetime) -> int:
    """``when`` as the epoch milliseconds the leases' and the stores' clocks count in."""
    return round(when.timestamp() * 1000)
