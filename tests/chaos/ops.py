"""The driver's retries, forks and approvals (issue 31), made from the mix's sender thread
during the faults, each recorded with what it returned (``tests.chaos.composed.Operations``)
for the checker.

- **retry**: a share of the runs that ended failed or cancelled (orders failed by their
  fatal step or cancelled; events and approval runs cancelled while they wait; limited runs
  cancelled while queued or running) is retried 0.5-3 s after the driver saw it end, at
  most twice per run; a retry refused because the run's group is full is tried again a
  second later (as its log line says to).
- **fork**: a share of the completed runs (orders, events and approval runs) is forked
  from a step drawn among its recorded ones, with or without ``keep_decisions``, under a
  new id; some forks are repeated (the same call: the same fork comes back), and some are
  followed by a probe: a fork from another step under the id of an earlier fork of the
  same source, or of the source itself (it must be refused, the run it names unchanged).
  The waits a fork asks again are answered as the source's were: the driver sends the
  fork its events and approves its gate.
- **approve**: the approval runs' gate, once the run waits on it (a refused approve of a
  live run is tried again), again after a retry that reopened it.
- **samples**: at every round of the driver's loop, one snapshot read of the limited runs
  and their slot groups (contract 7.4 at that moment).
"""

from __future__ import annotations

import inspect
import random
import time
import uuid
from typing import Any

from pikku_celery.model import keys
from tests.chaos.client import as_a_client, call_again, now_ms
from tests.chaos.composed import (
    APPROVAL_GATE,
    LIVE,
    Operations,
    event_fingerprints,
    limit_breaches,
    step_fingerprints,
)

RETRY_SHARE = {"order": 0.5, "events": 0.8, "approver": 0.8, "limited": 0.8}
FORKABLE = ("order", "events", "approver")
MAX_RETRIES = 2  # per run
FULL_GROUP_TRIES = 15  # a retry refused because its group is full, tried again each second
REPEAT_SHARE, PROBE_SHARE, KEEP_SHARE = 0.3, 0.3, 0.5
FORK_AGAIN_SHARE = 0.3  # a source forked again (from another step, maybe): probes name it


class Operator:
    """Decides and makes the operations; ``queue(due, run_id, op, args)`` is the mix's
    queue (run by its sender thread), through which every call is made."""

    def __init__(self, chaos: Any, rng: random.Random, fork_share: float, queue: Any) -> None:
        self.chaos = chaos
        self.rng = rng
        self.fork_share = fork_share
        self.queue = queue
        self.record = Operations()
        self.db = chaos.pikku.engine.store.db
        self.keeps = "keep_decisions" in inspect.signature(chaos.pikku.fork).parameters
        self.forks_of: dict[str, list[str]] = {}
        self.seen: set[tuple[str, int]] = set()  # (run, retries done) whose end was seen
        self.approved: set[str] = set()  # runs an approve was recorded for
        self.started = time.monotonic()

    # --- what to do with a run that ended -----------------------------------------------------

    def ended(self, run_id: str, spec: dict[str, Any], status: str) -> None:
        """Called by the driver's loop each time it sees ``run_id`` ended."""
        kind = spec.get("kind", "order")
        lives = len(self.record.done_retries(run_id))
        if (run_id, lives) in self.seen:
            return
        self.seen.add((run_id, lives))
        due = time.monotonic() + self.rng.uniform(0.5, 3.0)
        if status in ("failed", "cancelled") and kind in RETRY_SHARE and lives < MAX_RETRIES:
            forced = status == "cancelled" and spec.get("retry_after_cancel") and not lives
            if forced or self.rng.random() < RETRY_SHARE[kind]:
                self.queue(due, run_id, "retry", {"tries": FULL_GROUP_TRIES})
        elif (status == "completed" and kind in FORKABLE and "fork" not in spec
              and self.rng.random() < self.fork_share):
            self.queue(due, run_id, "fork", {"spec": spec})

    # --- the calls ----------------------------------------------------------------------------

    def retry(self, run_id: str) -> bool:
        """One ``pikku.retry``; True when the run runs again. A call a fault interrupted is
        made again; a run found live after that counts as retried by it."""
        doc = as_a_client(lambda: self.db[keys.RUNS].find_one(
            {"_id": run_id}, {"status": 1, "updated_ms": 1})) or {}
        before = now_ms()
        faulted = False
        deadline = time.monotonic() + 60.0
        while True:
            try:
                done = bool(self.chaos.pikku.retry(run_id))
                break
            except Exception as exc:  # a fault's: again; anything else reported
                if call_again(exc) and time.monotonic() <= deadline:
                    faulted = True
                    time.sleep(0.5)
                    continue
                self.record.errors.append(f"retry of run {run_id} raised {exc!r}")
                done = False
                break
        if faulted and not done:
            status = as_a_client(lambda: self.chaos.pikku.get_run(run_id)).status
            done = status in (*LIVE, "queued")
        ended = doc.get("status") in ("failed", "cancelled")
        self.record.retries.setdefault(run_id, []).append(
            {"before": before, "after": now_ms(), "done": done, "status": doc.get("status"),
             "end_ms": doc.get("updated_ms") if ended else None})
        print(f"chaos: t+{time.monotonic() - self.started:5.1f}s retry of "
              f"{doc.get('status')} run {run_id}: {done}", flush=True)
        return done

    def approve(self, run_id: str, decision: dict[str, Any]) -> str:
        """One ``pikku.approve``: "recorded", "run ended", or "not waiting" (a live run
        that does not wait on the gate yet: asked again later)."""
        from pikku_celery.model.errors import WorkflowApprovalError

        before = now_ms()
        try:
            as_a_client(lambda: self.chaos.pikku.approve(run_id, "go", decision))
            outcome = "recorded"
            self.approved.add(run_id)
        except WorkflowApprovalError:
            ended = as_a_client(lambda: self.chaos.pikku.get_run(run_id)).is_terminal
            outcome = "run ended" if ended else "not waiting"
        if outcome != "not waiting":
            self.record.approvals.setdefault(run_id, []).append(
                {"decision": decision, "before": before, "after": now_ms(),
                 "outcome": outcome})
        return outcome

    def fork(self, source: str, spec: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """Fork ``source`` from a step drawn among its recorded ones; the fork's id and
        spec, or None when the call raised (recorded)."""
        steps = as_a_client(lambda: self.chaos.pikku.engine.store.list_steps(source))
        order = [s.step_name for s in steps]
        if not order:
            return None
        from_step = self.rng.choice(order)
        # the first fork keeps decisions, the second does not, then as drawn; the first
        # is repeated and probed, then as drawn: each profile has every kind
        first, made = not self.record.forks, len(self.record.forks)
        keep = self.keeps and (made == 0 if made < 2 else self.rng.random() < KEEP_SHARE)
        if first or self.rng.random() < PROBE_SHARE:
            self._probe(source, order)
        fork_id = str(uuid.uuid4())
        record: dict[str, Any] = {
            "source": source, "from_step": from_step, "keep": keep, "source_order": order,
            "source_steps": as_a_client(lambda: step_fingerprints(self.db, source)),
            "source_events": as_a_client(lambda: event_fingerprints(self.db, source))}
        kwargs = {"keep_decisions": keep} if self.keeps else {}

        def call() -> Any:
            return self.chaos.pikku.fork(source, from_step=from_step, new_run_id=fork_id,
                                         **kwargs)

        try:
            record["returned"] = as_a_client(call)
            if first or self.rng.random() < REPEAT_SHARE:
                record["repeat"] = as_a_client(call)
        except Exception as exc:  # reported, never swallowed
            self.record.errors.append(f"fork of run {source} from {from_step!r} raised "
                                      f"{exc!r}")
            return None
        self.record.forks[fork_id] = record
        self.forks_of.setdefault(source, []).append(fork_id)
        fork_spec = {k: v for k, v in spec.items() if k not in (
            "cancel_after_s", "cancel_while_waiting", "retry_after_cancel")}
        fork_spec.update(expect="completed", fork={"source": source, "from_step": from_step,
                                                   "keep": keep})
        print(f"chaos: t+{time.monotonic() - self.started:5.1f}s fork {fork_id} of "
              f"{source} from {from_step!r} (keep_decisions={keep})", flush=True)
        return fork_id, fork_spec

    def _probe(self, source: str, order: list[str]) -> None:
        """A fork under the id of an earlier fork of ``source`` that ended (from another
        step), or of ``source`` itself: refused with ``WorkflowRunConflictError``, nothing
        written."""
        from pikku_celery.model.errors import WorkflowRunConflictError

        # an ended run: its steps stay as they are unless the probe writes into them
        ended = [f for f in self.forks_of.get(source, [])
                 if as_a_client(lambda f=f: self.chaos.pikku.get_run(f)).is_terminal]
        target = self.rng.choice([*ended, source])
        taken = self.record.forks.get(target, {}).get("from_step")
        others = [n for n in order if n != taken]
        if not others:
            return
        from_step = self.rng.choice(others)
        probe: dict[str, Any] = {
            "source": source, "from_step": from_step, "target": target,
            "target_steps": as_a_client(lambda: step_fingerprints(self.db, target))}
        try:
            returned = as_a_client(lambda: self.chaos.pikku.fork(
                source, from_step=from_step, new_run_id=target))
            probe["outcome"] = f"returned {returned}"
        except WorkflowRunConflictError:
            probe["outcome"] = "conflict"
        except Exception as exc:
            probe["outcome"] = f"raised {exc!r}"
        self.record.probes.append(probe)

    def asked_again(self, fork_id: str, spec: dict[str, Any]) -> tuple[list[str], bool]:
        """What the fork asks that its source had answered: the names of the event waits
        (without a timeout, in order) it did not copy, and whether its approval gate was
        not copied."""
        copied = {d["step_name"] for d in as_a_client(lambda: list(self.db[keys.STEPS].find(
            {"run_id": fork_id, "forked_from": {"$ne": None}}, {"step_name": 1})))}
        names: list[str] = []
        reach: dict[str, int] = {}
        for name, timeout in spec.get("waits") or []:
            reach[name] = reach.get(name, 0) + 1
            gate = f"__event:{name}" + ("" if reach[name] == 1 else f"#{reach[name]}")
            if timeout is None and gate not in copied:
                names.append(name)
        return names, spec.get("kind") == "approver" and APPROVAL_GATE not in copied

    # --- samples ------------------------------------------------------------------------------

    def sample_limits(self, workflow: str, limit: int) -> None:
        """One snapshot read of ``workflow``'s live runs and slot groups (contract 7.4 at
        that moment); a read a fault made fail is counted, not retried."""
        from pymongo.errors import PyMongoError

        db = self.db
        try:
            with db.client.start_session(snapshot=True) as session:
                live = list(db[keys.RUNS].find(
                    {"workflow": workflow, "status": {"$in": list(LIVE)}},
                    {"slot": 1, "status": 1, "lineage": 1}, session=session))
                slots = list(db[keys.SLOTS].find({"workflow": workflow}, {"holders": 1},
                                                 session=session))
        except PyMongoError:
            self.record.samples_failed += 1
            return
        self.record.samples += 1
        at = f"t+{time.monotonic() - self.started:.1f}s"
        known = {b.split(": ", 1)[1] for b in self.record.breaches}
        for breach in limit_breaches(live, slots, limit, at):
            if breach.split(": ", 1)[1] not in known:
                self.record.breaches.append(breach)
                print(f"chaos: limit breached: {breach}", flush=True)
