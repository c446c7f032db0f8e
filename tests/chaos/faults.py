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
from dataclasses import dataclass, field
from typing import Any

from tests.chaos.cluster import Cluster, Worker
from tests.chaos.ledger import read_ledger

KINDS = {  # kind -> weight
    "kill_worker": 3,
    "kill_orchestrator": 2,
    "kill_child": 2,
    "pause_worker": 2,
    "duplicate_step": 3,
    "duplicate_orchestrate": 2,
    "restart_redis": 1,
    "restart_mongo": 1,
}


@dataclass
class FaultEvent:
    kind: str
    t: float
    pids: set[int] = field(default_factory=set)
    detail: str = ""


class FaultInjector:
    def __init__(self, cluster: Cluster, pikku: Any, app: Any, seed: int, pools: list[str],
                 lease_s: float) -> None:
        self.cluster = cluster
        self.pikku = pikku
        self.app = app
        self.rng = random.Random(seed)
        self.pools = pools
        self.lease_s = lease_s
        self.events: list[FaultEvent] = []
        self.counts: Counter[str] = Counter()
        self._paused: set[str] = set()
        self.last_choice = ""

    def inject(self, run_ids: list[str]) -> FaultEvent | None:
        kinds, weights = zip(*KINDS.items(), strict=True)
        kind = self.rng.choices(kinds, weights)[0]
        event = getattr(self, f"_{kind}")(run_ids)
        if event is not None:
            self.events.append(event)
            self.counts[kind] += 1
        return event

    # --- faults ---------------------------------------------------------------------------

    def _victim(self) -> Worker | None:
        """A live worker, preferably one in the middle of a step body (from the ledger),
        so that kills and pauses land mid-step rather than on an idle process."""
        live = [w for w in self.cluster.live_workers() if w.name not in self._paused]
        if len(live) < 2:
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
        new = self.cluster.start_worker(worker.pool, worker.skew_s)
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
        self.app.tasks["pikku.orchestrate"].apply_async((run_id,))
        return FaultEvent("duplicate_orchestrate", time.monotonic(), detail=run_id)

    def _restart_redis(self, run_ids: list[str]) -> FaultEvent | None:
        self.cluster.restart_redis()
        return FaultEvent("restart_redis", time.monotonic())

    def _restart_mongo(self, run_ids: list[str]) -> FaultEvent | None:
        self.cluster.restart_mongo()
        return FaultEvent("restart_mongo", time.monotonic())
