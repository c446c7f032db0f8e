"""Run a chaos profile: real workers, real Redis and broker, a real 3-node MongoDB replica
set, faults injected at random moments from a seed; then check the store against the ledger.

    python -m tests.chaos.run --profile short|full [--seed N] [--broker redis|amqp]

Exits 0 when the checker found no violation. ``--profile full`` is the published run of
docs/reliability.md; ``short`` runs in CI (tests/chaos/test_chaos_short.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pikku_celery import keys
from pikku_celery.durations import to_ms
from pikku_celery.errors import WorkflowEventError
from tests.chaos.checker import Report, check
from tests.chaos.cluster import Cluster
from tests.chaos.faults import FaultEvent, FaultInjector
from tests.chaos.ledger import read_ledger

LEASE_S = 2.0
REAPER_S = 0.5
RUN_LEASE_S = 3.0
STALLED_S = 3.0


@dataclass(frozen=True)
class Profile:
    runs: int
    faults: int
    workers: int
    fault_interval_s: float
    drain_s: float
    live_runs: int = 12
    fatal_every: int = 7
    cancel_every: int = 25
    skewed_worker_s: float = 120.0
    reaper_s: float = REAPER_S
    # Issue 26's primitives in the mix: runs that wait for events the driver sends during
    # the faults, runs of a workflow limited per key (several runs per key, so they queue),
    # and the chaos app's schedule, whose ticks start runs throughout.
    event_runs: int = 6
    limited_keys: int = 3
    limited_per_key: int = 3


# The drain is how long runs get to end once the faults stop: a run still going then is
# stuck. Every step recovers within step_lease + reaper + a MongoDB election (seconds), so
# two and a half minutes is generous for both; it used to be 900 s for the full profile,
# because the nx-27017 stand-in worked through a 500-run backlog at whole-collection scans.
PROFILES = {
    "short": Profile(runs=40, faults=25, workers=3, fault_interval_s=1.6, drain_s=150),
    "full": Profile(runs=500, faults=150, workers=4, fault_interval_s=2.5, drain_s=150,
                    live_runs=30, event_runs=40, limited_keys=4, limited_per_key=10),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="short")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--broker", choices=["redis", "amqp"], default="redis")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    print(f"chaos: profile {args.profile}, seed {seed}, broker {args.broker}", flush=True)
    started = time.monotonic()
    report = run(PROFILES[args.profile], seed, args.broker, keep=args.keep)
    print(report.summary())
    print(f"chaos: {time.monotonic() - started:.0f}s; reproduce with: python -m tests.chaos.run "
          f"--profile {args.profile} --seed {seed} --broker {args.broker}")
    return 1 if report.violations else 0


def _as_a_client(call: Any, patience_s: float = 60.0) -> Any:
    """The harness's own reads and starts, as an application would make them: a MongoDB
    restart (one of the faults) makes a call fail for a few seconds; retry it. Starts are
    given their run id, so a retried start is idempotent. A run the harness started may also
    read as missing for a moment just after an election (seen once, seed 20261203, right
    after a step-down: the new primary's majority snapshot can trail the old primary's
    acknowledged writes until it learns the commit point); that is retried and printed."""
    from pymongo.errors import ConnectionFailure

    from pikku_celery.errors import WorkflowRunNotFoundError

    deadline = time.monotonic() + patience_s
    while True:
        try:
            return call()
        except ConnectionFailure:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
        except WorkflowRunNotFoundError as exc:
            if time.monotonic() > deadline:
                raise
            print(f"chaos: {exc} (a run the harness started): read again", flush=True)
            time.sleep(0.5)


def _start(chaos: Any, spec: dict[str, Any]) -> str:
    run_id = str(uuid.uuid4())
    return str(_as_a_client(lambda: chaos.pikku.start("chaos.order", spec, run_id=run_id)))


def run(profile: Profile, seed: int, broker: str, *, keep: bool = False) -> Report:
    workdir = Path(tempfile.mkdtemp(prefix="pikku-chaos-"))
    cluster = Cluster(workdir, broker)
    try:
        cluster.start_redis()
        cluster.start_mongo()
        os.environ["CHAOS_REAPER_S"] = str(profile.reaper_s)
        os.environ.update(cluster.env())
        chaos = importlib.import_module("tests.chaos.chaosapp")
        pools = ["prefork", "threads"]
        for i in range(profile.workers):
            cluster.start_worker(pools[i % 2])
        cluster.start_worker("threads", skew_s=profile.skewed_worker_s)
        for worker in cluster.workers:
            cluster.wait_ready(worker)
        return _drive(cluster, chaos, profile, seed)
    finally:
        if keep:
            cluster.keep_mongo_logs()
        cluster.stop()
        if not keep:
            cluster.cleanup()
        else:
            print(f"chaos: work directory kept at {workdir}")


def _drive(cluster: Cluster, chaos: Any, profile: Profile, seed: int) -> Report:
    """Runs are fed at a steady pace while faults land, so that faults hit in-flight work
    (not an idle cluster, nor a backlog that hides recovery times); then everything drains."""
    rng = random.Random(seed)
    wall_offset_s = time.time() - time.monotonic()  # to place faults on the store's clock
    specs: dict[str, dict[str, Any]] = {}
    pending = [{"order": n, "fatal": n % profile.fatal_every == profile.fatal_every - 1,
                "fail_until": rng.choice([1, 2, 3]), "slow_s": rng.uniform(0.5, 2.5)}
               for n in range(profile.runs)]
    injector = FaultInjector(cluster, chaos.pikku, chaos.app, seed, ["prefork", "threads"],
                             LEASE_S)
    cancelled: dict[str, tuple[int, int]] = {}  # run id -> wall ms before/after the cancel
    ended: set[str] = set()
    crashes: list[FaultEvent] = []
    mix = Mix(chaos, profile, random.Random(seed + 26))
    mix.start_sender()
    begun = time.monotonic()
    # The fault period takes longer than faults x interval (a whole-set MongoDB restart
    # blocks the loop, a loaded machine slows it); twice that is the most it may take.
    deadline = begun + 2 * profile.faults * profile.fault_interval_s
    while len(injector.events) < profile.faults and time.monotonic() < deadline:
        # Runs start in step with the faults applied, not with the clock, so the last runs
        # start with the last faults and no fault lands on a cluster that ran out of work
        # (paced by the clock, the loop's overrun left the last 50 s of a full run idle);
        # never more than ``live_runs`` at once, so no backlog builds.
        due = profile.runs * (len(injector.events) + 1) / profile.faults
        # An ended run stays ended: only the others are read again.
        ended.update(r for r in specs if r not in ended
                     and _as_a_client(lambda r=r: chaos.pikku.get_run(r)).is_terminal)
        live = [r for r in specs if r not in ended]
        orders = [r for r in live if specs[r].get("kind", "order") == "order"]
        started = len([r for r in specs if specs[r].get("kind", "order") == "order"])
        while pending and started < due + 1 and len(orders) < profile.live_runs:
            spec = pending.pop(0)
            run_id = _start(chaos, spec)
            specs[run_id] = spec
            live.append(run_id)
            orders.append(run_id)
            started += 1
        # issue 26's runs, at their own pace: all started by 80% of the faults
        live += mix.start_due(specs, (len(injector.events) + 1) / (0.8 * profile.faults))
        time.sleep(rng.expovariate(1 / profile.fault_interval_s))
        _supervise(cluster, crashes)
        live += mix.collect_ticks(specs)
        live = live or list(specs)
        _maybe_cancel(chaos, rng, live, profile, cancelled)
        failed_before = len(injector.not_applied)
        event = injector.inject(live)
        for failure in injector.not_applied[failed_before:]:  # reported, never swallowed
            print(f"chaos: fault failed to apply: {failure}", flush=True)
        specs.update(injector.extra_specs)
        cancelled.update(injector.cancelled)
        if event is not None:
            print(f"chaos: t+{event.t - begun:5.1f}s {event.kind} {event.detail}", flush=True)
    if len(injector.events) < profile.faults:
        print(f"chaos: the fault period ran out of time after {len(injector.events)} of "
              f"{profile.faults} faults", flush=True)
    for spec in pending:
        specs[_start(chaos, spec)] = spec
    mix.start_due(specs, 1.0)
    mix.finish(specs)  # the last events sent, the schedule paused, its last ticks collected
    drain_deadline = time.monotonic() + profile.drain_s
    _drain(chaos, list(specs), drain_deadline, lambda: _supervise(cluster, crashes))
    mix.collect_ticks(specs)  # a tick fired by a round that read the schedule before the pause
    _drain(chaos, list(specs), drain_deadline, lambda: _supervise(cluster, crashes))
    _settle_down(injector)
    cancelled.update(mix.cancelled)
    ledger = read_ledger(cluster.workdir / "ledger")
    time.sleep(1.0)  # a refusal is logged just after its body's ledger line
    logs = [w.log.read_text(errors="replace") for w in cluster.workers]
    not_applied = injector.not_applied + [f"{kind}: never applied in this run"
                                          for kind in injector.required_left]
    report = check(chaos.pikku, specs, set(cancelled), ledger, injector.events + crashes, logs,
                   recovery_bound_s=LEASE_S + profile.reaper_s + 10.0,
                   pass_bound_s=RUN_LEASE_S + STALLED_S + 10.0,
                   alive_pids=_alive_pids(), wall_offset_s=wall_offset_s,
                   not_applied=not_applied, require_fence=True, cancel_times=cancelled,
                   sent_events=mix.sent, schedule=mix.schedule_facts())
    report.worker_crashes = len(crashes)
    report.rollbacks, report.rolled_back = cluster.rollbacks()
    return report


class Mix:
    """Issue 26's primitives in the mix: runs of ``chaos.awaiter`` and the events the driver
    sends them (right after the start, so before the run waits, or seconds later; some
    twice with one key), runs of ``chaos.limited`` (a few keys, several runs each: they
    queue), and the runs the chaos app's schedule starts (collected as they appear)."""

    def __init__(self, chaos: Any, profile: Profile, rng: random.Random) -> None:
        self.chaos = chaos
        self.rng = rng
        # Runs started together: an events run alone; limited runs in bursts of up to three
        # per key, so each key has runs queued behind the one running.
        self.plan: list[list[dict[str, Any]]] = []
        events = [[self._events_spec(n)] for n in range(profile.event_runs)]
        limited = [{"kind": "limited", "expect": "completed", "key": f"k{k}",
                    "order": 1000 + r * profile.limited_keys + k,
                    "slow_s": round(rng.uniform(0.3, 1.2), 2)}
                   for r in range(profile.limited_per_key) for k in range(profile.limited_keys)]
        batch = 3 * profile.limited_keys
        bursts = [limited[i:i + batch] for i in range(0, len(limited), batch)]
        while events or bursts:
            if bursts:
                self.plan.append(bursts.pop(0))
            for _ in range(max(1, len(events) // max(1, len(bursts) + 1))):
                if events:
                    self.plan.append(events.pop(0))
        self.total = len(self.plan)
        # due, run, event name (None: cancel the run), key; sent from a thread of their own,
        # so sends land in the middle of faults (a MongoDB election, a Redis restart)
        self.sends: list[tuple[float, str, str | None, str | None]] = []
        self.sent: list[dict[str, Any]] = []  # every send, as the checker reads it
        self.cancelled: dict[str, tuple[int, int]] = {}  # runs the mix cancelled, as _drive's
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.sender = threading.Thread(target=self._sender, name="chaos-sender", daemon=True)
        self.counter = 0
        self.ticks_seen: set[str] = set()
        self.paused_ms: int | None = None

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
                self.send_due()
            except Exception as exc:  # reported, never swallowed: its run may never end
                print(f"chaos: the mix's sender failed: {exc!r}", flush=True)
            self.stop.wait(0.05)

    def start_due(self, specs: dict[str, dict[str, Any]], progress: float) -> list[str]:
        started = []
        while self.plan and self.total - len(self.plan) < min(1.0, progress) * self.total + 1:
            burst = self.plan.pop(0)
            if len(burst) > 1 and self.rng.random() < 0.5:  # one run of the burst cancelled,
                burst[self.rng.randrange(len(burst))]["cancel_after_s"] = round(  # queued
                    self.rng.uniform(0.0, 2.0), 2)                               # or not
            for spec in burst:
                workflow = "chaos.awaiter" if spec["kind"] == "events" else "chaos.limited"
                run_id = str(uuid.uuid4())
                _as_a_client(lambda w=workflow, s=spec, r=run_id: self.chaos.pikku.start(
                    w, s, run_id=r))
                specs[run_id] = spec
                started.append(run_id)
                if spec["kind"] == "events":
                    self._plan_sends(run_id, spec)
                elif "cancel_after_s" in spec:
                    self._queue(time.monotonic() + spec["cancel_after_s"], run_id, None, None)
        return started

    def _queue(self, due: float, run_id: str, name: str | None, key: str | None) -> None:
        with self.lock:
            self.sends.append((due, run_id, name, key))
            self.sends.sort(key=lambda s: s[0])

    def _plan_sends(self, run_id: str, spec: dict[str, Any]) -> None:
        """One event per wait that has no timeout, in the order of the waits: the first
        ones at once (before the run reaches its wait), the rest over the next seconds;
        some keyed and sent twice."""
        now = time.monotonic()
        due = now
        for i, (name, timeout) in enumerate(spec["waits"]):
            if timeout is not None:
                continue
            if i > 0 and self.rng.random() < 0.6:
                due += self.rng.uniform(0.5, 4.0)
            key = f"{run_id[:8]}-{i}" if self.rng.random() < 0.4 else None
            self._queue(due, run_id, name, key)
            if key is not None:  # the same key again, later: delivered once
                self._queue(due + self.rng.uniform(0.0, 3.0), run_id, name, key)
        if self.rng.random() < 0.15:  # cancelled while it waits: its later sends are refused
            spec["cancel_after_s"] = round(self.rng.uniform(0.0, due - now + 1.0), 2)
            self._queue(now + spec["cancel_after_s"], run_id, None, None)

    def send_due(self, everything: bool = False) -> None:
        now = time.monotonic()
        while True:
            with self.lock:
                if not self.sends or not (everything or self.sends[0][0] <= now):
                    return
                _, run_id, name, key = self.sends.pop(0)
            if name is None:
                self._cancel(run_id)
                continue
            record = self._send(run_id, name, key)
            with self.lock:
                self.sent.append(record)

    def _cancel(self, run_id: str) -> None:
        before = int(time.time() * 1000)
        self.cancelled[run_id] = (before, 2**62)  # until it returns, in case it never does
        _as_a_client(lambda: self.chaos.pikku.cancel(run_id, "chaos mix cancel"))
        self.cancelled[run_id] = (before, int(time.time() * 1000))

    def _send(self, run_id: str, name: str, key: str | None) -> dict[str, Any]:
        """One send, as an application makes it: retried while the store or the broker does
        not answer (a retry of a send without a key may keep the event twice: the record
        says so, ``ambiguous``)."""
        with self.lock:
            first = [sent for sent in self.sent if sent["run"] == run_id and sent["key"] == key
                     and key is not None]
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
                continue
            record["seq"] = event.seq
            return record

    def collect_ticks(self, specs: dict[str, dict[str, Any]]) -> list[str]:
        """The runs the schedule's ticks started since the last look."""
        db = self.chaos.pikku.engine.store.db
        found = _as_a_client(lambda: [d["_id"] for d in db[keys.RUNS].find(
            {"schedule": self.chaos.TICK_SCHEDULE}, {"_id": 1})])
        new = [r for r in found if r not in self.ticks_seen]
        for run_id in new:
            self.ticks_seen.add(run_id)
            specs.setdefault(run_id, {"kind": "ticked", "expect": "completed"})
        return new

    def finish(self, specs: dict[str, dict[str, Any]]) -> None:
        self.stop.set()
        self.sender.join()
        self.send_due(everything=True)
        _as_a_client(lambda: self.chaos.pikku.pause_schedule(self.chaos.TICK_SCHEDULE))
        self.paused_ms = int(time.time() * 1000)
        time.sleep(3.0)  # a ticker round that read the schedule before the pause ends
        self.collect_ticks(specs)

    def schedule_facts(self) -> dict[str, Any]:
        every = os.environ.get("CHAOS_TICK_EVERY", "2s")
        return {"name": self.chaos.TICK_SCHEDULE, "every_ms": to_ms(every),
                "paused_ms": self.paused_ms}


def _settle_down(injector: FaultInjector, timeout_s: float = 30.0) -> None:
    """Wait for paused workers to be resumed and their late writes to be tried."""
    give_up = time.monotonic() + timeout_s
    while injector.paused and time.monotonic() < give_up:
        time.sleep(0.2)
    time.sleep(2.0)


def _alive_pids() -> set[int]:
    """Every process alive now: an attempt whose process is gone was killed or crashed."""
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def _supervise(cluster: Cluster, crashes: list[FaultEvent]) -> None:
    for worker in cluster.supervise():
        crashes.append(FaultEvent("worker_crash", time.monotonic(), set(worker.pids),
                                  worker.name))
        print(f"chaos: {worker.name} exited on its own (code {worker.proc.returncode}); "
              "restarted, as a process supervisor would", flush=True)


def _maybe_cancel(chaos: Any, rng: random.Random, live: list[str], profile: Profile,
                  cancelled: dict[str, tuple[int, int]]) -> None:
    if rng.random() < 2 / profile.cancel_every:
        run_id = rng.choice(live)
        before = int(time.time() * 1000)
        cancelled[run_id] = (before, 2**62)  # until it returns, in case it never does
        _as_a_client(lambda: chaos.pikku.cancel(run_id, "chaos cancel"))
        cancelled[run_id] = (before, int(time.time() * 1000))


def _drain(chaos: Any, run_ids: list[str], deadline: float, supervise: Any) -> None:
    pending = list(run_ids)
    while pending and time.monotonic() < deadline:
        supervise()
        pending = [r for r in pending
                   if not _as_a_client(lambda r=r: chaos.pikku.get_run(r)).is_terminal]
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
