"""Fault injection at random moments, from a recorded seed.

Every fault is logged with its monotonic time (the same clock the ledger uses: Linux's
``CLOCK_MONOTONIC`` is system-wide), so the checker can measure how long recovery took.
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pikku_celery.model import keys
from pikku_celery.worker.tasks import internal_task
from tests.chaos.cluster import Cluster, Worker
from tests.chaos.ledger import read_ledger
from tests.chaos.netfaults import NET_FAULTS, NET_KINDS, PRIMARY_NET_FAULTS, NetFaults

KINDS = {  # kind -> weight
    "kill_worker": 3,
    "kill_orchestrator": 2,
    "kill_child": 2,
    "pause_worker": 2,
    "stale_write": 2,
    "duplicate_step": 3,
    "duplicate_orchestrate": 2,
    "restart_redis": 1,
    "restart_mongo": 1,  # every node of the replica set killed and started again
    # The replica set's primary: SIGKILL (restarted a few seconds later, so the set heals),
    # replSetStepDown, and SIGSTOP past the 2 s election timeout, then SIGCONT (an
    # ex-primary that wakes up believing it is primary).
    "kill_primary": 1,
    "step_down_primary": 1,
    "stall_primary": 1,
    # Inputs that probe issue 8's fixes: each starts runs of its own (``extra_specs``).
    "oversized_result": 1,
    "child_create_error": 1,
    "colliding_run_ids": 1,
    # Issue 21's cancel windows: a cancel landing while a step is being delivered (the
    # claim's Dekker pair with the run's end), and while a pass creates a child run.
    "cancel_racing_claim": 1,
    "cancel_during_child": 1,
}
# Every profile applies these at least once (the first injections try them in turn): a
# run that never paused a worker mid-step, say, proves nothing about the fence.
REQUIRED = ("stale_write", "pause_worker", "oversized_result", "child_create_error",
            "colliding_run_ids", "kill_primary", "step_down_primary", "stall_primary",
            "cancel_racing_claim", "cancel_during_child")
OVERSIZED_MB = 8  # data and result each 8 MiB: each passes, together over 16 MiB
MONGO_FAULTS = ("restart_mongo", "kill_primary", "step_down_primary", "stall_primary")
STALE_WRITE_LEFT_S = 0.5  # the least sleep a slow body must have left to be paused
STALL_S = (4.0, 7.0)  # a primary's SIGSTOP: past the 2 s election timeout and the election
KILLED_PRIMARY_DOWN_S = (3.0, 8.0)  # after the new primary is elected
CANCEL_RACE_DELAY_S = (0.0, 0.03)  # from sending a step's delivery to cancelling its run
CHILD_PAUSE_S = (1.0, 2.0)  # a pass paused in creating a child run (run lease 3 s)
CHILD_PAUSE_WAIT_S = 15.0  # how long the harness waits for the pass to reach that pause
PENDING_WAIT_S = 2.0  # how long the harness polls for a step about to be claimed


@dataclass
class FaultEvent:
    kind: str
    t: float
    pids: set[int] = field(default_factory=set)
    detail: str = ""
    # When the fault's effect ended (a MongoDB fault: a primary accepted writes again; a
    # stall: the SIGCONT too), set from a background thread; None while it lasts.
    end_t: float | None = None
    new_primary_s: float | None = None  # a MongoDB fault: until a primary was writable


class FaultInjector(NetFaults):
    def __init__(self, cluster: Cluster, pikku: Any, app: Any, seed: int, pools: list[str],
                 lease_s: float) -> None:
        self.cluster = cluster
        # The partition kinds of issue 37 join in when every process has a namespace.
        self.kinds = {**KINDS, **(NET_KINDS if cluster.rig is not None else {})}
        self._net_busy = threading.Event()  # a partition fault is still held
        self.pikku = pikku
        self.app = app
        self.rng = random.Random(seed)
        self.pools = pools
        self.lease_s = lease_s
        self.events: list[FaultEvent] = []
        self.counts: Counter[str] = Counter()
        self._paused: set[str] = set()
        self.last_choice = ""
        self.not_applied: list[str] = []  # "<kind>: <why>" for every fault that did not land
        self.extra_specs: dict[str, dict[str, Any]] = {}  # runs the faults started
        # Runs the faults cancelled, with the driver's wall clock (epoch ms) just before
        # and just after ``cancel`` (the run's end and its steps' fence land in between).
        self.cancelled: dict[str, tuple[int, int]] = {}
        self._required = list(REQUIRED) + (list(NET_FAULTS) if cluster.rig is not None
                                           else [])
        self._why = ""
        self._mongo_busy = threading.Event()  # a MongoDB fault is still healing
        # A node is restarted from this one thread, alive for the whole run: a node gets
        # SIGTERM when the *thread* that started it ends (PR_SET_PDEATHSIG), so a node
        # started from a short-lived healing thread died with it.
        self._node_starter = ThreadPoolExecutor(1, thread_name_prefix="chaos-mongod")
        self.polls = 0  # the last cancel_racing_claim's reads of the store

    def inject(self, run_ids: list[str]) -> FaultEvent | None:
        """Apply one fault; one that cannot be applied is recorded in ``not_applied`` (and
        a required one is tried again next time), never silently dropped."""
        healing = self._mongo_busy.is_set()  # no MongoDB fault is a candidate meanwhile
        held = self._net_busy.is_set()  # nor a partition while one is held
        waiting = ((MONGO_FAULTS + PRIMARY_NET_FAULTS) if healing else ()) + (
            NET_FAULTS if held else ())
        ready = [k for k in self._required if k not in waiting]
        if ready:  # a required kind that does not apply goes to the back
            kind = ready[0]
            self._required.remove(kind)
            event = self._apply(kind, run_ids)
            if event is not None:
                return event
            self._required.append(kind)
        allowed = {kind: weight for kind, weight in self.kinds.items()
                   if kind not in waiting}
        kinds, weights = zip(*allowed.items(), strict=True)
        return self._apply(self.rng.choices(kinds, weights)[0], run_ids)

    def _apply(self, kind: str, run_ids: list[str]) -> FaultEvent | None:
        self._why = "no suitable target"
        try:
            event: FaultEvent | None = getattr(self, f"_{kind}")(run_ids)
        except Exception as exc:
            event, self._why = None, f"raised {exc!r}"
        if event is None:
            self.not_applied.append(f"{kind}: {self._why}")
            return None
        self.events.append(event)
        self.counts[kind] += 1
        return event

    @property
    def required_left(self) -> list[str]:
        """Required kinds not applied yet."""
        return list(self._required)

    @property
    def paused(self) -> bool:
        """Is any worker still stopped by a pause fault (or a MongoDB node healing)?"""
        return bool(self._paused) or self._mongo_busy.is_set() or self._net_busy.is_set()

    # --- faults ---------------------------------------------------------------------------

    def _victim(self) -> Worker | None:
        """A live worker, preferably one in the middle of a step body (from the ledger),
        so that kills and pauses land mid-step rather than on an idle process."""
        live = [w for w in self.cluster.live_workers() if w.name not in self._paused]
        if len(live) < 2:
            self._why = f"{len(live)} live unpaused worker(s): none would be left to recover"
            return None
        busy_pids = self._busy_pids()
        busy = [w for w in live if w.group_pids() & busy_pids]
        self.last_choice = f"{len(busy)} of {len(live)} live workers mid-step"
        return self.rng.choice(busy or live)

    def _orchestrating_pids(self) -> set[int]:
        open_passes: dict[tuple[str, int], int] = {}
        for entry in read_ledger(self.cluster.workdir / "ledger")[-400:]:
            key = (entry.get("run", ""), entry["pid"])
            if entry["event"] == "pass":
                open_passes[key] = entry["pid"]
            elif entry["event"] == "pass_end":
                open_passes.pop(key, None)
        return set(open_passes.values())

    def _kill_orchestrator(self, run_ids: list[str]) -> FaultEvent | None:
        """SIGKILL a worker in the middle of an orchestration pass (it holds a run lease):
        the run must carry on once that lease lapses."""
        passing = self._orchestrating_pids()
        live = [w for w in self.cluster.live_workers()
                if w.name not in self._paused and w.group_pids() & passing]
        if not live or len(self.cluster.live_workers()) < 2:
            return None
        worker = self.rng.choice(live)
        pids = worker.group_pids()
        worker.signal(signal.SIGKILL)
        worker.proc.wait(10)
        self._replace(worker)
        return FaultEvent("kill_orchestrator", time.monotonic(), pids, worker.name)

    def _busy_pids(self) -> set[int]:
        open_starts: dict[tuple[str, int, int], int] = {}
        for entry in read_ledger(self.cluster.workdir / "ledger")[-400:]:
            key = (entry.get("invocation", ""), entry.get("attempt", 0), entry["pid"])
            if entry["event"] == "start":
                open_starts[key] = entry["pid"]
            elif entry["event"] in ("end", "raise"):
                open_starts.pop(key, None)
        return set(open_starts.values())

    def _replace(self, worker: Worker) -> None:
        worker.replaced = True
        new = self.cluster.start_worker(worker.pool, worker.skew_s, worker.faketime)
        threading.Thread(target=self.cluster.wait_ready, args=(new,), daemon=True).start()

    def _kill_worker(self, run_ids: list[str]) -> FaultEvent | None:
        worker = self._victim()
        if worker is None:
            return None
        pids = worker.group_pids()
        worker.signal(signal.SIGKILL)
        worker.proc.wait(10)
        self._replace(worker)
        return FaultEvent("kill_worker", time.monotonic(), pids,
                          f"{worker.name} ({self.last_choice})")

    def _kill_child(self, run_ids: list[str]) -> FaultEvent | None:
        prefork = [w for w in self.cluster.live_workers()
                   if w.pool == "prefork" and w.name not in self._paused]
        if not prefork:
            return self._kill_worker(run_ids)
        worker = self.rng.choice(prefork)
        children = sorted(worker.group_pids() - {worker.proc.pid})
        if not children:
            return None
        busy = sorted(set(children) & self._busy_pids())
        child = self.rng.choice(busy or children)
        subprocess.run(["kill", "-9", str(child)], check=False)
        return FaultEvent("kill_child", time.monotonic(), {child}, worker.name)

    def _pause_worker(self, run_ids: list[str]) -> FaultEvent | None:
        worker = self._victim()
        if worker is None:
            return None
        seconds = self.lease_s * self.rng.uniform(1.5, 3.0)  # past its lease
        self._paused.add(worker.name)
        worker.signal(signal.SIGSTOP)

        def resume() -> None:
            time.sleep(seconds)
            worker.signal(signal.SIGCONT)
            self._paused.discard(worker.name)

        threading.Thread(target=resume, daemon=True).start()
        return FaultEvent("pause_worker", time.monotonic(), worker.group_pids(),
                          f"{worker.name} for {seconds:.1f}s")

    def _duplicate_step(self, run_ids: list[str]) -> FaultEvent | None:
        run_id = self.rng.choice(run_ids)
        steps = [s for s in self.pikku.get_steps(run_id) if s.function and
                 not s.function.startswith("workflow:")]
        if not steps:
            return None
        step = self.rng.choice(steps)
        self.app.tasks[step.function].apply_async((run_id, step.step_name))
        return FaultEvent("duplicate_step", time.monotonic(), detail=f"{run_id}:{step.step_name}")

    def _duplicate_orchestrate(self, run_ids: list[str]) -> FaultEvent | None:
        run_id = self.rng.choice(run_ids)
        internal_task(self.app, "orchestrate").apply_async((run_id,))
        return FaultEvent("duplicate_orchestrate", time.monotonic(), detail=run_id)

    def _restart_redis(self, run_ids: list[str]) -> FaultEvent | None:
        self.cluster.restart_redis()
        return FaultEvent("restart_redis", time.monotonic())

    # --- the MongoDB replica set -----------------------------------------------------------

    def _set_ready(self) -> bool:
        """One MongoDB fault at a time, on a whole set: a second node down would leave no
        majority, which is an outage of the set, not a failover (restart_mongo is that)."""
        if self._mongo_busy.is_set():
            self._why = "the replica set is still healing from the last MongoDB fault"
            return False
        if not self.cluster.mongo_healthy():
            self._why = "the replica set is not whole (a member is not PRIMARY/SECONDARY)"
            return False
        return True

    def _heal(self, event: FaultEvent, old: Any, after_primary: Any = None) -> None:
        """In the background: time the new primary (the fault's effect ends there, unless
        ``after_primary`` moves ``end_t`` later), run ``after_primary`` (a restart, a
        SIGCONT: always, even if no primary came), then wait for the set to be whole again
        before the next MongoDB fault."""
        self._mongo_busy.set()

        def heal() -> None:
            try:
                try:
                    self.cluster.wait_for_new_primary(old)
                    event.new_primary_s = time.monotonic() - event.t
                    event.end_t = time.monotonic()
                finally:
                    if after_primary is not None:
                        after_primary()
                give_up = time.monotonic() + 120
                while not self.cluster.mongo_healthy() and time.monotonic() < give_up:
                    time.sleep(0.5)
                if not self.cluster.mongo_healthy():
                    self.not_applied.append(f"{event.kind}: the set was not whole again "
                                            "120 s after the new primary")
            except Exception as exc:  # reported: a set that did not heal
                self.not_applied.append(f"{event.kind}: the set did not heal: {exc!r}")
            finally:
                self._mongo_busy.clear()

        threading.Thread(target=heal, daemon=True).start()

    def _restart_mongo(self, run_ids: list[str]) -> FaultEvent | None:
        if not self._set_ready():
            return None
        t = time.monotonic()
        self.cluster.restart_mongo()
        primary = self.cluster.primary()
        return FaultEvent("restart_mongo", t, detail=f"all {len(self.cluster.replset.nodes)} "
                          f"nodes; primary again on port {primary.port}",
                          end_t=time.monotonic(), new_primary_s=time.monotonic() - t)

    def _kill_primary(self, run_ids: list[str]) -> FaultEvent | None:
        """SIGKILL the primary (a crashed machine); start it again some seconds after the
        set elected another, on its port and data, so the set heals (it rolls back what it
        alone had, which no majority write is)."""
        if not self._set_ready():
            return None
        old = self.cluster.primary()
        down_s = self.rng.uniform(*KILLED_PRIMARY_DOWN_S)
        old.kill()
        event = FaultEvent("kill_primary", time.monotonic(),
                           detail=f"port {old.port}, restarted {down_s:.1f}s after the "
                           "election")

        def restart() -> None:
            time.sleep(down_s)
            self._node_starter.submit(old.start).result()

        self._heal(event, old, restart)
        return event

    def _step_down_primary(self, run_ids: list[str]) -> FaultEvent | None:
        if not self._set_ready():
            return None
        old = self.cluster.primary()
        t = time.monotonic()
        self.cluster.step_down(old)
        event = FaultEvent("step_down_primary", t, detail=f"port {old.port}")
        self._heal(event, old)
        return event

    def _stall_primary(self, run_ids: list[str]) -> FaultEvent | None:
        """SIGSTOP the primary past the election timeout, SIGCONT it once another node is
        primary and the stall has lasted: it wakes up believing it is primary, with
        requests half-served, until it learns of the newer term and steps down."""
        if not self._set_ready():
            return None
        old = self.cluster.primary()
        stall_s = self.rng.uniform(*STALL_S)
        old.signal(signal.SIGSTOP)
        event = FaultEvent("stall_primary", time.monotonic(), detail=f"port {old.port} for "
                           f"{stall_s:.1f}s")

        def resume() -> None:
            time.sleep(max(0.0, event.t + stall_s - time.monotonic()))
            old.signal(signal.SIGCONT)
            event.end_t = time.monotonic()  # its half-served requests go on from here

        try:
            self._heal(event, old, resume)
        except BaseException:
            old.signal(signal.SIGCONT)
            raise
        return event

    # --- a stale write that lands while the newer attempt still runs ----------------------

    def _open_bodies(self) -> list[dict[str, Any]]:
        """Ledger starts of bodies still running (no end or raise yet)."""
        open_starts: dict[tuple[str, int, int], dict[str, Any]] = {}
        for entry in read_ledger(self.cluster.workdir / "ledger")[-600:]:
            key = (entry.get("invocation", ""), entry.get("attempt", 0), entry["pid"])
            if entry["event"] == "start":
                open_starts[key] = entry
            elif entry["event"] in ("end", "raise"):
                open_starts.pop(key, None)
        return list(open_starts.values())

    def _stale_write(self, run_ids: list[str]) -> FaultEvent | None:
        """SIGSTOP a worker in the middle of a slow step body and SIGCONT it as soon as
        another worker has started the step's next attempt: the woken body's write then
        reaches a step that is ``running`` again under the newer attempt, which only the
        attempt in the settle filter refuses (a pause that ends after the newer attempt
        settled would be refused by the step's status alone)."""
        live = [w for w in self.cluster.live_workers() if w.name not in self._paused]
        if len(live) < 2:
            self._why = f"{len(live)} live unpaused worker(s)"
            return None
        # With time left in its sleep: the ledger read, the choice and the SIGSTOP take a
        # moment (long on a loaded machine), and a body that ends first proves nothing.
        now = time.monotonic()
        slow = [e for e in self._open_bodies() if e.get("step") == "courier"
                and e["t"] + e.get("seconds", 0.0) - now > STALE_WRITE_LEFT_S]
        targets = [(e, w) for e in slow for w in live if e["pid"] in w.group_pids()]
        if not targets:
            self._why = "no worker in the middle of a slow step body"
            return None
        body, worker = self.rng.choice(targets)
        pids = worker.group_pids()
        self._paused.add(worker.name)
        worker.signal(signal.SIGSTOP)
        if self._ended(body):  # it ended between the ledger read and the SIGSTOP: a stopped
            worker.signal(signal.SIGCONT)  # process writes no more lines, so this is final
            self._paused.discard(worker.name)
            self._why = "the slow step body ended before the pause landed"
            return None

        def resume_when_reclaimed() -> None:
            give_up = time.monotonic() + 8 * self.lease_s
            try:
                while time.monotonic() < give_up and not any(
                        e.get("invocation") == body["invocation"] and e["event"] == "start"
                        and e.get("attempt", 0) > body["attempt"]
                        for e in read_ledger(self.cluster.workdir / "ledger")[-600:]):
                    time.sleep(0.05)
            finally:
                worker.signal(signal.SIGCONT)
                self._paused.discard(worker.name)

        threading.Thread(target=resume_when_reclaimed, daemon=True).start()
        return FaultEvent("stale_write", time.monotonic(), pids,
                          f"{worker.name} paused in step 'courier' of run {body['run']} "
                          f"attempt {body['attempt']} until the next attempt starts")

    def _ended(self, body: dict[str, Any]) -> bool:
        key = (body.get("invocation"), body.get("attempt"), body["pid"])
        return any((e.get("invocation"), e.get("attempt"), e["pid"]) == key
                   and e["event"] in ("end", "raise")
                   for e in read_ledger(self.cluster.workdir / "ledger")[-600:])

    # --- issue 8: inputs that used to strand runs or leak across them ---------------------

    def _oversized_result(self, run_ids: list[str]) -> FaultEvent | None:
        """A step whose result fits alone but not beside its data: the attempt must fail at
        once with a clear error (it used to be retried forever under a live heartbeat)."""
        run_id = self.pikku.start("chaos.oversized", {"mb": OVERSIZED_MB})
        self.extra_specs[run_id] = {"kind": "oversized", "expect": "failed",
                                    "error": "InvalidInputError"}
        return FaultEvent("oversized_result", time.monotonic(), detail=run_id)

    def _child_create_error(self, run_ids: list[str]) -> FaultEvent | None:
        """A parent whose child run's first creation fails after the parent recorded the
        child step: the reaper must recover it (it used to wait forever)."""
        run_id = self.pikku.start("chaos.parent", {"fail_child_create": True})
        self.extra_specs[run_id] = {"kind": "parent", "expect": "completed",
                                    "ledger_event": "child_create_failed"}
        return FaultEvent("child_create_error", time.monotonic(), detail=run_id)

    def _colliding_run_ids(self, run_ids: list[str]) -> FaultEvent | None:
        """A caller choosing run ids that would collide with other runs' internal ids:
        ``<victim>:ship`` (its step ``on_error`` against the victim's ``ship:on_error``), and
        the child run id a parent is about to use, taken before the parent starts."""
        from pikku_celery import InvalidInputError
        from pikku_celery.model import keys

        victim = self.rng.choice(run_ids)
        squatter = f"{victim}:ship"
        try:
            self.pikku.start("chaos.squat", {"victim": victim}, run_id=squatter)
        except InvalidInputError as exc:  # refusing such ids is a fix too
            detail = f"{squatter} refused ({exc})"
        else:
            self.extra_specs[squatter] = {"kind": "squatter", "expect": "completed"}
            detail = f"{squatter} started"
        parent_id = f"chaos-parent-{self.rng.randrange(10**9)}"
        # The id the parent's child will take is reserved (``@``...): start refuses it.
        # The id earlier versions derived is a caller's to take, and the parent must not
        # adopt a run it did not create there: it completes with a child of its own.
        try:
            self.pikku.start("chaos.invoice", {"order": -2},
                             run_id=keys.child_run_id(parent_id, "invoice"))
        except InvalidInputError:
            child = "its child id refused"
        else:
            raise AssertionError(f"start took the reserved child id of {parent_id}")
        legacy = keys.legacy_child_run_id(parent_id, "invoice")
        self.pikku.start("chaos.invoice", {"order": -2}, run_id=legacy)
        self.extra_specs[legacy] = {"kind": "squat_child", "expect": "completed"}
        self.pikku.start("chaos.parent", {}, run_id=parent_id)
        self.extra_specs[parent_id] = {"kind": "parent", "expect": "completed"}
        return FaultEvent("colliding_run_ids", time.monotonic(),
                          detail=f"{detail}; {parent_id}: {child}, its old-style id taken")

    # --- issue 21: cancels timed to land inside a claim or a child's creation --------------

    def _cancel(self, run_id: str, reason: str) -> None:
        """Cancel as an application would: retried while MongoDB has no primary (a cancel
        cut short has ended the run but maybe not fenced its steps; it is idempotent)."""
        from tests.chaos.client import call_again

        before = int(time.time() * 1000)
        self.cancelled[run_id] = (before, 2**62)  # until it returns
        give_up = time.monotonic() + 60
        while True:
            try:
                self.pikku.cancel(run_id, reason)
                break
            except Exception as exc:
                if not call_again(exc) or time.monotonic() > give_up:
                    raise
                time.sleep(0.5)
        self.cancelled[run_id] = (before, int(time.time() * 1000))

    def _cancel_racing_claim(self, run_ids: list[str]) -> FaultEvent | None:
        """Cancel a run while one of its steps is being delivered: a step just recorded
        (``pending``), or one whose retry is due, gets a delivery of its own, and the
        cancel follows within milliseconds, so the claim's write, its read of the run, the
        run's end and the fence's read of the steps interleave (a claim between the fence's
        read and its write used to run its body on the cancelled run). A step that is
        running gets the delivery too (a duplicate whose claim is refused, or that reclaims
        a lapsed lease). The checker then asserts that no step of the run recorded an
        outcome after the run ended, beyond the documented window."""
        step = self._step_to_deliver(run_ids)
        if step is None:
            self._why = "no live run with a step to deliver"
            return None
        run_id = step.run_id
        self.app.tasks[step.function].apply_async((run_id, step.step_name))
        delay = self.rng.uniform(*CANCEL_RACE_DELAY_S)
        time.sleep(delay)
        self._cancel(run_id, "chaos cancel racing a claim")
        after = next((s for s in self.pikku.get_steps(run_id)
                      if s.step_name == step.step_name), None)
        return FaultEvent("cancel_racing_claim", time.monotonic(),
                          detail=f"{run_id}:{step.step_name} was {step.status} (attempt "
                          f"{step.attempt}), cancelled {delay * 1000:.0f} ms after its "
                          f"delivery was sent; then {getattr(after, 'status', '?')} attempt "
                          f"{getattr(after, 'attempt', '?')} ({self.polls} polls of "
                          f"{len(run_ids)} live runs)")

    def _step_to_deliver(self, run_ids: list[str]) -> Any:
        """A step of a live run that a delivery is about to claim: one just recorded
        (``pending``) or whose retry is due, polled for up to ``PENDING_WAIT_S`` (such a
        step is claimed within milliseconds); else a running one (its delivery is a
        duplicate, refused or reclaiming a lapsed lease)."""
        from pikku_celery.model.keys import StepField as S

        steps = self.pikku.engine.store.db[keys.STEPS]
        live = {"run_id": {"$in": list(run_ids)}, "function": {"$regex": "^chaos\\."}}
        give_up = time.monotonic() + PENDING_WAIT_S
        self.polls = 0
        while True:
            self.polls += 1
            found = list(steps.find({**live, "$or": [
                {S.STATUS: "pending"}, {S.STATUS: "failed", S.DUE: {"$ne": None}}]},
                {S.RUN: 1, S.NAME: 1}).limit(20))
            if found or time.monotonic() > give_up:
                break
            time.sleep(0.01)
        if not found:
            found = list(steps.find({**live, S.STATUS: "running"}, {S.RUN: 1, S.NAME: 1})
                         .limit(20))
        for doc in self.rng.sample(found, len(found)):
            step = next((s for s in self.pikku.get_steps(doc[S.RUN])
                         if s.step_name == doc[S.NAME]), None)
            run = self.pikku.get_run(doc[S.RUN])
            if step is not None and step.function and not run.is_terminal:
                return step
        return None

    def _cancel_during_child(self, run_ids: list[str]) -> FaultEvent | None:
        """Cancel a parent while its pass sits between recording the child's step and
        creating the child run (the chaos app's store pauses there, once, with a ledger
        line): the cancel finds no child to cancel, so the pass must, after it creates the
        child, read the parent and cancel the child. The checker asserts the child ended
        cancelled and ran no step."""
        pause_s = round(self.rng.uniform(*CHILD_PAUSE_S), 2)
        run_id = self.pikku.start("chaos.parent", {"pause_child_create_s": pause_s})
        self.extra_specs[run_id] = {"kind": "parent", "expect": "cancelled",
                                    "ledger_event": "child_creating"}
        give_up = time.monotonic() + CHILD_PAUSE_WAIT_S
        paused: dict[str, Any] | None = None
        while paused is None and time.monotonic() < give_up:
            paused = next((e for e in read_ledger(self.cluster.workdir / "ledger")[-400:]
                           if e["event"] == "child_creating" and e.get("run") == run_id),
                          None)
            if paused is None:
                time.sleep(0.02)
        if paused is None:
            # The parent is cancelled anyway (its spec says so); the fault did not land.
            self._cancel(run_id, "chaos cancel (the child's creation never paused)")
            self._why = f"parent {run_id}'s pass did not reach the child's creation in " \
                f"{CHILD_PAUSE_WAIT_S:.0f}s"
            return None
        # Somewhere inside the pause, never after it: the child must not exist yet.
        left = paused["t"] + pause_s - time.monotonic()
        time.sleep(max(0.0, self.rng.uniform(0.0, 0.6) * left))
        self._cancel(run_id, "chaos cancel during the child's creation")
        resumed = any(e["event"] == "child_create_resumed" and e.get("run") == run_id
                      for e in read_ledger(self.cluster.workdir / "ledger")[-400:])
        return FaultEvent("cancel_during_child", time.monotonic(),
                          detail=f"parent {run_id} cancelled while its pass paused "
                          f"{pause_s:.2f}s creating child {paused.get('child')}"
                          + (" (the pause had ended before the cancel returned)"
                             if resumed else ""))
