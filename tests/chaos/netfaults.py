"""Partition faults of issue 37, for a chaos run whose processes each run in a network
namespace of their own (``run.py --netns``; ``Cluster.rig``, tests/support/netrig.py).

Each fault installs ``iptables`` rules in the namespaces, holds them for a while on a
thread of its own, then removes every rule (``rig.heal_all``) and records the heal as the
event's ``end_t``: the checker times the next settled step from there. One partition fault
at a time; ``partition_primary`` and ``drop_replies`` also wait for the replica set to be
whole (no MongoDB fault healing), and ``partition_primary`` holds the MongoDB faults back
until the set is whole again after its heal.

* ``partition_primary``: the primary cut off from both secondaries; one worker sees only
  it (cut off from the secondaries), the others only the majority (cut off from it);
* ``isolate_worker_redis``: a worker (mid-step, preferably) cut off from Redis (its leases
  and, on the Redis broker, its broker);
* ``isolate_worker_mongo``: a worker cut off from every ``mongod``;
* ``drop_replies``: the primary's packets to a worker dropped, its requests delivered;
* ``isolate_redis``: Redis cut off from every worker for longer than the step lease;
* ``netem``: 200 ms delay (one way) and 5 % random loss on every link when the rig runs on
  the userspace delay switch (``PIKKU_NETRIG_LINKS=switch``: the kernels here have no
  ``netem``), else 5 % loss only (``iptables``, the bridge cannot delay);
* ``skew_clock``: ``isolate_worker_redis`` on a worker whose whole process runs 30 s ahead
  or behind under libfaketime.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tests.support import netrig

if TYPE_CHECKING:
    from tests.chaos.cluster import Cluster, Worker
    from tests.chaos.faults import FaultEvent

NET_KINDS = {  # kind -> weight, added to faults.KINDS in --netns runs (and required, in
    # this order, after faults.REQUIRED)
    "skew_clock": 1,
    "partition_primary": 1,
    "isolate_worker_redis": 2,
    "isolate_worker_mongo": 2,
    "drop_replies": 2,
    "isolate_redis": 1,
    "netem": 1,
}
NET_FAULTS = tuple(NET_KINDS)
PRIMARY_NET_FAULTS = ("partition_primary", "drop_replies")  # need a whole set
PARTITION_S = (6.0, 9.0)  # past the 2 s election timeout and the election
DROP_REPLIES_S = (1.0, 4.0)
NETEM_S = (4.0, 8.0)
LOSS = 0.05
NETEM_DELAY_MS = 200.0
FAKETIMES = ("+30s", "-30s")


class NetFaults:
    """The partition fault kinds, mixed into ``FaultInjector`` (which provides the
    attributes declared here)."""

    cluster: Cluster
    rng: random.Random
    lease_s: float
    _why: str
    _mongo_busy: threading.Event
    _net_busy: threading.Event
    not_applied: list[str]

    if TYPE_CHECKING:  # FaultInjector's
        def _victim(self) -> Worker | None: ...

        def _set_ready(self) -> bool: ...

        def _heal(self, event: FaultEvent, old: Any, after_primary: Any = None) -> None: ...

    # --- helpers ---------------------------------------------------------------------------

    @property
    def _rig(self) -> netrig.NetRig:
        assert self.cluster.rig is not None, "a partition fault needs run.py --netns"
        return self.cluster.rig

    def _net_ready(self) -> bool:
        if self._net_busy.is_set():
            self._why = "the last partition fault is still held"
            return False
        return True

    def _hold(self, event: FaultEvent, seconds: float,
              after: Callable[[], None] | None = None) -> None:
        """Keep the rules ``seconds`` from the event, then remove them all; ``end_t`` is the
        heal."""
        self._net_busy.set()

        def heal() -> None:
            try:
                time.sleep(max(0.0, event.t + seconds - time.monotonic()))
            finally:
                try:
                    self._rig.heal_all()
                    event.end_t = time.monotonic()
                except Exception as exc:  # reported, never swallowed
                    self.not_applied.append(f"{event.kind}: the heal failed: {exc!r}")
                finally:
                    self._net_busy.clear()
                if after is not None:
                    after()

        threading.Thread(target=heal, name=f"chaos-heal-{event.kind}", daemon=True).start()

    def _net_event(self, kind: str, detail: str, cut: Worker | None = None) -> FaultEvent:
        """``cut``: the one worker the fault cuts off (its processes are the event's
        ``pids``); none when it cuts every worker off from something."""
        from tests.chaos.faults import FaultEvent
        return FaultEvent(kind, time.monotonic(), cut.group_pids() if cut else set(),
                          detail=detail)

    def _lease_multiple(self) -> float:
        return self.lease_s * self.rng.uniform(1.5, 3.0)  # past the step lease

    # --- the kinds -------------------------------------------------------------------------

    def _isolate_worker_redis(self, run_ids: list[str]) -> FaultEvent | None:
        worker = self._victim() if self._net_ready() else None
        return None if worker is None else self._cut_from_redis(worker, "isolate_worker_redis")

    def _skew_clock(self, run_ids: list[str]) -> FaultEvent | None:
        if not self._net_ready():
            return None
        skewed = [w for w in self.cluster.live_workers() if w.faketime]
        if not skewed:
            self._why = "no live worker runs under libfaketime"
            return None
        return self._cut_from_redis(self.rng.choice(skewed), "skew_clock")

    def _cut_from_redis(self, worker: Worker, kind: str) -> FaultEvent:
        seconds = self._lease_multiple()
        self._rig.cut(worker.role, "redis", port=self.cluster.redis_port)
        event = self._net_event(kind, f"{worker.name} cut from Redis for {seconds:.1f}s",
                                worker)
        self._hold(event, seconds)
        return event

    def _isolate_worker_mongo(self, run_ids: list[str]) -> FaultEvent | None:
        worker = self._victim() if self._net_ready() else None
        if worker is None:
            return None
        seconds = self._lease_multiple()
        for node in self.cluster.replset.nodes:
            self._rig.cut(worker.role, node.role)  # type: ignore[attr-defined]
        event = self._net_event("isolate_worker_mongo",
                                f"{worker.name} cut from every mongod for {seconds:.1f}s",
                                worker)
        self._hold(event, seconds)
        return event

    def _drop_replies(self, run_ids: list[str]) -> FaultEvent | None:
        if not (self._net_ready() and self._set_ready()):
            return None
        worker = self._victim()
        if worker is None:
            return None
        primary = self.cluster.primary()
        seconds = self.rng.uniform(*DROP_REPLIES_S)
        self._rig.drop_replies(worker.role, primary.role,  # type: ignore[attr-defined]
                               port=primary.port)
        event = self._net_event("drop_replies", f"replies of port {primary.port} to "
                                f"{worker.name} dropped for {seconds:.1f}s", worker)
        self._hold(event, seconds)
        return event

    def _isolate_redis(self, run_ids: list[str]) -> FaultEvent | None:
        if not self._net_ready():
            return None
        seconds = self._lease_multiple()
        for worker in self.cluster.live_workers():
            self._rig.cut("redis", worker.role)
        event = self._net_event("isolate_redis",
                                f"Redis cut from every worker for {seconds:.1f}s")
        self._hold(event, seconds)
        return event

    def _netem(self, run_ids: list[str]) -> FaultEvent | None:
        if not self._net_ready():
            return None
        seconds = self.rng.uniform(*NETEM_S)
        rig = self._rig
        if rig.can_delay:  # the switch delays and drops; ``heal_all`` undoes it
            rig.impair(delay_ms=NETEM_DELAY_MS, loss=LOSS)
            detail = (f"{NETEM_DELAY_MS:.0f} ms delay and {LOSS:.0%} loss on every link "
                      f"for {seconds:.1f}s (the delay switch)")
        else:
            for role in list(rig.nodes):
                rig.loss(role, LOSS)
            detail = (f"{LOSS:.0%} loss on every link for {seconds:.1f}s (no delay: no "
                      "netem in this kernel, the rig on the bridge)")
        event = self._net_event("netem", detail)
        self._hold(event, seconds)
        return event

    def _partition_primary(self, run_ids: list[str]) -> FaultEvent | None:
        if not (self._net_ready() and self._set_ready()):
            return None
        old = self.cluster.primary()
        others = [n for n in self.cluster.replset.nodes if n is not old]
        workers = self.cluster.live_workers()
        if len(workers) < 2:
            self._why = "fewer than two live workers"
            return None
        minority = self._victim() or workers[0]
        for node in others:
            self._rig.cut(old.role, node.role)  # type: ignore[attr-defined]
            self._rig.cut(minority.role, node.role)  # type: ignore[attr-defined]
        for worker in workers:
            if worker is not minority:
                self._rig.cut(worker.role, old.role)  # type: ignore[attr-defined]
        seconds = self.rng.uniform(*PARTITION_S)
        event = self._net_event("partition_primary", f"port {old.port} cut from the "
                                f"secondaries for {seconds:.1f}s, reached only by "
                                f"{minority.name}")
        healed = threading.Event()
        self._net_busy.set()

        def heal_after_election() -> None:
            # ``_heal`` calls this once the majority has elected (or gave up waiting): the
            # rules stay until ``seconds`` have passed, then go; ``end_t`` is the heal.
            try:
                time.sleep(max(0.0, event.t + seconds - time.monotonic()))
            finally:
                try:
                    self._rig.heal_all()
                finally:
                    healed.set()
                    self._net_busy.clear()

        self._heal(event, old, heal_after_election)  # holds the MongoDB faults back

        def mark_heal() -> None:
            healed.wait()
            event.end_t = time.monotonic()

        threading.Thread(target=mark_heal, daemon=True).start()
        return event
