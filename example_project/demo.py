"""The main job: order workflows on two real ``celery -A example_project worker`` processes.

It starts (or reuses) Redis and a MongoDB-compatible server, starts two workers, runs a batch
of orders with a live progress bar, pauses one worker in the middle of a step until its
lease lapses (the step is reclaimed by the other worker as attempt 2, and the paused
worker's late write is refused when it wakes), then kills that worker outright mid-step
(the step comes back on the surviving worker), prints one run's per-attempt timeline, stops
everything it started and exits 0.

Run it with ``./dev demo`` (or ``python -m example_project.demo --runs 12``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from example_project.stack import Stack

STEP_LEASE_S = 2.0
REAPER_INTERVAL_S = 0.5
COURIER_S = 1.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=12, help="order workflows to run")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to finish in")
    args = parser.parse_args(argv)
    with Stack() as stack:
        for line in stack.started:
            print(f"stack: {line}")
        _configure(stack.redis_url, stack.mongo_url)
        try:
            with Workers(2) as workers:
                return Demo(workers, args.runs, args.timeout).run()
        finally:
            _forget(stack.redis_url)


def _forget(redis_url: str) -> None:
    """Delete this demo's keys (leases, token counters, its queue) from a Redis it may share."""
    import redis

    client = redis.Redis.from_url(redis_url)
    prefix, queue = os.environ["PIKKU_KEY_PREFIX"], os.environ["PIKKU_QUEUE"]
    doomed = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    doomed += list(client.scan_iter(match=f"{queue}*", count=1000))
    if doomed:
        client.delete(*doomed)


def _configure(redis_url: str, mongo_url: str) -> None:
    tag = uuid.uuid4().hex[:8]
    os.environ.update({
        "PIKKU_REDIS_URL": redis_url,
        "PIKKU_MONGO_URL": mongo_url,
        "PIKKU_KEY_PREFIX": f"pikku-demo-{tag}",
        "PIKKU_QUEUE": f"pikku-demo-{tag}",
        "PIKKU_STEP_LEASE": str(STEP_LEASE_S),
        "PIKKU_REAPER_INTERVAL": str(REAPER_INTERVAL_S),
        "PIKKU_COURIER_SECONDS": str(COURIER_S),
        # A killed worker takes its prefetched messages with it (the Redis transport only
        # redelivers them after its visibility timeout): the reaper resends them quickly.
        "PIKKU_UNDISPATCHED_AFTER": "3",
        "PIKKU_STALLED_AFTER": "3",
    })


class Workers:
    """Real ``celery -A example_project worker`` processes, each logging to its own file."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.logdir = Path(tempfile.mkdtemp(prefix="pikku-demo-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> Workers:
        for i in range(1, self.count + 1):
            self.start(f"worker{i}")
        return self

    def start(self, name: str) -> None:
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "example_project", "worker", "-P", "threads",
             "-c", "4", "-n", f"{name}@%h", "--loglevel", "INFO", "--without-gossip",
             "--without-mingle", "--without-heartbeat"],
            stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())

    def name_of(self, pid: int) -> str | None:
        return next((n for n, p in self.procs.items() if p.pid == pid), None)

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


class Demo:
    def __init__(self, workers: Workers, runs: int, timeout: float) -> None:
        from example_project import pikku  # imported after the environment is set

        self.pikku = pikku
        self.workers = workers
        self.runs = runs
        self.deadline = time.monotonic() + timeout
        self._last_bar = ""

    def run(self) -> int:
        run_ids = [self.pikku.start("order", _order(i)) for i in range(self.runs)]
        print(f"started {len(run_ids)} order runs on {self.workers.count} workers "
              f"(step lease {STEP_LEASE_S}s, reaper every {REAPER_INTERVAL_S}s)")
        paused = self._pause_then_resume(run_ids)
        killed = self._kill_mid_step(run_ids, exclude=paused)
        self._progress(run_ids, until_done=True)
        return self._report(run_ids, paused, killed)

    # --- faults ---------------------------------------------------------------------------

    def _busy_courier(self, run_ids: list[str], exclude: str | None) -> tuple[str, str, int]:
        """Wait for a courier step running on a live worker; return (run, worker, pid)."""
        while time.monotonic() < self.deadline:
            for run_id in run_ids:
                if run_id == exclude:
                    continue
                for step in self.pikku.get_steps(run_id):
                    if step.step_name == "courier" and step.status == "running":
                        pid = _worker_pid(step.run_id, self.pikku)
                        name = self.workers.name_of(pid) if pid else None
                        if pid and name and self.workers.procs[name].poll() is None:
                            return run_id, name, pid
            self._progress(run_ids)
            time.sleep(0.05)
        raise SystemExit("demo: no courier step started in time")

    def _pause_then_resume(self, run_ids: list[str]) -> str:
        run_id, name, pid = self._busy_courier(run_ids, exclude=None)
        print(f"\nfault 1: SIGSTOP {name} (pid {pid}) while it runs step 'courier' of run "
              f"{run_id[:8]}; its lease will lapse")
        os.kill(pid, signal.SIGSTOP)
        self._until(lambda: _attempt(self.pikku, run_id, "courier") >= 2, run_ids)
        print(f"\n  -> step 'courier' of run {run_id[:8]} reclaimed as attempt 2 by the other "
              "worker")
        self._until(lambda: _status(self.pikku, run_id, "courier") == "succeeded", run_ids)
        os.kill(pid, signal.SIGCONT)
        print(f"\n  -> SIGCONT {name}: its attempt-1 body finishes and tries to write")
        def refused() -> str | None:
            return next((ln for ln in self.workers.log(name).splitlines()
                         if "WorkflowStepSupersededError" in ln and f"of run {run_id}" in ln
                         and "superseded by" in ln), None)

        self._until(lambda: refused() is not None, run_ids)
        line = refused() or ""
        print(f"  -> late write refused: {line.split('] ', 1)[-1].strip()}")
        return run_id

    def _kill_mid_step(self, run_ids: list[str], exclude: str) -> str | None:
        self.pikku.start("order", _order(999))  # one more run so a courier step is in flight
        more = self.pikku.list_runs(workflow="order", limit=1)[0].run_id
        run_ids.append(more)
        try:
            run_id, name, pid = self._busy_courier(run_ids, exclude=exclude)
        except SystemExit:
            return None
        print(f"\nfault 2: SIGKILL {name} (pid {pid}) in the middle of step 'courier' of run "
              f"{run_id[:8]}")
        attempt = _attempt(self.pikku, run_id, "courier")
        os.kill(pid, signal.SIGKILL)
        self.workers.procs[name].wait(5)
        started = time.monotonic()
        self._until(lambda: _attempt(self.pikku, run_id, "courier") > attempt, run_ids)
        print(f"\n  -> reclaimed as attempt {attempt + 1} after "
              f"{time.monotonic() - started:.1f}s "
              f"(lease {STEP_LEASE_S}s + reaper {REAPER_INTERVAL_S}s); starting a new worker")
        self.workers.start(f"{name}-replacement")
        return run_id

    # --- output ---------------------------------------------------------------------------

    def _until(self, condition: Callable[[], bool], run_ids: list[str]) -> None:
        while not condition():
            if time.monotonic() > self.deadline:
                raise SystemExit("demo: timed out")
            self._progress(run_ids)
            time.sleep(0.1)

    def _progress(self, run_ids: list[str], until_done: bool = False) -> None:
        while True:
            runs = [self.pikku.get_run(r) for r in run_ids]
            done = sum(r.is_terminal for r in runs)
            width = 30
            filled = width * done // len(runs)
            bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{len(runs)} runs ended"
            if bar != self._last_bar:  # redraw in place on a terminal, a line per change else
                sys.stdout.write(("\r" if sys.stdout.isatty() else "\n") + bar)
                sys.stdout.flush()
                self._last_bar = bar
            if not until_done or done == len(runs):
                return
            if time.monotonic() > self.deadline:
                for run in runs:
                    if not run.is_terminal:
                        print(f"\nstuck: run {run.run_id} {run.status}")
                        for st in self.pikku.get_steps(run.run_id):
                            print(f"   {st.step_name} {st.status} attempt {st.attempt} "
                                  f"lease {st.lease_expires_at} due {st.due_at} {st.error}")
                raise SystemExit("\ndemo: timed out waiting for runs to end")
            time.sleep(0.2)

    def _report(self, run_ids: list[str], paused: str, killed: str | None) -> int:
        print()
        runs = [self.pikku.get_run(r) for r in run_ids]
        by_status: dict[str, int] = {}
        for run in runs:
            by_status[run.status] = by_status.get(run.status, 0) + 1
        print("runs by status: " + ", ".join(f"{k} {v}" for k, v in sorted(by_status.items())))
        for run_id in [paused] + ([killed] if killed else []):
            print(f"\ntimeline of run {run_id}:")
            print(format_timeline(self.pikku.get_history(run_id)))
        declined = [r for r in runs if r.status == "failed"]
        if declined:
            print(f"\nrun {declined[0].run_id[:8]} failed as designed (card declined); its "
                  "compensation ran once:")
            print(format_timeline(self.pikku.get_history(declined[0].run_id)))
        stuck = [r for r in runs if not r.is_terminal]
        return 1 if stuck else 0


def format_timeline(history: list[Any]) -> str:
    lines = []
    for h in history:
        took = ""
        if h.started_at and h.ended_at:
            took = f"{(h.ended_at - h.started_at).total_seconds() * 1000:7.0f} ms"
        detail = ""
        if h.error:
            detail = f"{h.error.get('type', '')}: {h.error.get('message', '')}"[:90]
        lines.append(f"  {h.step_name:<22} attempt {h.attempt}  {h.status:<9} {took:>10}  "
                     f"{h.worker or '':<22} {detail}")
    return "\n".join(lines)


def _order(i: int) -> dict[str, Any]:
    return {"order_id": f"o-{i}", "items": ["book"], "amount": 10 + i,
            "card": "declined" if i % 6 == 5 else "visa"}


def _attempt(pikku: Any, run_id: str, step: str) -> int:
    return next((s.attempt for s in pikku.get_steps(run_id) if s.step_name == step), 0)


def _status(pikku: Any, run_id: str, step: str) -> str | None:
    return next((s.status for s in pikku.get_steps(run_id) if s.step_name == step), None)


def _worker_pid(run_id: str, pikku: Any) -> int | None:
    for attempt in reversed(pikku.get_history(run_id)):
        if attempt.step_name == "courier" and attempt.status == "running" and attempt.worker:
            return int(attempt.worker.rsplit(":", 1)[1])
    return None


if __name__ == "__main__":
    sys.exit(main())
