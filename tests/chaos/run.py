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
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


# The drain is how long runs get to end once the faults stop: a run still going then is
# stuck. Every step recovers within step_lease + reaper + a MongoDB election (seconds), so
# two and a half minutes is generous for both; it used to be 900 s for the full profile,
# because the nx-27017 stand-in worked through a 500-run backlog at whole-collection scans.
PROFILES = {
    "short": Profile(runs=40, faults=25, workers=3, fault_interval_s=1.6, drain_s=150),
    "full": Profile(runs=500, faults=150, workers=4, fault_interval_s=2.5, drain_s=150,
                    live_runs=30),
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
        while pending and len(specs) < due + 1 and len(live) < profile.live_runs:
            spec = pending.pop(0)
            run_id = _start(chaos, spec)
            specs[run_id] = spec
            live.append(run_id)
        time.sleep(rng.expovariate(1 / profile.fault_interval_s))
        _supervise(cluster, crashes)
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
    _drain(chaos, list(specs), time.monotonic() + profile.drain_s,
           lambda: _supervise(cluster, crashes))
    _settle_down(injector)
    ledger = read_ledger(cluster.workdir / "ledger")
    time.sleep(1.0)  # a refusal is logged just after its body's ledger line
    logs = [w.log.read_text(errors="replace") for w in cluster.workers]
    not_applied = injector.not_applied + [f"{kind}: never applied in this run"
                                          for kind in injector.required_left]
    report = check(chaos.pikku, specs, set(cancelled), ledger, injector.events + crashes, logs,
                   recovery_bound_s=LEASE_S + profile.reaper_s + 10.0,
                   pass_bound_s=RUN_LEASE_S + STALLED_S + 10.0,
                   alive_pids=_alive_pids(), wall_offset_s=wall_offset_s,
                   not_applied=not_applied, require_fence=True, cancel_times=cancelled)
    report.worker_crashes = len(crashes)
    report.rollbacks, report.rolled_back = cluster.rollbacks()
    return report


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
