"""Run a chaos profile: real workers, real Redis and broker, a real 3-node MongoDB replica
set, faults injected at random moments from a seed; then check the store against the ledger.

    python -m tests.chaos.run --profile short|full [--seed N] [--broker redis|amqp]

Exits 0 when the checker found no violation. ``--profile full`` is the published run of
docs/reliability.md; ``short`` runs in CI (tests/chaos/test_chaos_short.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.chaos.checker import Report, check
from tests.chaos.client import as_a_client as _as_a_client
from tests.chaos.cluster import Cluster
from tests.chaos.faults import FaultEvent, FaultInjector
from tests.chaos.ledger import read_ledger
from tests.chaos.mix import Mix
from tests.chaos.netfaults import NET_KINDS

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
    # Issue 31's operations: runs that wait for an approval (some cancelled while they
    # wait, then retried), retries of failed and cancelled runs (tests/chaos/ops.py), and
    # forks of this share of the completed runs.
    approver_runs: int = 4
    fork_share: float = 0.25


# The drain is how long runs get to end once the faults stop: a run still going then is
# stuck. Every step recovers within step_lease + reaper + a MongoDB election (seconds), so
# two and a half minutes is generous for both; it used to be 900 s for the full profile,
# because the nx-27017 stand-in worked through a 500-run backlog at whole-collection scans.
PROFILES = {
    "short": Profile(runs=40, faults=25, workers=3, fault_interval_s=1.6, drain_s=150),
    "full": Profile(runs=500, faults=150, workers=4, fault_interval_s=2.5, drain_s=150,
                    live_runs=30, event_runs=40, limited_keys=4, limited_per_key=10,
                    approver_runs=20, fork_share=0.1),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="short")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--broker", choices=["redis", "amqp"], default="redis")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--netns", action="store_true",
                        help="every process in a network namespace of its own, and the "
                        "partition faults of issue 37 in the mix (root; Redis broker only)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    print(f"chaos: profile {args.profile}, seed {seed}, broker {args.broker}", flush=True)
    started = time.monotonic()
    profile = PROFILES[args.profile]
    if args.netns:  # room for the seven partition kinds, each required once
        profile = dataclasses.replace(profile, faults=profile.faults + len(NET_KINDS))
    report = run(profile, seed, args.broker, keep=args.keep, netns=args.netns)
    print(report.summary())
    print(f"chaos: {time.monotonic() - started:.0f}s; reproduce with: python -m tests.chaos.run "
          f"--profile {args.profile} --seed {seed} --broker {args.broker}"
          + (" --netns" if args.netns else ""))
    return 1 if report.violations else 0


def _start(chaos: Any, spec: dict[str, Any]) -> str:
    run_id = str(uuid.uuid4())
    return str(_as_a_client(lambda: chaos.pikku.start("chaos.order", spec, run_id=run_id)))


def run(profile: Profile, seed: int, broker: str, *, keep: bool = False,
        netns: bool = False) -> Report:
    workdir = Path(tempfile.mkdtemp(prefix="pikku-chaos-"))
    cluster = Cluster(workdir, broker, netns=netns)
    try:
        cluster.start_redis()
        cluster.start_mongo()
        os.environ["CHAOS_REAPER_S"] = str(profile.reaper_s)
        os.environ.update(cluster.env())
        chaos = importlib.import_module("tests.chaos.chaosapp")
        pools = ["prefork", "threads"]
        for i in range(profile.workers):
            cluster.start_worker(pools[i % 2])
        if netns:
            # The whole process skewed (libfaketime), one ahead and one behind: the
            # skew_clock kind cuts one of them off from Redis.
            cluster.start_worker("threads", faketime="+30s")
            cluster.start_worker("threads", faketime="-30s")
        else:
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
        # An ended run stays ended (only the others are read again), unless a retry ran it
        # again; each end is shown to the mix, which may retry or fork the run.
        ended -= mix.take_revived()
        specs.update(mix.take_specs())
        for run_id in [r for r in specs if r not in ended]:
            run = _as_a_client(lambda r=run_id: chaos.pikku.get_run(r))
            if run.is_terminal:
                ended.add(run_id)
                mix.ended(run_id, specs[run_id], run.status)
        mix.sample()
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
        _merge_cancels(cancelled, injector.cancelled)
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
    _merge_cancels(cancelled, mix.cancelled)
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
                   sent_events=mix.sent, schedule=mix.schedule_facts(),
                   operations=mix.operator.record)
    ops = mix.operator.record
    for run_id in report.stuck:  # what the driver did to it, for the report
        sends = [(r["name"], r["key"], r["n"], r["seq"], r["outcome"]) for r in mix.sent
                 if r["run"] == run_id]
        print(f"chaos: stuck run {run_id}: sends {sends}; cancel {cancelled.get(run_id)}; "
              f"retries {ops.retries.get(run_id)}; approvals {ops.approvals.get(run_id)}; "
              f"{_stored(chaos, run_id)}", flush=True)
    report.worker_crashes = len(crashes)
    report.rollbacks, report.rolled_back = cluster.rollbacks()
    return report


def _stored(chaos: Any, run_id: str) -> str:
    """A stuck run as the store holds it: the run (its inputs and outputs left out), its
    steps not succeeded and its events (their payloads left out)."""
    from pikku_celery.model import keys

    db = chaos.pikku.engine.store.db
    try:
        run = db[keys.RUNS].find_one({"_id": run_id}, {"input": 0, "output": 0, "state": 0})
        steps = list(db[keys.STEPS].find({"run_id": run_id, "status": {"$ne": "succeeded"}},
                                         {"data": 0, "result": 0}))
        events = list(db[keys.EVENTS].find({"run_id": run_id}, {"payload": 0}))
    except Exception as exc:  # a report, not a check: never fails the run
        return f"store unreadable: {exc!r}"
    return f"stored run {run}; open steps {steps}; events {events}"


def _merge_cancels(into: dict[str, tuple[int, int]],
                   other: dict[str, tuple[int, int]]) -> None:
    """Cancels of one run by several hands (the driver, a fault, the mix): the last one
    counts (a retry after it must not have run the run again)."""
    for run_id, times in other.items():
        if run_id not in into or into[run_id][0] <= times[0]:
            into[run_id] = times


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
