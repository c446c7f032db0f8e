"""Bound to an app, pikku changes nothing its ordinary tasks feel (issue 14).

An ordinary Celery app (``plainapp.py``: plain tasks, Celery's MongoDB result backend on
the session's real MongoDB) runs on a real, plain ``celery -A tests.integration.plainapp worker``
(prefork, no ``-Q``) on RabbitMQ and on Redis, once alone and once with a ``PikkuCelery``
bound with default options. Every test runs in both modes and asserts Celery's documented
behaviour, so a difference pikku makes fails in the ``pikku`` mode only: ``expires`` ends
REVOKED (it hung on RabbitMQ when pikku set prefetch 1 app-wide), countdown and ETA wait on
the worker, retries, chains, groups and chords with the MongoDB backend, revoke, and
``inspect`` (the same queues and the same prefetch as without pikku). Bound, a workflow
runs to its end on that same plain worker, beside the canvas.

Then pikku's opt-in queue (``PikkuCelery(queue=...)``): a worker consuming only it gets
prefetch 1 and runs whole workflows (so every pikku message went there), a plain worker
consumes it beside the app's queue with the app's prefetch, and the user's prefetch wins
from the command line (even an explicit ``4``) and from ``config_from_object``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import kombu
import pymongo
import pytest
import redis
from celery import Celery, chain, chord, group
from celery.exceptions import TaskRevokedError

from pikku_celery.worker.tasks import internal_task_names
from tests.conftest import REDIS_URL
from tests.integration import plainapp as pa
from tests.support.mongod import MongoTarget

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
AMQP_URL = os.environ.get("PIKKU_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
BROKERS = {"redis": REDIS_URL, "rabbitmq": AMQP_URL}
CONCURRENCY = 2
CELERY_DEFAULT_PREFETCH = 4  # worker_prefetch_multiplier's documented default
RESULT_TIMEOUT_S = 30.0
COUNTDOWN_S = 2.0


def wait_for(condition: Callable[[], Any], timeout: float, what: str,
             diagnostics: Callable[[], str] = lambda: "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}\n{diagnostics()}")
        time.sleep(0.05)


class Worker:
    def __init__(self, node: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.node = node
        self.proc = proc
        self.log_path = log_path

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the pool's children too
        self.proc.wait(5)


class Cluster:
    """One app (alone or bound), its settings, and the plain workers that run it."""

    def __init__(self, broker: str, bound: bool, mongo: MongoTarget, logdir: Path, *,
                 pikku_queue: bool = False, **env: str) -> None:
        self.broker = broker
        self.bound = bound
        self.tag = uuid.uuid4().hex[:10]
        self.logdir = logdir
        self.queue = pa.default_queue(self.tag)
        self.pikku_queue = f"{self.queue}.pikku" if pikku_queue else None
        if self.pikku_queue:
            env[pa.ENV_QUEUE] = self.pikku_queue
        self.env = {**os.environ,
                    pa.ENV_BROKER: BROKERS[broker],
                    pa.ENV_BACKEND: mongo.url_for(f"ni_{self.tag}"),
                    pa.ENV_TAG: self.tag,
                    pa.ENV_BIND: "1" if bound else "0",
                    pa.ENV_MONGO: mongo.url_for(f"ni_{self.tag}_pikku"),
                    pa.ENV_REDIS: REDIS_URL,
                    **env}
        self.mongo = mongo
        self.app: Celery = pa.build(self.env)
        self.workers: list[Worker] = []

    def task(self, name: str) -> Any:
        return self.app.tasks[name]

    def start(self, *args: str, name: str = "w", **env: str) -> Worker:
        node = f"ni-{self.tag}-{name}@{os.uname().nodename}"
        log_path = self.logdir / f"{self.tag}-{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.integration.plainapp", "worker",
                 "-P", "prefork", "-c", str(CONCURRENCY), "-n", node, "--without-gossip",
                 "--without-mingle", "--without-heartbeat", "--loglevel", "INFO", *args],
                cwd=ROOT, env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        worker = Worker(node, proc, log_path)
        self.workers.append(worker)
        return worker

    def wait_ready(self, *workers: Worker) -> None:
        def ready() -> bool:
            for w in workers:
                if w.proc.poll() is not None:
                    pytest.fail(f"worker {w.node} exited with {w.proc.returncode}:\n{w.log()}")
            return all(" ready." in w.log() for w in workers)
        wait_for(ready, 60, "the workers to be ready", self.diagnostics)

    def inspect(self, worker: Worker) -> Any:
        return self.app.control.inspect(destination=[worker.node], timeout=10, limit=1)

    def reply(self, worker: Worker, method: str) -> Any:
        """One inspect reply of ``worker`` (retried: a reply can miss a loaded machine's
        timeout; what it says is asserted by the caller)."""
        def ask() -> tuple[Any] | None:
            replies = getattr(self.inspect(worker), method)() or {}
            return (replies[worker.node],) if worker.node in replies else None
        return wait_for(ask, 60, f"{method} from {worker.node}", self.diagnostics)[0]

    def diagnostics(self) -> str:
        return "\n".join(f"--- {w.node} log tail:\n" + "\n".join(w.log().splitlines()[-40:])
                         for w in self.workers)

    def close(self) -> None:
        for w in self.workers:  # all asked to stop at once: their warm shutdowns overlap
            if w.proc.poll() is None:
                w.proc.terminate()
        for w in self.workers:
            w.stop()
        with contextlib.suppress(Exception):
            self.app.close()
        with contextlib.suppress(Exception):
            self.app.pikku.engine.store.db.client.close()
        client = pymongo.MongoClient(self.mongo.url, serverSelectionTimeoutMS=5000)
        for db in (f"ni_{self.tag}", f"ni_{self.tag}_pikku"):
            with contextlib.suppress(Exception):
                client.drop_database(db)
        client.close()
        r = redis.Redis.from_url(REDIS_URL)
        doomed = list(r.scan_iter(match=f"ni-{self.tag}:*", count=1000))
        if doomed:
            r.delete(*doomed)
        r.close()
        if self.broker == "rabbitmq":  # the server is shared: leave nothing behind
            with contextlib.suppress(Exception), kombu.Connection(AMQP_URL) as conn:
                channel = conn.channel()
                for queue in (self.queue, f"{self.queue}.pikku"):
                    with contextlib.suppress(Exception):
                        channel.queue_delete(queue)
                    with contextlib.suppress(Exception):
                        channel.exchange_delete(queue)
                for exchange in (f"ni-control-{self.tag}.pidbox",
                                 f"reply.ni-control-{self.tag}.pidbox", f"ni-events-{self.tag}"):
                    with contextlib.suppress(Exception):
                        channel.exchange_delete(exchange)


MODES = [(broker, mode) for broker in ("rabbitmq", "redis") for mode in ("celery", "pikku")]


@pytest.fixture(scope="module", params=MODES, ids=[f"{b}-{m}" for b, m in MODES])
def plain(request: pytest.FixtureRequest, mongo_server: MongoTarget,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Worker]]:
    """A plain worker (no -Q) of the app, alone or with pikku bound."""
    broker, mode = request.param
    cluster = Cluster(broker, mode == "pikku", mongo_server, tmp_path_factory.mktemp("ni"))
    try:
        worker = cluster.start()
        cluster.wait_ready(worker)
        yield cluster, worker
    finally:
        cluster.close()


# --- the app's own tasks, alone and with pikku bound -------------------------------------


def test_inspect_sees_the_same_worker(plain: tuple[Cluster, Worker]) -> None:
    """Same queues, same prefetch, same settings: binding pikku configured nothing."""
    c, worker = plain
    assert "worker_prefetch_multiplier" not in c.app.conf.changes
    assert c.app.conf.worker_prefetch_multiplier == CELERY_DEFAULT_PREFETCH
    assert c.reply(worker, "ping") == {"ok": "pong"}
    queues = c.reply(worker, "active_queues")
    assert [q["name"] for q in queues] == [c.queue]
    stats = c.reply(worker, "stats")
    assert stats["prefetch_count"] == CONCURRENCY * CELERY_DEFAULT_PREFETCH
    registered = set(c.reply(worker, "registered"))
    assert {"ni.add", "ni.xsum", "ni.sleeping", "ni.retrying"} <= registered
    pikku_tasks = {*internal_task_names(c.app).values(), "ni.double"}
    assert (pikku_tasks <= registered) is c.bound


def test_expires_ends_revoked(plain: tuple[Cluster, Worker]) -> None:
    """Celery's own test_expired: behind busy tasks, a task whose ``expires`` passes is
    stored REVOKED. With prefetch 1 it stayed in RabbitMQ, which dropped it at its TTL, and
    ``get()`` never returned."""
    c, _ = plain
    add, sleeping = c.task("ni.add"), c.task("ni.sleeping")
    for expires in (1, datetime.now(timezone.utc) + timedelta(seconds=1)):
        fill = [sleeping.delay(2) for _ in range(4)]
        result = add.apply_async((1, 1), expires=expires)
        with pytest.raises(TaskRevokedError):
            result.get(timeout=RESULT_TIMEOUT_S, interval=0.1)
        assert result.status == "REVOKED"
        assert (result.ready(), result.failed(), result.successful()) == (True, False, False)
        assert [f.get(timeout=RESULT_TIMEOUT_S, interval=0.1) for f in fill] == [2] * 4


def test_countdown_and_eta_wait_on_the_worker(plain: tuple[Cluster, Worker]) -> None:
    c, worker = plain
    add = c.task("ni.add")
    sent = time.monotonic()
    by_countdown = add.apply_async((2, 2), countdown=COUNTDOWN_S)
    by_eta = add.apply_async((3, 3), eta=datetime.now(timezone.utc)
                             + timedelta(seconds=COUNTDOWN_S))

    def scheduled() -> bool:
        held = {e["request"]["id"] for e in c.reply(worker, "scheduled")}
        return {by_countdown.id, by_eta.id} <= held
    wait_for(scheduled, RESULT_TIMEOUT_S, "both tasks to be scheduled on the worker",
             c.diagnostics)
    assert by_countdown.get(timeout=RESULT_TIMEOUT_S, interval=0.1) == 4
    assert by_eta.get(timeout=RESULT_TIMEOUT_S, interval=0.1) == 6
    assert time.monotonic() - sent >= COUNTDOWN_S  # never before its time


def test_retries(plain: tuple[Cluster, Worker]) -> None:
    c, _ = plain
    retrying = c.task("ni.retrying")
    recovered = retrying.delay(2)
    assert recovered.get(timeout=RESULT_TIMEOUT_S, interval=0.1) == 2
    assert recovered.status == "SUCCESS"
    exhausted = retrying.delay(5)  # max_retries=2: the third failure is final
    exhausted.get(timeout=RESULT_TIMEOUT_S, interval=0.1, propagate=False)
    assert exhausted.status == "FAILURE"
    assert isinstance(exhausted.result, ValueError)
    assert str(exhausted.result) == "try 2"


def test_canvas_with_the_mongodb_backend(plain: tuple[Cluster, Worker]) -> None:
    """Chains, groups and chords (joined by ``celery.chord_unlock`` on this backend) give
    Celery's results; bound, a workflow runs to its end on the same plain worker beside
    them."""
    c, _ = plain
    add, xsum = c.task("ni.add"), c.task("ni.xsum")
    run_id = c.app.pikku.start(pa.FLOW, 5) if c.bound else None
    assert chain(add.s(1, 1), add.s(2), add.s(3))().get(timeout=RESULT_TIMEOUT_S,
                                                        interval=0.1) == 7
    assert group(add.s(i, i) for i in range(5))().get(timeout=RESULT_TIMEOUT_S,
                                                      interval=0.1) == [0, 2, 4, 6, 8]
    assert chord(add.s(i, i) for i in range(5))(xsum.s()).get(timeout=RESULT_TIMEOUT_S,
                                                             interval=0.1) == 20
    if run_id is not None:
        run = c.app.pikku.wait(run_id, RESULT_TIMEOUT_S)
        assert (run.status, run.output) == ("completed", {"first": 10, "left": 20, "right": 2})


def test_revoke(plain: tuple[Cluster, Worker]) -> None:
    c, worker = plain
    result = c.task("ni.add").apply_async((1, 1), countdown=COUNTDOWN_S)
    wait_for(lambda: result.id in {e["request"]["id"] for e in c.reply(worker, "scheduled")},
             RESULT_TIMEOUT_S, "the task to be scheduled on the worker", c.diagnostics)
    c.app.control.revoke(result.id)
    wait_for(lambda: result.id in c.reply(worker, "revoked"), RESULT_TIMEOUT_S,
             "the worker to list the task as revoked", c.diagnostics)
    with pytest.raises(TaskRevokedError):
        result.get(timeout=RESULT_TIMEOUT_S, interval=0.1)
    assert result.status == "REVOKED"


# --- pikku's opt-in queue ----------------------------------------------------------------


@pytest.fixture
def make_cluster(mongo_server: MongoTarget, tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(broker: str, **env: str) -> Cluster:
        cluster = Cluster(broker, True, mongo_server, tmp_path, pikku_queue=True, **env)
        made.append(cluster)
        return cluster
    yield make
    for cluster in made:
        cluster.close()


def test_a_worker_on_pikkus_queue_alone_gets_prefetch_1(
        make_cluster: Callable[..., Cluster]) -> None:
    """It runs whole workflows (so every pikku message went to pikku's queue) with prefetch
    1; a plain worker of the same app consumes that queue too, with the app's prefetch."""
    c = make_cluster("rabbitmq")
    tag_queue = c.pikku_queue
    dedicated = c.start("-Q", tag_queue, name="pikku")
    c.wait_ready(dedicated)
    assert [q["name"] for q in c.reply(dedicated, "active_queues")] == [tag_queue]
    assert c.reply(dedicated, "stats")["prefetch_count"] == CONCURRENCY * 1
    assert "consumes only pikku's queue" in dedicated.log()
    run = c.app.pikku.wait(c.app.pikku.start(pa.FLOW, 4), RESULT_TIMEOUT_S)
    assert (run.status, run.output) == ("completed", {"first": 8, "left": 16, "right": 2})
    assert "worker_prefetch_multiplier" not in c.app.conf.changes

    plain_worker = c.start(name="plain")
    c.wait_ready(plain_worker)
    assert sorted(q["name"] for q in c.reply(plain_worker, "active_queues")) == sorted(
        [c.queue, tag_queue])
    assert c.reply(plain_worker, "stats")["prefetch_count"] == (
        CONCURRENCY * CELERY_DEFAULT_PREFETCH)
    assert c.task("ni.add").delay(2, 3).get(timeout=RESULT_TIMEOUT_S, interval=0.1) == 5


def test_the_users_prefetch_wins_on_pikkus_queue(make_cluster: Callable[..., Cluster]) -> None:
    """An explicit ``--prefetch-multiplier 4`` (the default's value, so only its source tells
    it apart) and a ``config_from_object`` setting both beat pikku's 1."""
    by_cli = make_cluster("redis")
    by_conf = make_cluster("redis", **{pa.ENV_CONF_PREFETCH: "3"})
    cli_worker = by_cli.start("-Q", str(by_cli.pikku_queue), "--prefetch-multiplier", "4",
                              name="cli")
    conf_worker = by_conf.start("-Q", str(by_conf.pikku_queue), name="conf")
    by_cli.wait_ready(cli_worker)
    by_conf.wait_ready(conf_worker)
    assert by_cli.reply(cli_worker, "stats")["prefetch_count"] == CONCURRENCY * 4
    assert by_conf.reply(conf_worker, "stats")["prefetch_count"] == CONCURRENCY * 3
    assert "keeping your prefetch multiplier" in cli_worker.log()
