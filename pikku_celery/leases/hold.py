"""``hold_lease``: hold a lease for the length of a ``with`` block, renewing it meanwhile.

The block is never interrupted: a lost lease is *reported* (``HeldLease.lost`` is set,
``on_lost`` is called, ``check()`` raises) so long work can stop early, and leaving the
block raises ``LeaseLostError`` so work done without the lease is never taken as done under
it. Renewal runs on a daemon thread every ``ttl / 3``.

How loss is decided (all on the local *monotonic* clock, which no wall-clock skew moves):

* a renewal that returns a lease pushes ``held_until`` to ``(time before the call) + ttl``:
  the server cannot have started the new TTL before we sent the request, so this is a
  safe lower bound on the lease's real expiry;
* a renewal that returns ``None`` is proof of loss;
* a renewal that raises (Redis unreachable) is no proof either way: the lease is kept
  until ``held_until`` passes, then counted lost.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pikku_celery.leases.base import Lease, LeaseService
from pikku_celery.model._fork import reset_in_forked_child
from pikku_celery.model.durations import Duration, to_ms
from pikku_celery.model.errors import LeaseLostError, LeaseTakenError

logger = logging.getLogger(__name__)

RENEWALS_PER_TTL = 3
MIN_RENEW_INTERVAL_S = 0.001


class HeldLease:
    """The handle ``hold_lease`` yields: the latest lease and whether it was lost."""

    def __init__(
        self,
        service: LeaseService,
        lease: Lease,
        ttl_ms: int,
        held_until: float,
        on_lost: Callable[[], object] | None = None,
    ) -> None:
        self.lost = threading.Event()
        self._service = service
        self._lease = lease
        self._ttl_ms = ttl_ms
        self._held_until = held_until  # time.monotonic() seconds
        self._on_lost = on_lost
        self._state_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        """The logical key held."""
        return self._lease.key

    @property
    def lease(self) -> Lease:
        """The latest lease returned by the service (same token, newest expiry)."""
        with self._state_lock:
            return self._lease

    @property
    def is_lost(self) -> bool:
        """Whether the lease is known lost, or unconfirmed past its local deadline."""
        if not self._stopping.is_set() and self._past_deadline():
            self._mark_lost()  # the renewal thread may be stuck in a slow call
        return self.lost.is_set()

    def check(self) -> None:
        """Raise ``LeaseLostError`` if the lease is lost; call between units of long work."""
        if self.is_lost:
            raise LeaseLostError(self.key)

    def _deadline(self) -> float:
        with self._state_lock:
            return self._held_until

    def _past_deadline(self) -> bool:
        return not self.lost.is_set() and time.monotonic() >= self._deadline()

    def _start(self) -> None:
        self._thread = threading.Thread(
            target=self._renew_loop, name=f"pikku-lease:{self.key}", daemon=True
        )
        self._thread.start()

    def _stop(self) -> None:
        # Joining guarantees no renewal is in flight once we release or final-check.
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def _renew_loop(self) -> None:
        interval_s = max(MIN_RENEW_INTERVAL_S, self._ttl_ms / 1000 / RENEWALS_PER_TTL)
        wait_s = interval_s
        while not self._stopping.wait(wait_s) and not self.lost.is_set():
            if self._renew():
                wait_s = interval_s
                continue
            remaining_s = self._deadline() - time.monotonic()
            if remaining_s <= 0:
                self._mark_lost()
                return
            wait_s = min(interval_s, remaining_s)  # retry, and notice the deadline on time

    def _renew(self) -> bool:
        """One renewal; ``True`` when confirmed, ``False`` when unconfirmed (call raised).

        A refused renewal marks the lease lost and also returns ``False``.
        """
        started = time.monotonic()
        try:
            renewed = self._service.refresh(self.lease, self._ttl_ms)
        except Exception:
            logger.warning(
                "renewing lease %r failed; kept until its deadline", self.key, exc_info=True
            )
            return False
        if renewed is None:
            self._mark_lost()
            return False
        with self._state_lock:
            if not self.lost.is_set():
                self._lease = renewed
                self._held_until = started + self._ttl_ms / 1000
        return True

    def _final_check(self) -> None:
        """Confirm the lease once more after the block: the last renewal can be a third of
        a TTL old. Called after ``_stop``, so it never races the renewal thread."""
        if self.lost.is_set() or self._past_deadline():
            self._mark_lost()
            raise LeaseLostError(self.key)
        try:
            renewed = self._service.refresh(self.lease, self._ttl_ms)
        except Exception as exc:
            self._mark_lost()
            raise LeaseLostError(self.key) from exc
        if renewed is None:
            self._mark_lost()
            raise LeaseLostError(self.key)
        with self._state_lock:
            self._lease = renewed

    def _mark_lost(self) -> None:
        with self._state_lock:
            if self.lost.is_set():
                return
            self.lost.set()
        logger.warning("lease %r was lost", self.key)
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                logger.exception("on_lost callback for lease %r raised", self.key)


@contextmanager
def hold_lease(
    service: LeaseService,
    key: str,
    ttl: Duration,
    *,
    holder: str | None = None,
    on_lost: Callable[[], object] | None = None,
) -> Iterator[HeldLease]:
    """Hold ``key`` for the ``with`` block, renewing every ``ttl / 3``.

    Args:
        ttl: anything ``pikku_celery.model.durations.to_ms`` accepts; must be at least 1 ms.
        holder: the holder id; a fresh uuid4 hex by default.
        on_lost: called once, from the renewal thread or the thread that noticed, when the
            lease is lost.

    Raises:
        LeaseTakenError: another holder has a live lease (raised at once, never waits).
        LeaseLostError: on leaving a block that completed, if the lease was lost at any
            point or the final renewal is refused or fails. If the block raised, its own
            exception propagates instead.
        ValueError: a bad ``ttl``, ``key`` or ``holder``.

    The lease is released on every exit; release errors are ignored (it lapses anyway).
    """
    ttl_ms = to_ms(ttl, what="lease ttl")
    if ttl_ms <= 0:
        raise ValueError(f"invalid lease ttl: {ttl!r} (must be at least 1 ms)")
    started = time.monotonic()
    lease = service.acquire(key, holder or uuid.uuid4().hex, ttl_ms)
    if lease is None:
        raise LeaseTakenError(key)
    held = HeldLease(service, lease, ttl_ms, started + ttl_ms / 1000, on_lost)
    held._start()
    completed = False
    try:
        yield held
        completed = True
    finally:
        held._stop()
        try:
            if completed:
                held._final_check()
        finally:
            _release_quietly(service, held.lease)


class _Renewals:
    """The one thread of a process that renews its pass leases.

    A pass is usually over in milliseconds, long before its lease needs a renewal (at a
    third of its TTL), so starting a renewal thread per pass would cost more than the pass's
    own lease calls. Passes register here instead; the thread wakes only when a renewal is
    due. ``remove`` waits out a renewal in flight, as joining a thread would."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, HeldPassLease] = {}
        self._wake = threading.Event()
        self._planned = 0.0  # when the thread wakes next (monotonic), set by the thread
        self._thread: threading.Thread | None = None
        reset_in_forked_child(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._held = {}
        self._wake = threading.Event()
        self._planned = 0.0
        self._thread = None

    def add(self, held: HeldPassLease) -> None:
        with self._lock:
            self._held[id(held)] = held
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="pikku-pass-leases",
                                                daemon=True)
                self._thread.start()
            # Woken only when this renewal is due before the thread's planned wake-up (a
            # wake per pass, the thread taking the GIL to find nothing due, and the
            # heartbeat's per step cost about a fifth of pikku's own CPU per step run in
            # place).
            sooner = held.next_renewal < self._planned
        if sooner:
            self._wake.set()

    def remove(self, held: HeldPassLease) -> None:
        self.remove_quietly(held)
        with held.renewing:  # a renewal in flight ends before the caller goes on
            pass

    def remove_quietly(self, held: HeldPassLease) -> None:
        with self._lock:
            self._held.pop(id(held), None)

    def _run(self) -> None:
        while True:
            with self._lock:
                held = list(self._held.values())
            now = time.monotonic()
            due = [h for h in held if h.next_renewal <= now]
            for h in due:
                h.renew_once()
            with self._lock:  # planned under the lock ``add`` compares with
                later = [h.next_renewal for h in self._held.values()]
                now = time.monotonic()
                wait_s = max(MIN_RENEW_INTERVAL_S, min(later) - now) if later else 1.0
                self._planned = now + wait_s
            self._wake.wait(wait_s)
            self._wake.clear()


_RENEWALS = _Renewals()


class HeldPassLease(HeldLease):
    """A lease held across a loop of passes (``hold_granted``): handing it back either
    releases it or, when marks were left on it meanwhile, takes them and keeps it, so the
    holder runs again instead of someone else's message bouncing off the held key. Renewed
    by the process's one pass-lease thread (``_Renewals``), not a thread of its own."""

    released = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.renewing = threading.Lock()
        self._interval_s = max(MIN_RENEW_INTERVAL_S, self._ttl_ms / 1000 / RENEWALS_PER_TTL)
        self.next_renewal = time.monotonic() + self._interval_s

    def _start(self) -> None:
        self.next_renewal = time.monotonic() + self._interval_s
        _RENEWALS.add(self)

    def _stop(self) -> None:
        _RENEWALS.remove(self)

    def renew_once(self) -> None:
        """One turn of the renewal loop ``HeldLease`` runs in a thread of its own."""
        with self.renewing:
            if self.lost.is_set():
                _RENEWALS.remove_quietly(self)
                return
            if self._renew():
                self.next_renewal = time.monotonic() + self._interval_s
                return
            remaining_s = self._deadline() - time.monotonic()
            if remaining_s <= 0:
                self._mark_lost()
                _RENEWALS.remove_quietly(self)
                return
            self.next_renewal = time.monotonic() + min(self._interval_s, remaining_s)

    def hand_back(self, note: bytes | None = None, *, announce: bool = False
                  ) -> tuple[str, ...]:
        """Release the lease, leaving ``note`` for the next grant, and return ``()``; or
        take the marks left on it and keep it (renewing on); ``LeaseLostError`` if the
        lease was lost at any point, or the call fails or is refused (it was no longer
        ours: nothing was taken or freed). ``announce``: announce the key in the same
        call (``LeaseService.release_or_take_marks``)."""
        self._stop()
        if self.lost.is_set() or self._past_deadline():
            self._mark_lost()
            raise LeaseLostError(self.key)
        sent = time.monotonic()
        try:
            taken = self._service.release_or_take_marks(self.lease, self._ttl_ms, note,
                                                        announce=announce)
        except Exception as exc:
            self._mark_lost()
            raise LeaseLostError(self.key) from exc
        if taken is None:
            self._mark_lost()
            raise LeaseLostError(self.key)
        if not taken:
            self.released = True
            return ()
        with self._state_lock:
            self._held_until = sent + self._ttl_ms / 1000
        self._start()
        return taken


@contextmanager
def hold_granted(service: LeaseService, lease: Lease, ttl_ms: int,
                 requested_at: float) -> Iterator[HeldPassLease]:
    """Hold ``lease`` (granted by ``acquire_or_mark`` to a call sent at monotonic
    ``requested_at``) for the ``with`` block, renewing every ``ttl / 3``; hand it back with
    ``HeldPassLease.hand_back``. Whatever the block leaves unreleased (it raised) is
    released quietly on exit: a lease no longer ours frees nothing."""
    held = HeldPassLease(service, lease, ttl_ms, requested_at + ttl_ms / 1000)
    held._start()
    try:
        yield held
    finally:
        held._stop()
        if not held.released:
            _release_quietly(service, held.lease)


def _release_quietly(service: LeaseService, lease: Lease) -> None:
    try:
        service.release(lease)
    except Exception:
        logger.warning("releasing lease %r failed; it will lapse", lease.key, exc_info=True)
