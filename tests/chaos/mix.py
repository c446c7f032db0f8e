"""The chaos mix beside the orders: issue 26's primitives (events, a schedule, a concurrency
limit) and issue 31's operations on runs (retry, fork, approve), driven from a thread of
the driver's own so they land in the middle of faults."""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from typing import Any

from pikku_celery.model import keys
from pikku_celery.model.durations import to_ms
from pikku_celery.model.errors import WorkflowEventError
from tests.chaos.client import as_a_client
from tests.chaos.ops import FORK_AGAIN_SHARE, Operator

WORKFLOWS = {"events": "chaos.awaiter", "limited": "chaos.limited",
             "approver": "chaos.approver"}
EVENTS_CANCEL_SHARE = 0.25  # events runs cancelled while they wait (most then retried)
APPROVER_CANCEL_SHARE = 0.4  # approval runs cancelled while they wait (most then retried)
FINISH_S = 150.0  # how long the queue may take to empty once the faults stop
# how long an approval is asked again while its run does not wait on the gate yet (a run
# slowed by faults, or still queued behind a whole-set MongoDB restart)
APPROVE_PATIENCE_S = 120.0

Op = tuple[float, str, str, dict[str, Any]]  # due (monotonic s), run, operation, its args


class Mix:
    """Runs of ``chaos.awaiter`` and the events the driver sends them (right after the
    start, so before the run waits, or seconds later; some twice with one key), runs of
    ``chaos.limited`` (a few keys, several runs each: they queue), runs of
    ``chaos.approver`` and their approvals, the runs the chaos app's schedule starts
    (collected as they appear), and the operator's retries and forks (``ops``)."""

    def __init__(self, chaos: Any, profile: Any, rng: random.Random) -> None:
        self.chaos = chaos
        self.rng = rng
        # Runs started together: an events or approval run alone; limited runs in bursts
        # of up to three per key, so each key has runs queued behind the one running.
        self.plan: list[list[dict[str, Any]]] = []
        singles = [[self._events_spec(n)] for n in range(profile.event_runs)]
        approvers = [[{"kind": "approver", "expect": "completed", "order": 3000 + n}]
                     for n in range(profile.approver_runs)]
        # Some cancelled while they wait (drawn here, from the seed), then retried: the
        # first of each kind always, so every profile has a reopened event wait, approval
        # and (below) slot.
        for runs, share in ((singles, EVENTS_CANCEL_SHARE), (approvers, APPROVER_CANCEL_SHARE)):
            for i, (spec,) in enumerate(runs):
                if i == 0 or rng.random() < share:
                    spec["cancel_while_waiting"] = True
                    spec["retry_after_cancel"] = i == 0
        step = max(1, len(singles) // max(1, len(approvers)))
        for i, single in enumerate(approvers):
            singles.insert(min(len(singles), (i + 1) * step + i), single)
        limited = [{"kind": "limited", "expect": "completed", "key": f"k{k}",
                    "order": 1000 + r * profile.limited_keys + k,
                    "slow_s": round(rng.uniform(0.3, 1.2), 2)}
                   for r in range(profile.limited_per_key) for k in range(profile.limited_keys)]
        batch = 3 * profile.limited_keys
        bursts = [limited[i:i + batch] for i in range(0, len(limited), batch)]
        # One run of half the bursts cancelled 0-2 s after its start, queued or running (of
        # the first, its last run, at once: queued behind its key's first two, then retried).
        for i, burst in enumerate(bursts):
            if len(burst) > 1 and (i == 0 or rng.random() < 0.5):
                spec = burst[-1] if i == 0 else burst[rng.randrange(len(burst))]
                spec["cancel_after_s"] = 0.0 if i == 0 else round(rng.uniform(0.0, 2.0), 2)
                spec["retry_after_cancel"] = i == 0
        while singles or bursts:
            if bursts:
                self.plan.append(bursts.pop(0))
            for _ in range(max(1, len(singles) // max(1, len(bursts) + 1))):
                if singles:
                    self.plan.append(singles.pop(0))
        self.total = len(self.plan)
        self.ops: list[Op] = []  # run by the sender thread, in due order
        self.sent: list[dict[str, Any]] = []  # every send, as the checker reads it
        self.cancelled: dict[str, tuple[int, int]] = {}  # runs the mix cancelled, as _drive's
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.sender = threading.Thread(target=self._sender, name="chaos-sender", daemon=True)
        self.counter = 0
        self.ticks_seen: set[str] = set()
        self.paused_ms: int | None = None
        self.operator = Operator(chaos, random.Random(rng.random()), profile.fork_share,
                                 self._queue)
        self.revived: set[str] = set()  # runs a retry ran again, for the driver's loop
        self.new_specs: dict[str, dict[str, Any]] = {}  # forks, for the driver's loop

    def _events_spec(self, n: int) -> dict[str, Any]:
        names = [self.rng.choice(["paid", "shipped"]) for _ in range(self.rng.randint(2, 4))]
        waits: list[list[Any]] = [[name, None] for name in names]
        if self.rng.random() < 0.5:  # a wait nobody sends to: its timeout expires
            waits.insert(self.rng.randint(0, len(waits)), ["late", 1.0])
        return {"kind": "events", "expect": "completed", "order": 2000 + n, "waits": waits}

    def start_sender(self) -> None:
        self.sender.start()

    def _sender(self) -> None:
        while not self.stop.is_set():
            try:
                self.run_due()
            except Exception as exc:  # reported, never swallowed: its run may never end
                print(f"chaos: the mix's sender failed: {exc!r}", flush=True)
            self.stop.wait(0.05)

    # --- the driver's loop --------------------------------------------------------------------

    def start_due(self, specs: dict[str, dict[str, Any]], progress: float) -> list[str]:
        started = []
        while self.plan and self.total - len(self.plan) < min(1.0, progress) * self.total + 1:
            burst = self.plan.pop(0)
            for spec in burst:
                run_id = str(uuid.uuid4())
                as_a_client(lambda s=spec, r=run_id: self.chaos.pikku.start(
                    WORKFLOWS[s["kind"]], s, run_id=r))
                specs[run_id] = spec
                started.append(run_id)
                if spec["kind"] == "events":
                    self._plan_sends(run_id, spec)
                elif spec["kind"] == "approver":
                    self._plan_approval(run_id, spec)
                elif "cancel_after_s" in spec:
                    self._queue(time.monotonic() + spec["cancel_after_s"], run_id, "cancel",
                                {})
        return started

    def ended(self, run_id: str, spec: dict[str, Any], status: str) -> None:
        """The driver's loop saw ``run_id`` ended: maybe retry or fork it."""
        self.operator.ended(run_id, spec, status)

    def take_revived(self) -> set[str]:
        with self.lock:
            revived, self.revived = self.revived, set()
        return revived

    def take_specs(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            specs, self.new_specs = self.new_specs, {}
        return specs

    def sample(self) -> None:
        from tests.chaos.chaosapp import LIMITED_CONCURRENCY

        self.operator.sample_limits("chaos.limited", LIMITED_CONCURRENCY)

    # --- planning -----------------------------------------------------------------------------

    def _queue(self, due: float, run_id: str, op: str, args: dict[str, Any]) -> None:
        with self.lock:
            self.ops.append((due, run_id, op, args))
            self.ops.sort(key=lambda s: s[0])

    def _plan_sends(self, run_id: str, spec: dict[str, Any], names: list[str] | None = None,
                    rng: random.Random | None = None) -> None:
        """One event per wait that has no timeout (or per name of ``names``), in the order
        of the waits: the first ones at once (before the run reaches its wait), the rest
        over the next seconds; some keyed and sent twice. (``rng``: the sender thread's,
        so that the driver's loop draws the same numbers from the seed whatever it does.)"""
        rng = rng or self.rng
        now = time.monotonic()
        due = now
        if names is None:
            names = [name for name, timeout in spec["waits"] if timeout is None]
        for i, name in enumerate(names):
            if i > 0 and rng.random() < 0.6:
                due += rng.uniform(0.5, 4.0)
            key = f"{run_id[:8]}-{i}" if rng.random() < 0.4 else None
            self._queue(due, run_id, "send", {"name": name, "key": key})
            if key is not None:  # the same key again, later: delivered once
                self._queue(due + rng.uniform(0.0, 3.0), run_id, "send",
                            {"name": name, "key": key})
        if spec.get("cancel_while_waiting"):
            # cancelled while it waits: its later sends are refused (sent again if retried)
            self._queue(now + rng.uniform(0.0, due - now + 1.0), run_id, "cancel",
                        {"until": now + 15.0})

    def _plan_approval(self, run_id: str, spec: dict[str, Any]) -> None:
        """The approval 1-5 s after the start (asked again until the run waits on it);
        some runs cancelled before it, while they wait (then 3-6 s after the start)."""
        now = time.monotonic()
        approve_s = self.rng.uniform(1.0, 5.0)
        if spec.get("cancel_while_waiting"):
            approve_s = self.rng.uniform(3.0, 6.0)
            self._queue(now + 0.5, run_id, "cancel", {"until": now + 15.0})
        self._queue(now + approve_s, run_id, "approve",
                    {"until": now + approve_s + APPROVE_PATIENCE_S})

    # --- the sender thread ----------------------------------------------------------------------

    def run_due(self, everything: bool = False) -> None:
        now = time.monotonic()
        while True:
            with self.lock:
                if not self.ops or not (everything or self.ops[0][0] <= now):
                    return
                _, run_id, op, args = self.ops.pop(0)
            if op == "send":
                record = self._send(run_id, args["name"], args["key"])
                with self.lock:
                    self.sent.append(record)
            elif op == "cancel":
                self._cancel(run_id, args)
            elif op == "approve":
                self._approve(run_id, args)
            elif op == "retry":
                self._retry(run_id, args)
            elif op == "fork":
                self._fork(run_id, args["spec"])

    def _cancel(self, run_id: str, args: dict[str, Any]) -> None:
        """A cancel; with ``until``, once the run waits (``suspended``: on an event or an
        approval), or at ``until`` if it never does (not once it has ended)."""
        if "until" in args:
            status = as_a_client(lambda: self.chaos.pikku.get_run(run_id)).status
            if status in ("completed", "failed", "cancelled"):
                return
            if status != "suspended" and time.monotonic() < args["until"]:
                self._queue(time.monotonic() + 0.2, run_id, "cancel", args)
                return
        before = int(time.time() * 1000)
        self.cancelled[run_id] = (before, 2**62)  # until it returns, in case it never does
        as_a_client(lambda: self.chaos.pikku.cancel(run_id, "chaos mix cancel"))
        self.cancelled[run_id] = (before, int(time.time() * 1000))

    def _approve(self, run_id: str, args: dict[str, Any]) -> None:
        self.counter += 1
        outcome = self.operator.approve(run_id, {"n": self.counter})
        if outcome == "not waiting" and time.monotonic() < args["until"]:
            self._queue(time.monotonic() + 0.5, run_id, "approve", args)

    def _retry(self, run_id: str, args: dict[str, Any]) -> None:
        if not self.operator.retry(run_id):
            status = as_a_client(lambda: self.chaos.pikku.get_run(run_id)).status
            if status in ("failed", "cancelled") and args["tries"] > 1:  # its group is full
                self._queue(time.monotonic() + 1.0, run_id, "retry",
                            {"tries": args["tries"] - 1})
            return
        with self.lock:
            self.revived.add(run_id)
            refused = [r for r in self.sent if r["run"] == run_id and not r.get("resent")
                       and r["outcome"].startswith("refused")]
            for record in refused:
                record["resent"] = True
        now = time.monotonic()
        for i, record in enumerate(refused):  # sent again, as the application would
            self._queue(now + 0.2 * i, run_id, "send", {"name": record["name"],
                                                        "key": record["key"]})
        if run_id in self.operator.record.approvals and run_id not in self.operator.approved:
            self._queue(now + self.operator.rng.uniform(0.2, 2.0), run_id, "approve",
                        {"until": now + APPROVE_PATIENCE_S})

    def _fork(self, source: str, spec: dict[str, Any]) -> None:
        made = self.operator.fork(source, spec)
        if made is None:
            return
        fork_id, fork_spec = made
        with self.lock:
            self.new_specs[fork_id] = fork_spec
        if self.operator.rng.random() < FORK_AGAIN_SHARE:
            self._queue(time.monotonic() + self.operator.rng.uniform(1.0, 3.0), source, "fork",
                        {"spec": spec})
        names, approve = self.operator.asked_again(fork_id, fork_spec)
        if names:
            self._plan_sends(fork_id, fork_spec, names, self.operator.rng)
        if approve:
            now = time.monotonic()
            self._queue(now + self.operator.rng.uniform(0.5, 3.0), fork_id, "approve",
                        {"until": now + APPROVE_PATIENCE_S})

    def _send(self, run_id: str, name: str, key: str | None) -> dict[str, Any]:
        """One send, as an application makes it: a call that fails (a store or broker
        fault the library's own retries did not outlast) is made again only when the
        event was not kept (nothing reached the store, or the event is not there when read
        back by its payload's send number), so that no retry of the driver's keeps an
        event twice; ``ambiguous`` says a call failed."""
        with self.lock:
            # a key's number is that of the send that kept it (one refused is sent again
            # under a new number: the numbers follow the order events were kept in)
            first = [sent for sent in self.sent if sent["run"] == run_id and sent["key"] == key
                     and key is not None and sent["seq"] is not None]
        self.counter += 1
        record: dict[str, Any] = {
            "run": run_id, "name": name, "key": key,
            "n": first[0]["n"] if first else self.counter, "seq": None, "ambiguous": False,
            "outcome": "sent", "wall_ms": int(time.time() * 1000)}
        deadline = time.monotonic() + 60.0
        while True:
            try:
                event = self.chaos.pikku.send_event(run_id, name, {"n": record["n"],
                                                                   "name": name}, key=key)
            except WorkflowEventError:  # the run ended (a cancel, a fault): nothing kept
                record["outcome"] = "refused: the run has ended"
                return record
            except Exception as exc:  # a store or broker fault: as a client, try again
                record["ambiguous"] = True
                if time.monotonic() > deadline:
                    record["outcome"] = f"gave up: {exc!r}"
                    print(f"chaos: an event send gave up: {exc!r}", flush=True)
                    return record
                time.sleep(0.5)
                # WorkflowEventNotSentError.may_be_kept False: nothing reached the store
                kept = (self._kept(run_id, record["n"])
                        if getattr(exc, "may_be_kept", True) else None)
                if kept is not None:
                    record["seq"] = kept
                    record["outcome"] = "sent (read back after a failed call)"
                    return record
                continue
            record["seq"] = event.seq
            return record

    def _kept(self, run_id: str, n: int) -> int | None:
        """The seq of the event with send number ``n`` the store kept for ``run_id``: read
        twice, 2 s apart (a primary just elected may not show a write acknowledged by the
        old one for a moment: the harness's reads of runs saw that once)."""
        for attempt in range(2):
            if attempt:
                time.sleep(2.0)
            try:
                events = as_a_client(lambda: self.chaos.pikku.list_events(run_id))
            except Exception as exc:  # not known yet: the caller tries again
                print(f"chaos: reading the events of {run_id} back failed: {exc!r}",
                      flush=True)
                continue
            seq: int | None = next((e.seq for e in events if isinstance(e.payload, dict)
                                    and e.payload.get("n") == n), None)
            if seq is not None:
                return seq
        return None

    # --- the schedule and the end -------------------------------------------------------------

    def collect_ticks(self, specs: dict[str, dict[str, Any]]) -> list[str]:
        """The runs the schedule's ticks started since the last look."""
        db = self.chaos.pikku.engine.store.db
        found = as_a_client(lambda: [d["_id"] for d in db[keys.RUNS].find(
            {"schedule": self.chaos.TICK_SCHEDULE}, {"_id": 1})])
        new = [r for r in found if r not in self.ticks_seen]
        for run_id in new:
            self.ticks_seen.add(run_id)
            specs.setdefault(run_id, {"kind": "ticked", "expect": "completed"})
        return new

    def finish(self, specs: dict[str, dict[str, Any]]) -> None:
        """The operations queued so far made (each at its time, the sender thread going
        on), the schedule paused, its last ticks collected."""
        deadline = time.monotonic() + FINISH_S
        while time.monotonic() < deadline:
            with self.lock:
                if not self.ops:
                    break
            time.sleep(0.2)
        self.stop.set()
        self.sender.join()
        self.run_due(everything=True)
        as_a_client(lambda: self.chaos.pikku.pause_schedule(self.chaos.TICK_SCHEDULE))
        self.paused_ms = int(time.time() * 1000)
        time.sleep(3.0)  # a ticker round that read the schedule before the pause ends
        self.collect_ticks(specs)
        specs.update(self.take_specs())

    def schedule_facts(self) -> dict[str, Any]:
        every = os.environ.get("CHAOS_TICK_EVERY", "2s")
        return {"name": self.chaos.TICK_SCHEDULE, "every_ms": to_ms(every),
                "paused_ms": self.paused_ms}
