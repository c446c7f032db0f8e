"""Schedules on real ``celery -A`` workers and the real MongoDB replica set (issue 26,
item 2): a 2 s schedule fired by two workers, one of them killed, then the other killed and
a third started: every tick of the whole time starts exactly one run (none twice, none
skipped), each run knows its tick (``wf.scheduled_for``), and no beat process runs."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone

import pytest

from pikku_celery.model import keys
from tests.integration import scheduleapp
from tests.integration.test_celery_workers import ROOT, Cluster, Worker, make_cluster, wait_for

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

__all__ = ["make_cluster"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]
EVERY_MS = 2000


def _start(c: Cluster, name: str) -> Worker:
    """``Cluster.start`` for the schedule app's module."""
    name = f"{name}-{uuid.uuid4().hex[:6]}"
    log_path = c.logdir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.integration.scheduleapp", "worker",
             "-P", "threads", "-c", "2", "-Q", c.queue, "-n", f"{name}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat",
             "--loglevel", "INFO"],
            cwd=ROOT, env=c.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    worker = Worker(name, "threads", proc, log_path)
    c.workers.append(worker)
    return worker


def _ticks(c: Cluster) -> list[int]:
    runs = c.pikku.list_runs(workflow="ticked", limit=1000)
    found = []
    for run in runs:
        tick = keys.scheduled_tick(run.run_id)
        assert tick is not None and tick[0] == scheduleapp.SCHEDULE, run.run_id
        found.append(tick[1])
    return sorted(found)


def _started_lines(worker: Worker) -> list[str]:
    return re.findall(r"tick \S+ started run (\S+)", worker.log())


def _wait_ticks(c: Cluster, n: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(ticks := _ticks(c)) < n:
        if time.monotonic() > deadline:
            pytest.fail(f"{len(ticks)} ticks fired, waited for {n}\n{c.diagnostics()}")
        time.sleep(0.1)
    return ticks


def test_a_2s_schedule_on_two_workers_one_killed_each_tick_runs_once(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis")
    c.app = scheduleapp.build(c.env)  # the test side declares the schedule too
    c.pikku = c.app.pikku
    first, second = _start(c, "sched-a"), _start(c, "sched-b")
    c.wait_ready(first, second)
    _wait_ticks(c, 3, 20)
    both_ran = _ticks(c)
    first.kill()
    killed_at = len(both_ran)
    _wait_ticks(c, killed_at + 3, 20)  # the other fires on
    second.kill()  # no worker: ticks fall due meanwhile; a new worker starts them
    time.sleep(2.5)
    third = _start(c, "sched-c")
    c.wait_ready(third)
    after_restart = _wait_ticks(c, len(_ticks(c)) + 3, 25)
    end = after_restart[-1]

    # Every tick of the whole time started one run: none twice, none skipped, across the
    # kill, the time with no worker and the restart.
    ticks = [t for t in _ticks(c) if t <= end]
    assert ticks == list(range(ticks[0], end + 1, EVERY_MS)), (ticks, c.diagnostics())
    assert len(ticks) >= 9
    # Each run created once: the workers' "started run" lines name each run once.
    lines = [r for w in c.workers for r in _started_lines(w)]
    assert len(lines) == len(set(lines)), lines
    assert _started_lines(third), "the restarted worker fired no tick"
    # Each run knows its tick and ran to its end.
    for tick in ticks:
        run_id = keys.scheduled_run_id(scheduleapp.SCHEDULE, tick)
        run = c.wait(run_id, 30)
        when = datetime.fromtimestamp(tick / 1000, tz=UTC)
        assert run.status == "completed", (run, c.diagnostics())
        assert run.schedule == scheduleapp.SCHEDULE and run.scheduled_for == when
        assert run.output["scheduled_for"] == when.isoformat()
    stored = c.pikku.get_schedule(scheduleapp.SCHEDULE)
    assert stored.last_at is not None and stored.next_at > stored.last_at


def test_ticks_missed_while_no_worker_ran_start_only_the_latest_after_a_restart(
        make_cluster: Callable[..., Cluster]) -> None:
    """``catch_up="latest"`` (the default): every worker stopped for longer than a missed
    tick's 10 s of grace, a restarted worker starts the most recent missed tick only, says
    so, and goes on on time."""
    c = make_cluster("redis", **{scheduleapp.ENV_CATCH_UP: "latest"})
    c.app = scheduleapp.build(c.env)
    c.pikku = c.app.pikku
    first = _start(c, "sched-a")
    c.wait_ready(first)
    before = _wait_ticks(c, 2, 20)
    first.kill()
    stopped_at = time.time()
    time.sleep(16)  # 8 ticks fall due; the oldest are more than 10 s overdue by the restart
    second = _start(c, "sched-b")
    c.wait_ready(second)
    after = _wait_ticks(c, len(before) + 3, 25)
    last_before = max(t for t in after if t <= stopped_at * 1000)
    resumed = [t for t in after if t > last_before]
    missed = (resumed[0] - last_before) // EVERY_MS - 1
    assert missed >= 3, (after, c.diagnostics())  # skipped, not started
    # After the one catch-up tick, every tick on time again, each once.
    assert resumed == list(range(resumed[0], resumed[-1] + 1, EVERY_MS)), resumed
    assert "skipped (catch_up='latest')" in second.log(), second.log()[-3000:]
    # Each run started once: the workers' "started run" lines (written after the run, so
    # waited for) name every tick read above, none twice (later ticks may have fired since).
    expected = {keys.scheduled_run_id(scheduleapp.SCHEDULE, t) for t in after}
    def logged() -> list[str] | None:
        found = _started_lines(first) + _started_lines(second)
        return found if expected <= set(found) else None
    lines = wait_for(logged, 10, "the workers to log every tick's run", c.diagnostics)
    assert len(lines) == len(set(lines)), lines
