"""The Celery layer on real brokers (Redis, RabbitMQ) and real ``celery -A ... worker``
subprocesses (threads and prefork pools), with the session's real MongoDB (a ``mongod``
replica set) as the store and real Redis leases.

Each test gets its own broker queue, Redis key prefix (broker keys included, through kombu's
``global_keyprefix``) and MongoDB database; workers run in their own process groups so a
SIGKILL/SIGSTOP reaches a prefork pool's children too, and are always stopped afterwards.
The app the workers run is ``tests/integration/workerapp.py``; the test process builds the
same app from the same environment to start runs, read state and publish messages.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest
import redis
from celery import Celery
from celery.worker import WorkController

from pikku_celery import PikkuCelery, StepAttempt
from pikku_celery.worker.tasks import internal_task
from tests.conftest import REDIS_URL
from tests.integration import workerapp as wa
from tests.support.mongod import MongoTarget
from tests.support.raw import entries
from tests.support.redis_cluster import RedisClusterServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
AMQP_URL = os.environ.get("PIKKU_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
BROKERS = {"redis": REDIS_URL, "rabbitmq": AMQP_URL}
STEP_LEASE_S = 1.5
REAPER_S = 0.3
READY_TIMEOUT_S = 30.0
LEASE_EXPIRED = "WorkflowStepLeaseExpiredError"


# --- helpers -----------------------------------------------------------------------------


def wait_for(condition: Callable[[], Any], timeout: float, what: str,
             diagnostics: Callable[[], str] = lambda: "", interval: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something truthy; fail the test on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}\n{diagnostics()}")
        time.sleep(interval)


class Worker:
    """One ``celery worker`` subprocess, leader of its own process group."""

    def __init__(self, name: str, pool: str, proc: subprocess.Popen[bytes],
                 log_path: Path) -> None:
        self.name = name
        self.pool = pool
        self.proc = proc
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def owns(self, pid: int) -> bool:
        """Is ``pid`` this worker or one of its pool processes?"""
        if pid == self.pid:
            return True
        try:
            return os.getpgid(pid) == self.pid
        except ProcessLookupError:
            return False

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)
        self.proc.wait(10)


class Cluster:
    """Workers, the test-side app and the per-test settings they share."""

    def __init__(self, broker: str, env: dict[str, str], db_name: str, logdir: Path,
                 ledger: redis.Redis, ledger_key: str) -> None:
        self.broker = broker
        self.db_name = db_name
        self.env = env
        self.logdir = logdir
        self.queue = env[wa.ENV_QUEUE]
        self.ledger_client = ledger
        self.ledger_key = ledger_key
        self.app: Celery = wa.build(env)
        self.pikku: PikkuCelery = self.app.pikku
        self.workers: list[Worker] = []

    # workers

    def start(self, name: str, pool: str = "threads") -> Worker:
        name = f"{name}-{uuid.uuid4().hex[:6]}"
        log_path = self.logdir / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.integration.workerapp", "worker",
                 "-P", pool, "-c", "2", "-Q", self.queue, "-n", f"{name}@%h",
                 "--without-gossip", "--without-mingle", "--without-heartbeat",
                 "--loglevel", "INFO"],
                cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        worker = Worker(name, pool, proc, log_path)
        self.workers.append(worker)
        return worker

    def wait_ready(self, *workers: Worker, timeout: float = READY_TIMEOUT_S) -> None:
        def ready() -> bool:
            for w in workers:
                if not w.alive():
                    pytest.fail(f"worker {w.name} exited with {w.proc.returncode}:\n{w.log()}")
            return all("ready." in w.log() for w in workers)
        wait_for(ready, timeout, f"workers {[w.name for w in workers]} to be ready",
                 self.diagnostics)

    def wait(self, run_id: str, timeout: float) -> Any:
        """``pikku.wait``, failing with the workers' logs when the run does not end."""
        try:
            return self.pikku.wait(run_id, timeout)
        except TimeoutError as exc:
            steps = [(s.step_name, s.status, s.attempt) for s in self.pikku.get_steps(run_id)]
            pytest.fail(f"{exc}\nsteps: {steps}\n{self.diagnostics()}")

    def holder_of(self, pid: int) -> Worker:
        found = [w for w in self.workers if w.alive() and w.owns(pid)]
        assert len(found) == 1, f"pid {pid} belongs to none (or several) of our workers"
        return found[0]

    def stop_all(self) -> None:
        for w in self.workers:
            if w.alive():
                w.signal_group(signal.SIGCONT)
                w.proc.terminate()
        for w in self.workers:
            try:
                w.proc.wait(5)
            except subprocess.TimeoutExpired:
                w.signal_group(signal.SIGKILL)
                w.proc.wait(5)
            w.signal_group(signal.SIGKILL)  # stray pool processes, if any

    # reads

    def ledger(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.ledger_client.lrange(self.ledger_key, 0, -1)]

    def starts(self) -> list[dict[str, Any]]:
        return [e for e in self.ledger() if e["event"] == "start"]

    def step(self, run_id: str, step_name: str) -> Any:
        found = [s for s in self.pikku.get_steps(run_id) if s.step_name == step_name]
        return found[0] if found else None

    def history(self, run_id: str, step_name: str) -> list[StepAttempt]:
        return sorted((h for h in self.pikku.get_history(run_id) if h.step_name == step_name),
                      key=lambda h: h.attempt)

    def diagnostics(self) -> str:
        parts = [f"ledger: {self.ledger()}"]
        for w in self.workers:
            parts.append(f"--- {w.name} ({w.pool}, pid {w.pid}, alive={w.alive()}) log tail:\n"
                         + "\n".join(w.log().splitlines()[-40:]))
        return "\n".join(parts)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.app.close()
        with contextlib.suppress(Exception):
            self.pikku.engine.store.db.client.close()  # type: ignore[attr-defined]


# A test of a step *task*'s Celery conventions (its log lines, its state, a redelivery of its
# message): every step sent as a task of its own. Steps run in place have their own tests
# (test_in_place.py).
TASK_PER_STEP = {wa.ENV_IN_PLACE: "0"}


@pytest.fixture
def make_cluster(mongo_server: MongoTarget, redis_client: redis.Redis, key_prefix: str,
                 tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(broker: str, **extra_env: str) -> Cluster:
        assert not made, "one cluster per test"
        db_name = f"pikku_it_{uuid.uuid4().hex[:12]}"
        env = {
            **os.environ,
            wa.ENV_BROKER: BROKERS[broker],
            wa.ENV_REDIS: REDIS_URL,
            wa.ENV_MONGO: mongo_server.url_for(db_name),
            wa.ENV_PREFIX: key_prefix,
            wa.ENV_QUEUE: f"pikku-it-{uuid.uuid4().hex[:10]}",
            wa.ENV_STEP_LEASE: str(STEP_LEASE_S),
            wa.ENV_REAPER: str(REAPER_S),
            wa.ENV_UNDISPATCHED: "2",
            wa.ENV_STALLED: "3",
            "PYTHONUNBUFFERED": "1",
            **extra_env,
        }
        cluster = Cluster(broker, env, db_name, tmp_path, redis_client, f"{key_prefix}:ledger")
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        try:
            cluster.stop_all()
        finally:
            cluster.close()
            client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(mongo_server.url)
            with contextlib.suppress(Exception):
                client.drop_database(cluster.db_name)
            client.close()
            if cluster.broker == "rabbitmq":
                _delete_amqp_queue(cluster.queue)


def _delete_amqp_queue(queue: str) -> None:
    from kombu import Connection

    with Connection(AMQP_URL, heartbeat=0) as conn:
        channel = conn.channel()
        for name in (queue, wa.parked_queue(queue)):
            with contextlib.suppress(Exception):
                channel.queue_delete(name)
            with contextlib.suppress(Exception):
                channel.exchange_delete(name)
        with contextlib.suppress(Exception):
            channel.close()


def task_line(worker: Worker, task_id: str, word: str) -> str | None:
    """The worker's log line ``Task <name>[<task_id>] <word>...``, if logged yet."""
    return next((ln for ln in worker.log().splitlines() if f"[{task_id}] {word}" in ln), None)


def attempts(history: list[StepAttempt]) -> list[tuple[int, str]]:
    return [(h.attempt, h.status) for h in history]


def error_type(entry: Any) -> str | None:
    return (entry.error or {}).get("type")


# --- 1. end to end -----------------------------------------------------------------------


@pytest.mark.parametrize(("broker", "pool"), [
    ("redis", "prefork"),
    ("redis", "threads"),
    ("rabbitmq", "threads"),
    ("rabbitmq", "prefork"),
])
def test_workflow_end_to_end(make_cluster: Callable[..., Cluster], broker: str,
                             pool: str) -> None:
    c = make_cluster(broker)
    worker = c.start("e2e", pool)
    c.wait_ready(worker)

    run_id = c.pikku.start("pipeline", {"a": 2, "b": 3, "fail": 1})
    run = c.wait(run_id, 30)

    assert run.status == "completed", (run, c.diagnostics())
    assert run.output == {"total": 5, "left": 6, "right": 7, "flaky": {"ok_on_attempt": 2}}
    history = c.pikku.get_history(run_id)
    keys = [(h.step_name, h.attempt) for h in history]
    assert len(keys) == len(set(keys)), f"one entry per attempt: {keys}"
    for name in ("sum", "left", "right", "nap"):
        assert attempts(c.history(run_id, name)) == [(1, "succeeded")]
    flaky = c.history(run_id, "flaky")
    assert attempts(flaky) == [(1, "failed"), (2, "succeeded")]
    assert error_type(flaky[0]) == "RuntimeError"
    assert "flaky failure on attempt 1" in flaky[0].error["message"]
    assert flaky[1].result == {"ok_on_attempt": 2}
    state = c.step(run_id, "flaky")
    assert (state.status, state.attempt) == ("succeeded", 2)
    # Every attempt names the process that ran it: this worker (or one of its pool
    # processes), by the node name it was started with (-n <name>@%h), and its pid.
    for entry in history:
        if entry.step_name == "nap":
            continue  # a durable sleep runs on no worker
        host, _, pid = (entry.worker or "").rpartition(":")
        assert host == f"{worker.name}@{socket.gethostname()}", entry
        assert worker.owns(int(pid)), entry


def test_step_tasks_use_the_celery_conventions(make_cluster: Callable[..., Cluster]) -> None:
    """Contract section 4, as the worker will see them (the same app, built the same way)."""
    app = make_cluster("redis").app
    for name in (wa.ADD, wa.SLOW, wa.FLAKY, wa.PARKED):
        task = app.tasks[name]
        assert (task.acks_late, task.reject_on_worker_lost, task.serializer) == (
            True, True, "json"), name
    # Prefetch 1 is the workers' own (they consume only pikku's queue), never the app's.
    assert "worker_prefetch_multiplier" not in app.conf.changes
    # Never started: no event loop, or its hub would become kombu's global one for the
    # in-process workers of later tests in this process.
    worker = WorkController(app=app, queues=[app.conf.task_default_queue], pool="solo",
                            use_eventloop=False)
    assert worker.prefetch_multiplier == 1


# --- 2. SIGKILL mid-step -----------------------------------------------------------------


@pytest.mark.parametrize(("broker", "pool"), [("redis", "prefork"), ("rabbitmq", "threads")])
def test_sigkill_mid_step_runs_again_as_attempt_2(make_cluster: Callable[..., Cluster],
                                                  broker: str, pool: str) -> None:
    c = make_cluster(broker)
    # Two workers up before the run: whichever takes the step is killed, the other is the
    # survivor, so the time measured is the library's (lease + reaper), not a start-up's.
    c.wait_ready(c.start("w1", pool), c.start("w2", pool))
    run_id = c.pikku.start("one_slow", {"seconds": 2.0, "ledger": c.ledger_key})

    start1 = wait_for(lambda: c.starts(), 20, "the slow step to start", c.diagnostics)[0]
    assert start1["attempt"] == 1
    doomed = c.holder_of(start1["pid"])
    running = c.history(run_id, "slow")
    assert attempts(running) == [(1, "running")]
    assert doomed.owns(int(running[0].worker.rpartition(":")[2]))

    killed_at = time.monotonic()
    doomed.kill()
    c.start("late-joiner", pool)  # a worker joining later changes nothing
    start2 = wait_for(lambda: [s for s in c.starts() if s["attempt"] == 2],
                      STEP_LEASE_S + REAPER_S + 5, "attempt 2 of the killed step",
                      c.diagnostics)[0]
    reclaimed_after = time.monotonic() - killed_at
    print(f"[{broker}/{pool}] killed step started again as attempt 2 after "
          f"{reclaimed_after:.2f}s (lease {STEP_LEASE_S}s + reaper {REAPER_S}s)")
    assert reclaimed_after < STEP_LEASE_S + REAPER_S + 5

    run = c.wait(run_id, 20)
    assert run.status == "completed", (run, c.diagnostics())
    assert run.output["slow"]["attempt"] == 2
    assert run.output["after"] == 102
    history = c.history(run_id, "slow")
    assert attempts(history) == [(1, "failed"), (2, "succeeded")]
    assert error_type(history[0]) == LEASE_EXPIRED
    assert history[1].result == {"attempt": 2, "pid": start2["pid"]}
    # Written, not inferred: the reclaim wrote attempt 1's entry (get_history would fill it in).
    assert entries(c.pikku.engine.store, run_id, "slow") == [(1, "failed"), (2, "succeeded")]
    assert not doomed.owns(start2["pid"])
    state = c.step(run_id, "slow")
    assert (state.status, state.attempt) == ("succeeded", 2)
    ledger = c.ledger()
    assert [(e["attempt"], e["event"]) for e in ledger] == [(1, "start"), (2, "start"),
                                                            (2, "end")]
    assert {e["invocation_id"] for e in ledger} == {state.invocation_id}


# --- 3. SIGSTOP past the lease: the late write is refused --------------------------------


def test_paused_worker_is_superseded_and_its_late_write_refused(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis", **TASK_PER_STEP)
    w1, w2 = c.start("a"), c.start("b")
    c.wait_ready(w1, w2)
    run_id = c.pikku.start("one_slow", {"seconds": 2.5, "ledger": c.ledger_key})

    start1 = wait_for(lambda: c.starts(), 20, "the slow step to start", c.diagnostics)[0]
    paused = c.holder_of(start1["pid"])
    other = w2 if paused is w1 else w1
    paused.signal_group(signal.SIGSTOP)
    try:
        wait_for(lambda: [s for s in c.starts() if s["attempt"] == 2],
                 STEP_LEASE_S + REAPER_S + 5, "the other worker to reclaim the step",
                 c.diagnostics)
        run = c.wait(run_id, 15)
        assert run.status == "completed", (run, c.diagnostics())
        steps_before = c.pikku.get_steps(run_id)
        history_before = c.pikku.get_history(run_id)
    finally:
        paused.signal_group(signal.SIGCONT)

    def refused_line() -> str | None:
        return next((ln for ln in paused.log().splitlines()
                     if "WorkflowStepSupersededError" in ln and run_id in ln
                     and "'slow'" in ln), None)
    line = wait_for(refused_line, 15, "the late write to be refused", c.diagnostics)
    assert "attempt 1" in line and "attempt 2" in line, line
    assert "WorkflowStepSupersededError" not in other.log()
    # Celery records the task as ending with the expected error: no traceback noise.
    celery_line = wait_for(lambda: next((ln for ln in paused.log().splitlines()
                                         if f"Task {wa.SLOW}[" in ln and " raised " in ln),
                                        None), 5, "Celery's line for the late task",
                           c.diagnostics)
    assert "raised expected: WorkflowStepSupersededError(" in celery_line, celery_line
    assert "Traceback" not in paused.log()

    # The refused write changed nothing: the step, its history and the run are attempt 2's.
    assert c.pikku.get_steps(run_id) == steps_before
    assert c.pikku.get_history(run_id) == history_before
    state = c.step(run_id, "slow")
    assert (state.status, state.attempt) == ("succeeded", 2)
    assert other.owns(state.result["pid"]) and state.result["attempt"] == 2
    assert c.pikku.get_run(run_id).output["slow"] == state.result
    history = c.history(run_id, "slow")
    assert attempts(history) == [(1, "failed"), (2, "succeeded")]
    assert error_type(history[0]) == LEASE_EXPIRED
    assert entries(c.pikku.engine.store, run_id, "slow") == [(1, "failed"), (2, "succeeded")]

    ledger = wait_for(lambda: (lg := c.ledger()) and len(lg) == 4 and lg, 5,
                      "both bodies to end", c.diagnostics)
    by_attempt = {(e["attempt"], e["event"]): e for e in ledger}
    assert set(by_attempt) == {(1, "start"), (1, "end"), (2, "start"), (2, "end")}
    assert by_attempt[(1, "end")]["lease_lost"] is True, "the late body was not told"
    assert by_attempt[(2, "end")]["lease_lost"] is False
    assert paused.owns(by_attempt[(1, "end")]["pid"])


def test_a_late_write_landing_while_the_new_attempt_runs_is_refused(
        make_cluster: Callable[..., Cluster]) -> None:
    """The paused worker wakes while attempt 2 still runs, so its write reaches a step that
    is ``running`` again: only the attempt in the settle filter can refuse it (when it wakes
    after attempt 2 settled, the status alone would). Attempt 2's result must stand."""
    c = make_cluster("redis")
    w1, w2 = c.start("a"), c.start("b")
    c.wait_ready(w1, w2)
    run_id = c.pikku.start("one_slow", {"seconds": 8.0, "ledger": c.ledger_key})

    start1 = wait_for(lambda: c.starts(), 20, "the slow step to start", c.diagnostics)[0]
    paused = c.holder_of(start1["pid"])
    paused.signal_group(signal.SIGSTOP)
    try:
        wait_for(lambda: [s for s in c.starts() if s["attempt"] == 2],
                 STEP_LEASE_S + REAPER_S + 5, "the other worker to reclaim the step",
                 c.diagnostics)
    finally:
        paused.signal_group(signal.SIGCONT)  # attempt 2 has ~8 s left to run

    def refused_line() -> str | None:
        return next((ln for ln in paused.log().splitlines()
                     if "WorkflowStepSupersededError" in ln and run_id in ln
                     and "'slow'" in ln), None)
    line = wait_for(refused_line, 15, "the late write to be refused", c.diagnostics)
    assert "attempt 1" in line and "attempt 2" in line, line
    ledger = c.ledger()
    assert (1, "end") in [(e["attempt"], e["event"]) for e in ledger], ledger
    assert (2, "end") not in [(e["attempt"], e["event"]) for e in ledger], (
        "attempt 2 settled before the late write: this test did not race them")
    state = c.step(run_id, "slow")
    assert (state.status, state.attempt, state.result) == ("running", 2, None), state

    run = c.wait(run_id, 20)
    assert run.status == "completed", (run, c.diagnostics())
    state = c.step(run_id, "slow")
    assert (state.status, state.attempt) == ("succeeded", 2)
    assert state.result["attempt"] == 2 and not paused.owns(state.result["pid"])
    assert run.output["slow"] == state.result
    assert entries(c.pikku.engine.store, run_id, "slow") == [(1, "failed"), (2, "succeeded")]


# --- 4. duplicate publish under a live lease ---------------------------------------------


def test_duplicate_message_does_not_rob_a_live_worker(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis")
    worker = c.start("solo")
    c.wait_ready(worker)
    run_id = c.pikku.start("one_slow", {"seconds": 3.0, "ledger": c.ledger_key})
    wait_for(lambda: c.starts(), 20, "the slow step to start", c.diagnostics)

    duplicate = c.app.tasks[wa.SLOW].apply_async((run_id, "slow"))
    wait_for(lambda: task_line(worker, duplicate.id, "ignored"), 10,
             "the duplicate to be handled", c.diagnostics)
    assert not [e for e in c.ledger() if e["event"] == "end"], \
        "the duplicate must be handled while the first delivery still runs"
    state = c.step(run_id, "slow")
    assert (state.status, state.attempt) == ("running", 1)

    run = c.wait(run_id, 15)
    assert run.status == "completed", (run, c.diagnostics())
    assert run.output["slow"]["attempt"] == 1
    assert [(e["attempt"], e["event"]) for e in c.ledger()] == [(1, "start"), (1, "end")]
    assert attempts(c.history(run_id, "slow")) == [(1, "succeeded")]

    # A redelivery for the settled step runs nothing and writes nothing to the run; its
    # task reports the recorded outcome (issue 12).
    steps, history = c.pikku.get_steps(run_id), c.pikku.get_history(run_id)
    late = c.app.tasks[wa.SLOW].apply_async((run_id, "slow"))
    wait_for(lambda: task_line(worker, late.id, "succeeded"), 10,
             "the late duplicate to be handled", c.diagnostics)
    assert len(c.starts()) == 1
    assert c.pikku.get_steps(run_id) == steps
    assert c.pikku.get_history(run_id) == history


def test_broker_redelivery_does_not_rob_a_live_worker(
        make_cluster: Callable[..., Cluster]) -> None:
    """A real redelivery: kombu's Redis transport puts the unacked step message back on the
    queue once it is older than the visibility timeout, while its first delivery runs."""
    c = make_cluster("redis", **{wa.ENV_VISIBILITY: "1"}, **TASK_PER_STEP)
    w1, w2 = c.start("first"), c.start("second")
    c.wait_ready(w1, w2)
    run_id = c.pikku.start("one_slow", {"seconds": 4.0, "ledger": c.ledger_key})
    wait_for(lambda: c.starts(), 20, "the slow step to start", c.diagnostics)

    def redelivered() -> bool:
        _restore_sweep_before_kombu_57(c)
        logs = w1.log() + w2.log()
        task_ids = [ln.split(f"{wa.SLOW}[", 1)[1].split("]", 1)[0]
                    for ln in logs.splitlines() if f"Task {wa.SLOW}[" in ln and "received" in ln]
        return any(f"{wa.SLOW}[{tid}] ignored" in logs for tid in task_ids
                   if task_ids.count(tid) > 1)
    wait_for(redelivered, 10, "the broker to redeliver the running step's message",
             c.diagnostics)
    assert not [e for e in c.ledger() if e["event"] == "end"], \
        "the redelivery must arrive while the first delivery still runs"

    run = c.wait(run_id, 15)
    assert run.status == "completed", (run, c.diagnostics())
    assert [(e["attempt"], e["event"]) for e in c.ledger()] == [(1, "start"), (1, "end")]
    assert attempts(c.history(run_id, "slow")) == [(1, "succeeded")]
    assert run.output["slow"]["attempt"] == 1


def _restore_sweep_before_kombu_57(c: Cluster) -> None:
    """kombu 5.7 lets the workers sweep unacked messages every second (``workerapp``'s
    ``unacked_restore_interval``/``_throttle``); before it, a worker scans every tenth call
    of a ten-second timer, about 100 s, with no option to change that. Run kombu's own sweep
    (the one a restarting worker runs) from here instead: the redelivery is still kombu's."""
    from kombu.transport import redis as kombu_redis

    if hasattr(kombu_redis.Channel, "unacked_restore_interval"):
        return
    with c.app.connection_for_write() as conn:
        conn.default_channel.qos.restore_visible(num=100, interval=1)


# --- 5. every attempt killed: the lease expiry uses up the attempts ----------------------


def test_lease_exhaustion_fails_step_and_run(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis")
    c.wait_ready(c.start("w1"), c.start("w2"))
    run_id = c.pikku.start("one_slow", {"seconds": 30.0, "ledger": c.ledger_key,
                                        "retries": 1})
    for attempt in (1, 2):
        start = wait_for(lambda n=attempt: [s for s in c.starts() if s["attempt"] == n],
                         STEP_LEASE_S + REAPER_S + 20, f"attempt {attempt} to start",
                         c.diagnostics)[0]
        c.holder_of(start["pid"]).kill()
        c.start(f"spare{attempt}")  # so a live worker remains to reclaim or expire it

    run = c.wait(run_id, STEP_LEASE_S + REAPER_S + 30)
    assert run.status == "failed", (run, c.diagnostics())
    assert LEASE_EXPIRED in (run.error or {}).get("message", ""), run.error
    state = c.step(run_id, "slow")
    assert (state.status, state.attempt, state.max_attempts) == ("failed", 2, 2)
    assert error_type(state) == LEASE_EXPIRED
    history = c.history(run_id, "slow")
    assert attempts(history) == [(1, "failed"), (2, "failed")]
    assert [error_type(h) for h in history] == [LEASE_EXPIRED, LEASE_EXPIRED]
    assert [(e["attempt"], e["event"]) for e in c.ledger()] == [(1, "start"), (2, "start")]
    assert c.step(run_id, "after") is None


# --- 6. forged message: the message cannot choose the function ---------------------------


def test_forged_message_for_another_function_is_refused(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis")
    worker = c.start("target")
    c.wait_ready(worker)
    run_id = c.pikku.start("forge_target", {})
    # "first" settles; "parked" is dispatched to a queue nobody consumes and stays pending.
    wait_for(lambda: (s := c.step(run_id, "parked")) is not None and s.status == "pending",
             20, "the parked step to be recorded", c.diagnostics)
    assert c.step(run_id, "first").status == "succeeded"
    steps, history = c.pikku.get_steps(run_id), c.pikku.get_history(run_id)

    forged = [
        (c.app.tasks[wa.SLOW].apply_async((run_id, "parked")),  # claimable, as it.parked
         ("'parked'", "'it.parked'", "'it.slow'")),
        (c.app.tasks[wa.FLAKY].apply_async((run_id, "first")),  # settled, as it.add
         ("'first'", "'it.add'", "'it.flaky'")),
    ]
    for message, names in forged:
        line = wait_for(lambda m=message: task_line(worker, m.id, "raised"), 10,
                        f"forged message {message.id} to be refused", c.diagnostics)
        # Celery reports the error by its own type (until b417cba it said PikkuError).
        assert "WorkflowStepFunctionMismatchError(" in line, line
        assert run_id in line and all(name in line for name in names), line

    assert c.pikku.get_steps(run_id) == steps
    assert c.pikku.get_history(run_id) == history
    assert c.pikku.get_run(run_id).status == "running"
    assert c.ledger() == []


# --- regressions of bugs found here ------------------------------------------------------


# Regression: until b417cba pikku's errors did not survive pickling (args was (message,)),
# so Celery's handle_failure swapped them for the nearest picklable base, PikkuError: a
# superseded step task was logged "raised unexpected: PikkuError(...)" at ERROR with a
# traceback, since its Task.throws no longer matched.
def test_cancel_fences_a_running_step_and_celery_records_it_quietly(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis", **TASK_PER_STEP)
    worker = c.start("fenced")
    c.wait_ready(worker)
    run_id = c.pikku.start("one_slow", {"seconds": 10.0, "ledger": c.ledger_key})
    wait_for(lambda: c.starts(), 20, "the slow step to start", c.diagnostics)
    slow_id = next(ln for ln in worker.log().splitlines()
                   if f"Task {wa.SLOW}[" in ln and "received" in ln
                   ).split(f"{wa.SLOW}[", 1)[1].split("]", 1)[0]

    assert c.pikku.cancel(run_id, "fence the running attempt")
    line = wait_for(lambda: task_line(worker, slow_id, "raised"), 10,
                    "the fenced step task to end", c.diagnostics)

    # Contract section 4: recorded as WorkflowStepSupersededError, no traceback noise.
    assert "INFO" in line and "raised expected: WorkflowStepSupersededError(" in line, line
    assert "Traceback" not in worker.log()
    start, end = c.ledger()
    assert end["event"] == "end" and end["lease_lost"] is True, "the body was not told"
    assert end["t"] - start["t"] < 5, "the body should have stopped early"
    assert c.pikku.get_run(run_id).status == "cancelled"
    state = c.step(run_id, "slow")
    assert (state.status, state.attempt) == ("failed", 1)
    assert error_type(state) == "WorkflowCancelledError"
    assert attempts(c.history(run_id, "slow")) == [(1, "failed")]


# Regression: until a87b422 pikku's tasks were declared with Celery's default shared=True,
# so an app finalized later in the same process got the FIRST app's tasks (whose closures
# call the first PikkuCelery's engine) and Celery warned DuplicateTaskNameWarning.
def test_each_app_in_one_process_runs_its_own_engine(
        mongo_server: MongoTarget, key_prefix: str, redis_client: redis.Redis) -> None:
    def env(tag: str) -> dict[str, str]:
        return {wa.ENV_BROKER: REDIS_URL, wa.ENV_REDIS: REDIS_URL,
                wa.ENV_MONGO: mongo_server.url_for(f"pikku_it_{tag}_{uuid.uuid4().hex[:8]}"),
                wa.ENV_PREFIX: f"{key_prefix}:{tag}",
                wa.ENV_QUEUE: f"pikku-it-{uuid.uuid4().hex[:10]}"}

    # With the bug, which app's task each app got depended on the iteration order of
    # Celery's set of finalize callbacks: all eight right by chance was ~1/40320.
    apps = [wa.build(env(f"app{i}")) for i in range(8)]
    try:
        wrong = {}
        for index, app in enumerate(apps):
            run, _ = app.pikku.engine.create_run("pipeline", {"a": 1, "b": 2, "fail": 0})
            orchestrate = internal_task(app, "orchestrate")
            outcome = orchestrate.apply(args=(run.run_id,))
            steps = [s.step_name for s in app.pikku.get_steps(run.run_id)]
            if (outcome.state, outcome.result, steps) != ("SUCCESS", "dispatched", ["sum"]):
                wrong[index] = (orchestrate.name, outcome.state, repr(outcome.result))
                continue
            outcome = app.tasks[wa.ADD].apply(args=(run.run_id, "sum"))
            step = app.pikku.get_steps(run.run_id)[0]
            if (outcome.state, outcome.result, step.status) != ("SUCCESS", 3, "succeeded"):
                wrong[index] = (wa.ADD, outcome.state, repr(outcome.result), step.status)
        assert not wrong, f"apps whose tasks ran another app's engine: {wrong}"
    finally:
        for app in apps:
            db = app.pikku.engine.store.db
            with contextlib.suppress(Exception):
                db.client.drop_database(db.name)
            db.client.close()
            app.close()


# --- leases on a Redis Cluster -----------------------------------------------------------


def test_leases_on_a_redis_cluster(make_cluster: Callable[..., Cluster],
                                   redis_cluster: RedisClusterServer,
                                   redis_client: redis.Redis, key_prefix: str) -> None:
    """Real prefork workers whose run and step leases live on a three-node Redis Cluster
    (``redis+cluster://``; the broker stays the single Redis): the pipeline completes,
    including its parallel steps (renewed together by one heartbeat, one script call per
    slot) and a retried step, and a worker SIGKILLed mid-step is recovered by its lease
    lapsing on the cluster's clock, as attempt 2."""
    c = make_cluster("redis", **{wa.ENV_LEASES: redis_cluster.url})
    cluster_client = redis_cluster.client()
    try:
        worker = c.start("rc", "prefork")
        c.wait_ready(worker)
        run_id = c.pikku.start("pipeline", {"a": 2, "b": 3, "fail": 1})
        run = c.wait(run_id, 30)
        assert run.status == "completed", (run, c.diagnostics())
        assert run.output == {"total": 5, "left": 6, "right": 7, "flaky": {"ok_on_attempt": 2}}
        assert attempts(c.history(run_id, "flaky")) == [(1, "failed"), (2, "succeeded")]

        # The leases were taken on the cluster, on more than one node; none on the broker's
        # Redis (only the test's ledger is there).
        on_cluster = list(cluster_client.scan_iter(match=f"{key_prefix}:lease-token:*"))
        assert any(b"workflow-run:" in key for key in on_cluster), on_cluster
        assert any(b"workflow-step:" in key for key in on_cluster), on_cluster
        assert len({cluster_client.get_node_from_key(key).name for key in on_cluster}) >= 2
        assert list(redis_client.scan_iter(match=f"{key_prefix}:lease*")) == []

        # A SIGKILLed holder: its step lease lapses on the cluster, the other worker
        # (started before the run) takes the step over as attempt 2.
        spare = c.start("rc-spare", "prefork")
        c.wait_ready(spare)
        run_id = c.pikku.start("one_slow", {"seconds": 2.0, "ledger": c.ledger_key})
        first = wait_for(lambda: c.starts(), 20, "the slow step to start", c.diagnostics)[0]
        c.holder_of(first["pid"]).kill()
        run = c.wait(run_id, 40)
        assert run.status == "completed", (run, c.diagnostics())
        assert run.output["slow"]["attempt"] == 2
        history = c.history(run_id, "slow")
        assert attempts(history) == [(1, "failed"), (2, "succeeded")]
        assert error_type(history[0]) == LEASE_EXPIRED
    finally:
        for key in list(cluster_client.scan_iter(match=f"{key_prefix}:*")):
            cluster_client.delete(key)
        cluster_client.close()
