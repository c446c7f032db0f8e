"""The lease service contract: short, renewable, fenced ownership of a key.

A lease is held by a ``holder`` (an opaque string chosen by the caller) and carries a
``token`` that rises by one every time the key passes to a *different* holder (or is
re-granted after a lapse or release). The same holder re-acquiring a live lease keeps its
token. Tokens never go backwards for a key, so they fence writes made under the lease
(``RedisLeaseService``: while the key is in use, and for at least 30 days after its last
grant or renewal; see its counter TTL).

All expiry arithmetic is done on the service's clock (the Redis server's ``TIME`` for
``RedisLeaseService``), never on the caller's local wall clock: a worker whose clock is
an hour off can neither steal a live lease nor hold one past its TTL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Lease:
    """A granted lease. ``expires_at_ms`` and ``granted_at_ms`` are service-clock epoch ms."""

    key: str
    holder: str
    token: int
    expires_at_ms: int
    granted_at_ms: int


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
        """Refresh many ``(lease, ttl_ms)`` pairs in one round trip, results in order."""
        ...

    def release(self, lease: Lease) -> bool:
        """Free the key if holder and token still match; a stale lease frees nothing."""
        ...

    def get(self, key: str) -> Lease | None:
        """The live lease on ``key``, or ``None`` when absent or lapsed."""
        ...

    def now_ms(self) -> int:
        """The service clock, epoch milliseconds: the one clock all lease deadlines use."""
        ...
