"""The lease service contract: short, renewable, fenced ownership of a key.

A lease is held by a ``holder`` (an opaque string chosen by the caller) and carries a
``token`` that rises by one every time the key passes to a *different* holder (or is
re-granted after a lapse or release). The same holder re-acquiring a live lease keeps its
token. Tokens never go backwards for a key, so they fence writes made under the lease
(``RedisLeaseService``: while the key is in use, and for at least 30 days after its last
grant or renewal; see its counter TTL).

A key can also carry **marks**: notes left for whoever holds it (``acquire_or_mark``,
``mark``). The run lease uses them to coalesce wake-ups: a caller that finds a run being
advanced leaves a mark instead of waiting or re-sending its message, and the holder takes
the marks as it hands the lease back (``release_or_take_marks``) and advances the run again
instead of releasing. Taking and releasing is one atomic step, so a mark is never left on a
free key unseen: the next grant carries it.

All expiry arithmetic is done on the service's clock (the Redis server's ``TIME`` for
``RedisLeaseService``), never on the caller's local wall clock: a worker whose clock is
an hour off can neither steal a live lease nor hold one past its TTL.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Lease:
    """A granted lease. ``expires_at_ms`` and ``granted_at_ms`` are service-clock epoch ms;
    ``marks`` are the marks left on the key before this grant, ``note`` what the holder
    that last released it left for this grant (``acquire_or_mark`` only)."""

    key: str
    holder: str
    token: int
    expires_at_ms: int
    granted_at_ms: int
    marks: tuple[str, ...] = ()
    note: bytes | None = None


class PartialRefreshError(Exception):
    """``refresh_many`` got answers for some leases only (a Redis Cluster node that did not
    answer): ``results`` as ``refresh_many`` returns them, and the positions of the leases
    whose renewal is unconfirmed (their entries in ``results`` mean nothing)."""

    def __init__(self, results: list[Lease | None], unconfirmed: set[int],
                 cause: BaseException) -> None:
        super().__init__(f"{len(unconfirmed)} of {len(results)} lease renewals "
                         f"unconfirmed: {cause}")
        self.results = results
        self.unconfirmed = unconfirmed


@dataclass(frozen=True)
class LeaseBusy:
    """``acquire_or_mark`` found another holder's live lease and left the mark on the key.

    ``remaining_ms`` is how long that lease has left. ``watch`` is set for the first mark
    left since the lease was granted (and again once ``remaining_ms`` has passed): that
    caller should make sure the key is looked at again after ``remaining_ms``, in case the
    holder dies without taking the marks."""

    remaining_ms: int
    watch: bool


class Listener(Protocol):
    """What ``LeaseService.listen`` yields."""

    def wait(self, timeout_s: float) -> bool:
        """Block until an announcement of the key arrives (``True``; each is reported
        once) or ``timeout_s`` passes (``False``)."""
        ...


@runtime_checkable
class LeaseService(Protocol):
    """What pikku needs from a lease backend. Every method is one atomic operation."""

    def acquire(self, key: str, holder: str, ttl_ms: int) -> Lease | None:
        """Grant ``key`` to ``holder`` for ``ttl_ms``, or return ``None`` if another holder's
        lease is live. A new grant gets token = previous token + 1 (1 for a new key); the
        same live holder keeps its token and gets a fresh expiry."""
        ...

    def refresh(self, lease: Lease, ttl_ms: int) -> Lease | None:
        """Extend a live lease whose holder and token still match; ``None`` otherwise."""
        ...

    def refresh_many(self, leases: Sequence[tuple[Lease, int]]) -> list[Lease | None]:
        """Refresh many ``(lease, ttl_ms)`` pairs in one round trip, results in order.
        Raises ``PartialRefreshError`` when only some of them could be asked (a Redis
        Cluster node down), with the answers of the others."""
        ...

    def release(self, lease: Lease) -> bool:
        """Free the key if holder and token still match; a stale lease frees nothing."""
        ...

    def get(self, key: str) -> Lease | None:
        """The live lease on ``key``, or ``None`` when absent or lapsed."""
        ...

    def acquire_or_mark(self, key: str, holder: str, ttl_ms: int, mark: str
                        ) -> Lease | LeaseBusy:
        """Grant as ``acquire`` does, the lease carrying (and clearing) every mark left on
        the key; or, when another holder's lease is live, add ``mark`` to the key's marks
        and return ``LeaseBusy``. One atomic step."""
        ...

    def mark(self, key: str, mark: str) -> None:
        """Add ``mark`` to the key's marks, held or not."""
        ...

    def release_or_take_marks(self, lease: Lease, ttl_ms: int, note: bytes | None = None,
                              *, announce: bool = False) -> tuple[str, ...] | None:
        """Hand the lease back: if marks were left on the key, take them and keep the lease
        (renewed for ``ttl_ms``); else release it, leaving ``note`` (bytes, or none: an
        older note is dropped) for the next grant's ``Lease.note``, and return ``()``.
        ``None`` (nothing done) when the lease is no longer this grant's. One atomic
        step. A note is a hint a holder passes to the next (``engine.handover``): it may
        be lost (it lapses after a minute), never wrong for the grant it reaches.
        ``announce``: also ``announce`` the key, in the same step (whoever's grant it is:
        the holder announces what it wrote before, not what the lease guards now)."""
        ...

    def announce(self, key: str) -> None:
        """Tell the key's listeners (``listen``) that what it guards is done (a run's end).
        Fire and forget: a listener that misses it, or listens after it, learns it by
        reading what the key guards, which every listener does once it listens."""
        ...

    def listen(self, key: str) -> AbstractContextManager[Listener]:
        """Listen for the key's announcements from when the ``with`` block begins: one
        made after that wakes ``Listener.wait``. A listener that cannot listen (Redis
        unreachable) waits out its timeouts instead; it never raises."""
        ...

    def now_ms(self) -> int:
        """The service clock, epoch milliseconds: the one clock all lease deadlines use."""
        ...
