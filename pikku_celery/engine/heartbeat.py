"""One heartbeat per process renews every step lease that process holds.

A worker running 100 steps (a threads pool, say) must not make 100 renewal round trips per
interval: each tick renews every held Redis lease with one ``refresh_many`` script call and
every store lease with one ``renew_leases`` write (one per distinct lease length). Both are
fenced: Redis by holder and token, the store by attempt. A refused store renewal means the
attempt was superseded (reclaimed or cancelled): the body is told through its ``lost``
event, and its later writes will be refused anyway. A renewal that *fails* (store or Redis
unreachable) is not proof of loss: the lease counts as held until its last confirmed
deadline passes, then as lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pikku_celery.leases.base import Lease, LeaseService, PartialRefreshError
from pikku_celery.model._fork import reset_in_forked_child
from pikku_celery.model.clock import Clock
from pikku_celery.store._concerns import deadline
from pikku_celery.store.base import WorkflowStore

log = logging.getLogger("pikku_celery.heartbeat")


@dataclass(eq=False)
class HeldStep:
    """A step attempt this process is running, and what keeps it alive."""

    run_id: str
    step_name: str
    attempt: int
    lease_ms: int
    lease: Lease
    held_until: float  # local monotonic deadline of the last confirmed renewal
    lost: threading.Event = field(default_factory=threading.Event)
    lost_reason: str | None = None
    settling: bool = False  # its outcome is being written: a refused renewal is expected
    # Its body runs in a MongoDB transaction whose last write is the settle: a renewal of
    # its store lease meanwhile would be a write conflict with it, so none is made (its
    # deadline is not extended either: the body has one lease to commit in).
    in_transaction: bool = False

    def mark_lost(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()


def _interval_of(lease_ms: int) -> float:
    """Seconds between beats for a lease of ``lease_ms``: a third of it (two renewals may
    fail before it lapses), at least 50 ms."""
    return max(0.05, lease_ms / 3000)


class Heartbeat:
    """Renews the held steps of this process; started lazily, restarted after a fork."""

    def __init__(self, store: WorkflowStore, leases: LeaseService, clock: Clock, *,
                 on_lost: Callable[[HeldStep], None] | None = None) -> None:
        self._store = store
        self._leases = leases
        self._clock = clock
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], HeldStep] = {}
        self._wake = threading.Event()
        self._next_beat = 0.0  # when the loop will beat next (monotonic), set by the loop
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._stopped = False
        reset_in_forked_child(self)

    def _after_fork_in_child(self) -> None:
        # A forked child starts with none of the parent's steps: their bodies run in the
        # parent, whose own heartbeat renews them (renewing them here too would keep a dead
        # parent's leases alive). Its locks may have been copied held
        # (``pikku_celery.model._fork``).
        self._lock = threading.Lock()
        self._held = {}
        self._wake = threading.Event()
        self._next_beat = 0.0
        self._thread = None

    def add(self, held: HeldStep) -> None:
        with self._lock:
            self._held[(held.run_id, held.step_name)] = held
            self._ensure_thread()
            # Wake the loop only when this lease needs a beat before the one planned: a
            # wake per step (the loop taking the GIL to find nothing to do), with the
            # pass-lease thread's wake per pass, cost about a fifth of pikku's own CPU per
            # step run in place.
            sooner = time.monotonic() + _interval_of(held.lease_ms) < self._next_beat
        if sooner:
            self._wake.set()

    def remove(self, held: HeldStep) -> None:
        with self._lock:
            if self._held.get((held.run_id, held.step_name)) is held:
                del self._held[(held.run_id, held.step_name)]

    def stop(self) -> None:
        """End the thread once it holds nothing (an engine thrown away, as the test kit's
        engines are after each test); a later ``add`` starts it again."""
        self._stopped = True
        self._wake.set()

    def held(self) -> list[HeldStep]:
        with self._lock:
            return list(self._held.values())

    def _ensure_thread(self) -> None:
        # A forked pool child inherits the registry but not the thread: start its own.
        self._stopped = False
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="pikku-heartbeat",
                                            daemon=True)
            self._thread.start()

    def _plan(self, now: float, planned: float | None = None) -> float:
        """The next beat: an interval of the shortest lease held from ``now`` (1 s when
        none is), or ``planned`` if sooner. Decided under the lock ``add`` takes, so a step
        added meanwhile is either counted here or compared with the plan (and wakes the
        loop if it needs a sooner beat)."""
        with self._lock:
            held = self._held.values()
            interval = _interval_of(min(h.lease_ms for h in held)) if held else 1.0
            next_beat = now + interval if planned is None else min(planned, now + interval)
            self._next_beat = next_beat
        return next_beat

    def _run(self) -> None:
        next_beat = self._plan(time.monotonic())
        while True:
            # An added step wakes the loop only to pull the next beat earlier when its lease
            # is shorter than the others; it never triggers a beat by itself.
            woken = self._wake.wait(max(0.0, next_beat - time.monotonic()))
            self._wake.clear()
            with self._lock:  # decided under the lock ``add`` takes: no step is left alone
                if self._stopped and not self._held:
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
            now = time.monotonic()
            if woken:
                next_beat = self._plan(now, next_beat)
                continue
            if now < next_beat:
                continue
            next_beat = self._plan(now)
            held = self.held()
            if held:
                try:
                    self.beat(held)
                except Exception:  # never let the heartbeat die
                    log.exception("pikku heartbeat tick failed")

    def beat(self, held: list[HeldStep]) -> None:
        """Renew ``held`` now: one Redis call and one store write per lease length."""
        sent = time.monotonic()
        answered, vanished = self._renew_redis(held)
        now_ms = self._clock.now_ms()
        confirmed: set[int] = set()  # ids of steps whose store renewal was accepted
        by_lease: dict[int, list[HeldStep]] = {}
        for h in held:
            # A step given up just now (its Redis renewal failed past its last confirmed
            # deadline) must not have its store lease extended: that would only delay the
            # reclaim of a step this process no longer runs by up to one lease.
            if not h.lost.is_set() and not h.in_transaction:
                by_lease.setdefault(h.lease_ms, []).append(h)
        for lease_ms, group in by_lease.items():
            try:
                # Bounded by one interval: a stuck call (a stalled primary, a set waiting
                # for its majority) must not hold the next renewal back past the lease.
                with deadline(lease_ms / 3000):
                    refused = self._store.renew_leases(
                        [(h.run_id, h.step_name, h.attempt) for h in group], now_ms,
                        lease_ms)
            except Exception as exc:
                log.warning("pikku heartbeat: store renewal failed (%s); leases kept until "
                            "their last confirmed deadline", exc)
                self._expire_unconfirmed(group)
                continue
            for h in group:
                if (h.run_id, h.step_name) in refused:
                    if not h.settling:
                        self._lose(h, "the store refused the renewal: the attempt was "
                                      "superseded")
                    continue
                confirmed.add(id(h))
                if id(h) in answered:  # Redis renewed it too
                    h.held_until = sent + lease_ms / 1000
        for h in vanished:
            # Only an attempt the store has just confirmed takes its Redis lease back: a
            # superseded one (paused past its lease) must not hold it, even for a beat, or
            # the retry delivery that needs it would find it taken and be dropped.
            if id(h) in confirmed and not h.settling and not h.lost.is_set():
                self._reacquire(h)

    def _renew_redis(self, held: list[HeldStep]) -> tuple[set[int], list[HeldStep]]:
        """The ids of the steps whose Redis renewal was answered, and the steps whose Redis
        lease had vanished."""
        sent = time.monotonic()
        unconfirmed: set[int] = set()
        try:
            renewed = self._leases.refresh_many([(h.lease, h.lease_ms) for h in held])
        except PartialRefreshError as partial:  # one cluster node: only its steps wait
            log.warning("pikku heartbeat: lease renewal failed in part (%s)", partial)
            renewed, unconfirmed = partial.results, partial.unconfirmed
            self._expire_unconfirmed([held[i] for i in sorted(unconfirmed)])
        except Exception as exc:
            log.warning("pikku heartbeat: lease renewal failed (%s)", exc)
            self._expire_unconfirmed(held)
            return set(), []
        vanished: list[HeldStep] = []
        answered: set[int] = set()
        for i, (h, lease) in enumerate(zip(held, renewed, strict=True)):
            if i in unconfirmed:
                continue
            answered.add(id(h))
            if lease is not None:
                h.lease = lease
                self._clock.observe(lease.granted_at_ms, sent)
            elif not h.settling:  # a settle may just have released it: never re-grab that
                vanished.append(h)
        return answered, vanished

    def _reacquire(self, h: HeldStep) -> None:
        # The Redis lease vanished (Redis restarted, or it lapsed while we were paused) and
        # the store still says this attempt owns the step: take the Redis lease back if it
        # is free. A failure is left to the next beat, never the end of this one.
        try:
            lease = self._leases.acquire(h.lease.key, h.lease.holder, h.lease_ms)
        except Exception as exc:
            log.warning("pikku heartbeat: could not take back the Redis lease of step %r "
                        "of run %s (%s)", h.step_name, h.run_id, exc)
            return
        if lease is not None:
            h.lease = lease

    def _expire_unconfirmed(self, held: list[HeldStep]) -> None:
        now = time.monotonic()
        for h in held:
            if now >= h.held_until:
                self._lose(h, "renewals failed past the lease's last confirmed deadline")

    def _lose(self, h: HeldStep, reason: str) -> None:
        log.warning("pikku: step %r of run %s attempt %d lost its lease: %s", h.step_name,
                    h.run_id, h.attempt, reason)
        h.mark_lost(reason)
        self.remove(h)
        with contextlib.suppress(Exception):  # fenced by token: frees only our own lease
            self._leases.release(h.lease)
        if self._on_lost is not None:
            self._on_lost(h)
