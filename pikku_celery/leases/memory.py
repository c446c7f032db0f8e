"""Single-process leases: the reference implementation of the lease contract.

Schema (all guarded by one ``threading.Lock``, so every method is one atomic step):

* ``_leases[key]``  -> the last lease granted on ``key`` (holder, token, expiry); an entry
  whose ``expires_at_ms`` is not after ``now`` is lapsed and treated as absent.
* ``_tokens[key]``  -> the last token handed out for ``key``. Never deleted, so tokens keep
  rising across lapses and releases, like the Redis token counter (which expires only after
  a month without any grant or renewal of its key: a process does not live that idle).
* ``_marks[key]``   -> the marks left on ``key`` and not yet taken.
* ``_watch[key]``   -> until when (service ms) a watch is armed for ``key``'s holder.

Time comes from the injected ``clock_ms`` (default: wall-clock epoch ms), so tests can make
a lease lapse without sleeping. Full semantics, not a mock: ``RedisLeaseService`` must
behave the same way and the contract suite runs on both.

The argument checks at the bottom are shared with ``RedisLeaseService``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from pikku_celery.leases.announcements import LocalAnnouncements
from pikku_celery.leases.base import Lease, LeaseBusy, Listener
from pikku_celery.model.keys import LEASE_NOTE_TTL_MS


def wall_clock_ms() -> int:
    """The process wall clock in epoch milliseconds."""
    return time.time_ns() // 1_000_000


class InMemoryLeaseService:
    """Leases held in this process only; share one instance between threads to contend."""

    def __init__(self, clock_ms: Callable[[], int] | None = None) -> None:
        self._clock_ms = clock_ms or wall_clock_ms
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._tokens: dict[str, int] = {}
        self._marks: dict[str, set[str]] = {}
        self._watch: dict[str, int] = {}
        self._notes: dict[str, tuple[int, bytes]] = {}  # key -> (lapses at ms, note)
        self._announcements = LocalAnnouncements()

    def acquire(self, key: str, holder: str, ttl_ms: int) -> Lease | None:
        """Grant ``key`` to ``holder`` for ``ttl_ms`` ms; ``None`` if another holder is live.

        A fresh grant gets the key's next token; the live holder re-acquiring keeps its token.
        Raises ``ValueError`` for an empty key or holder or a non-positive ``ttl_ms``.
        """
        check_key(key)
        check_holder(holder)
        check_ttl_ms(ttl_ms)
        with self._lock:
            now = self._clock_ms()
            current = self._live(key, now)
            if current is not None and current.holder != holder:
                return None
            token = current.token if current is not None else self._next_token(key)
            lease = Lease(key, holder, token, now + ttl_ms, now)
            self._leases[key] = lease
            return lease

    def refresh(self, lease: Lease, ttl_ms: int) -> Lease | None:
        """Extend ``lease`` to ``now + ttl_ms`` if it is live and still ours; else ``None``."""
        return self.refresh_many([(lease, ttl_ms)])[0]

    def refresh_many(self, leases: Sequence[tuple[Lease, int]]) -> list[Lease | None]:
        """Refresh each ``(lease, ttl_ms)`` pair atomically as a batch; results in order."""
        for _, ttl_ms in leases:
            check_ttl_ms(ttl_ms)
        with self._lock:
            now = self._clock_ms()
            return [self._refresh_locked(lease, ttl_ms, now) for lease, ttl_ms in leases]

    def release(self, lease: Lease) -> bool:
        """Free the key if ``lease`` is live and its holder and token still match.

        Returns whether anything was freed; a stale lease never frees its successor.
        """
        with self._lock:
            current = self._live(lease.key, self._clock_ms())
            if current is None or not _same_grant(current, lease):
                return False
            del self._leases[lease.key]
            return True

    def get(self, key: str) -> Lease | None:
        """The live lease on ``key`` or ``None``; ``granted_at_ms`` is the read time."""
        check_key(key)
        with self._lock:
            now = self._clock_ms()
            current = self._live(key, now)
            if current is None:
                return None
            return Lease(key, current.holder, current.token, current.expires_at_ms, now)

    def acquire_or_mark(self, key: str, holder: str, ttl_ms: int, mark: str
                        ) -> Lease | LeaseBusy:
        """``acquire``, the grant carrying the marks left on ``key``; or leave ``mark`` on
        it when another holder's lease is live (see ``LeaseService.acquire_or_mark``)."""
        check_key(key)
        check_holder(holder)
        check_ttl_ms(ttl_ms)
        check_mark(mark)
        with self._lock:
            now = self._clock_ms()
            current = self._live(key, now)
            if current is not None and current.holder != holder:
                self._marks.setdefault(key, set()).add(mark)
                remaining = current.expires_at_ms - now
                watch = self._watch.get(key, now) <= now
                if watch:
                    self._watch[key] = now + remaining + WATCH_SLACK_MS
                return LeaseBusy(remaining, watch)
            token = current.token if current is not None else self._next_token(key)
            marks = tuple(sorted(self._marks.pop(key, ())))
            self._watch.pop(key, None)
            note = self._notes.pop(key, None)
            lease = Lease(key, holder, token, now + ttl_ms, now, marks,
                          note[1] if note is not None and note[0] > now else None)
            self._leases[key] = Lease(key, holder, token, now + ttl_ms, now)
            return lease

    def mark(self, key: str, mark: str) -> None:
        """Leave ``mark`` on ``key`` for its holder, or for the next grant."""
        check_key(key)
        check_mark(mark)
        with self._lock:
            self._marks.setdefault(key, set()).add(mark)

    def release_or_take_marks(self, lease: Lease, ttl_ms: int, note: bytes | None = None,
                              *, announce: bool = False) -> tuple[str, ...] | None:
        """Take the marks left on the key and keep the lease, or release it when there are
        none (leaving ``note`` for the next grant); ``None`` when ``lease`` is no longer
        this grant's. ``announce``: ``announce`` the key too."""
        check_ttl_ms(ttl_ms)
        if announce:
            self.announce(lease.key)
        with self._lock:
            now = self._clock_ms()
            current = self._live(lease.key, now)
            if current is None or not _same_grant(current, lease):
                return None
            marks = self._marks.pop(lease.key, None)
            if marks:
                self._leases[lease.key] = Lease(lease.key, lease.holder, lease.token,
                                                now + ttl_ms, now)
                return tuple(sorted(marks))
            del self._leases[lease.key]
            if note:
                self._notes[lease.key] = (now + LEASE_NOTE_TTL_MS, note)
            else:
                self._notes.pop(lease.key, None)
            return ()

    def announce(self, key: str) -> None:
        """Wake the key's listeners (``listen``)."""
        check_key(key)
        self._announcements.announce(key)

    def listen(self, key: str) -> AbstractContextManager[Listener]:
        """Listen for the key's announcements (``LeaseService.listen``)."""
        check_key(key)
        return self._announcements.listen(key)

    def now_ms(self) -> int:
        """The injected clock: the one clock every deadline of this service uses."""
        return self._clock_ms()

    def _live(self, key: str, now: int) -> Lease | None:
        lease = self._leases.get(key)
        if lease is None or lease.expires_at_ms > now:
            return lease
        del self._leases[key]  # lapsed: forget it, the token counter remembers
        return None

    def _next_token(self, key: str) -> int:
        token = self._tokens.get(key, 0) + 1
        self._tokens[key] = token
        return token

    def _refresh_locked(self, lease: Lease, ttl_ms: int, now: int) -> Lease | None:
        current = self._live(lease.key, now)
        if current is None or not _same_grant(current, lease):
            return None
        renewed = Lease(lease.key, lease.holder, lease.token, now + ttl_ms, now)
        self._leases[lease.key] = renewed
        return renewed


def _same_grant(current: Lease, lease: Lease) -> bool:
    # Holder alone is not enough: after a lapse the same holder may have been granted
    # the key again under a newer token, and the old handle must not act for it.
    return current.holder == lease.holder and current.token == lease.token


# pikku's longest key is a step lease: ``workflow-step:`` + a run id (at most 200
# characters) + ``:`` + a 36-character invocation id. Anything far longer is refused before
# it becomes a Redis key (a forged 500 KB name would otherwise leave a 500 KB counter).
MAX_KEY_LEN = 512
MAX_HOLDER_LEN = 512
MAX_MARK_LEN = 512
# A watch fires this long after the holder's lease would lapse: time for the lapse to show.
WATCH_SLACK_MS = 1_000


def check_key(key: object) -> None:
    """Refuse anything but a non-empty ``str`` of at most ``MAX_KEY_LEN`` characters."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN:
        raise ValueError(f"invalid lease key: {_shown(key)} (must be a non-empty str of at "
                         f"most {MAX_KEY_LEN} characters)")


def check_holder(holder: object) -> None:
    """Refuse anything but a non-empty ``str`` of at most ``MAX_HOLDER_LEN`` characters."""
    if not isinstance(holder, str) or not holder or len(holder) > MAX_HOLDER_LEN:
        raise ValueError(f"invalid lease holder: {_shown(holder)} (must be a non-empty str "
                         f"of at most {MAX_HOLDER_LEN} characters)")


def check_mark(mark: object) -> None:
    """Refuse anything but a non-empty ``str`` of at most ``MAX_MARK_LEN`` characters."""
    if not isinstance(mark, str) or not mark or len(mark) > MAX_MARK_LEN:
        raise ValueError(f"invalid lease mark: {_shown(mark)} (must be a non-empty str of at "
                         f"most {MAX_MARK_LEN} characters)")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def check_ttl_ms(ttl_ms: object) -> None:
    """Refuse anything but a positive ``int`` number of milliseconds (bools included)."""
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms <= 0:
        raise ValueError(f"invalid lease ttl_ms: {ttl_ms!r} (must be a positive int)")
