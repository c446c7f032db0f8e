"""Hardening of issue 8 against the real Redis: names and counters bounded before they
reach Redis (14), and real ``celery -A`` workers whose MongoDB or Redis does not answer
(20)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from pikku_celery import (
    InMemoryWorkflowStore,
    InvalidInputError,
    Lease,
    PikkuCelery,
    RedisLeaseService,
)
from pikku_celery.leases.redis import COUNTER_TTL_FLOOR_MS, counter_ttl_ms
from pikku_celery.worker.tasks import internal_task
from tests.conftest import REDIS_URL
from tests.integration import outage_app as oa
from tests.integration.test_celery_workers import ROOT, Worker, wait_for
from tests.support.mongod import MongoTarget, free_port
from tests.unit.test_engine import Recorder

HUGE = "x" * 500_000
DAY_MS = 24 * 3600 * 1000


def _keys(client: redis.Redis, prefix: str) -> set[bytes]:
    return set(client.scan_iter(match=f"{prefix}:*", count=1000))


def _expect(lease: Lease | None) -> Lease:
    assert lease is not None
    return lease


# --- 14: names and counters bounded ---------------------------------------------------------


@pytest.fixture
def pikku(redis_client: redis.Redis, key_prefix: str) -> Iterator[PikkuCelery]:
    pikku = PikkuCelery(Celery(f"infra-{key_prefix}", broker="memory://"),
                        store=InMemoryWorkflowStore(),
                        leases=RedisLeaseService(redis_client, key_prefix=key_prefix),
                        worker_reaper=False)
    pikku.engine.dispatcher = Recorder()

    @pikku.step(name="infra.charge")
    def charge(data: Any) -> str:
        return "charged"

    @pikku.workflow("infra.order")
    def order(wf: Any, data: Any) -> Any:
        return wf.do("charge", charge, data)

    yield pikku


@pytest.mark.parametrize(("task", "args"), [
    ("infra.charge", ("{run}", HUGE)),
    ("infra.charge", (HUGE, "charge")),
    ("infra.charge", ("{run}", "$where")),
    ("timer", ("{run}", HUGE)),
    ("orchestrate", (HUGE,)),
])
def test_a_forged_message_with_an_oversized_name_writes_no_redis_key(
        pikku: PikkuCelery, redis_client: redis.Redis, key_prefix: str, task: str,
        args: tuple[str, ...]) -> None:
    run_id = pikku.start("infra.order", {"amount": 5})
    before = _keys(redis_client, key_prefix)
    with pytest.raises(InvalidInputError, match="malformed pikku message") as refused:
        tasks = pikku.app.tasks
        found = tasks[task] if task in tasks else internal_task(pikku.app, task)
        found.run(*(run_id if a == "{run}" else a for a in args))
    assert len(str(refused.value)) < 400  # names the problem, never echoes 500 KB
    assert _keys(redis_client, key_prefix) == before


def test_the_lease_service_refuses_an_oversized_key_before_redis(
        redis_client: redis.Redis, key_prefix: str) -> None:
    leases = RedisLeaseService(redis_client, key_prefix=key_prefix)
    for key, holder in ((HUGE, "h"), ("k" * 513, "h"), ("k", HUGE)):
        with pytest.raises(ValueError, match="at most 512 characters"):
            leases.acquire(key, holder, 1000)
    with pytest.raises(ValueError, match="invalid lease key"):
        leases.get(HUGE)
    assert _keys(redis_client, key_prefix) == set()
    # The longest key pikku itself makes (a step lease of a 200-character run id) fits.
    longest = f"workflow-step:{'r' * 200}:{'i' * 36}"
    assert _expect(leases.acquire(longest, "h", 1000)).token == 1


def test_token_counters_expire_long_after_any_lease_and_every_use_pushes_that_back(
        redis_client: redis.Redis, key_prefix: str) -> None:
    leases = RedisLeaseService(redis_client, key_prefix=key_prefix)
    counter = leases.token_counter_key("job")
    slack_ms = 60_000

    def counter_ttl() -> int:
        return int(redis_client.pttl(counter))

    first = _expect(leases.acquire("job", "a", 500))
    assert COUNTER_TTL_FLOOR_MS - slack_ms < counter_ttl() <= COUNTER_TTL_FLOOR_MS
    # Age the counter by hand: a renewal of the live lease pushes its expiry back...
    redis_client.pexpire(counter, 10_000)
    assert _expect(leases.refresh(first, 500)).token == 1
    assert counter_ttl() > COUNTER_TTL_FLOOR_MS - slack_ms
    # ...and so does the live holder re-acquiring, and a fresh grant after a release.
    redis_client.pexpire(counter, 10_000)
    assert _expect(leases.acquire("job", "a", 500)).token == 1
    assert counter_ttl() > COUNTER_TTL_FLOOR_MS - slack_ms
    assert leases.release(first)
    redis_client.pexpire(counter, 10_000)
    assert _expect(leases.acquire("job", "b", 500)).token == 2  # never backwards in use
    assert counter_ttl() > COUNTER_TTL_FLOOR_MS - slack_ms
    # A refused renewal (a stale handle) extends nothing.
    redis_client.pexpire(counter, 10_000)
    assert leases.refresh(first, 500) is None
    assert counter_ttl() <= 10_000


def test_a_counter_outlives_a_long_lease_by_a_thousand_ttls(
        redis_client: redis.Redis, key_prefix: str) -> None:
    leases = RedisLeaseService(redis_client, key_prefix=key_prefix)
    _expect(leases.acquire("long", "a", 2 * DAY_MS))
    ttl = int(redis_client.pttl(leases.token_counter_key("long")))
    assert counter_ttl_ms(2 * DAY_MS) == 2000 * DAY_MS
    assert 2000 * DAY_MS - 60_000 < ttl <= 2000 * DAY_MS
    # refresh_many pushes back the counter of every lease it renews.
    many = [_expect(leases.acquire(f"m{i}", "a", 500)) for i in range(3)]
    for lease in many:
        redis_client.pexpire(leases.token_counter_key(lease.key), 10_000)
    assert all(leases.refresh_many([(lease, 500) for lease in many]))
    for lease in many:
        assert int(redis_client.pttl(leases.token_counter_key(lease.key))) > 10_000


# --- 20: a worker whose MongoDB or Redis does not answer ----------------------------------

OUTAGE_TIMEOUT_S = 60.0  # a guard against a hung wait, never a timing assertion


class _Forwarder:
    """A TCP port that forwards to Redis once opened: Redis "coming back" on a fixed URL."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.port = free_port()
        self._target = target
        self._server: socket.socket | None = None
        self._sockets: list[socket.socket] = []

    def open(self) -> None:
        server = socket.create_server(("127.0.0.1", self.port))
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self._target)
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in [self._server, *self._sockets]:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()


@pytest.fixture
def outage_worker(key_prefix: str, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(mongo_url: str, redis_url: str, *, as_configured: bool = False) -> Worker:
        env = {**os.environ, oa.ENV_BROKER: REDIS_URL, oa.ENV_MONGO: mongo_url,
               oa.ENV_REDIS: redis_url, oa.ENV_PREFIX: key_prefix,
               oa.ENV_QUEUE: f"pikku-outage-{uuid.uuid4().hex[:10]}", "PYTHONUNBUFFERED": "1",
               oa.ENV_AS_CONFIGURED: "1" if as_configured else "0"}
        log_path = tmp_path / f"worker-{len(started)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.integration.outage_app",
                 "worker", "-P", "solo", "-Q", env[oa.ENV_QUEUE], "-n",
                 f"outage-{uuid.uuid4().hex[:6]}@%h", "--without-gossip", "--without-mingle",
                 "--without-heartbeat", "--loglevel", "INFO"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        worker = Worker("outage", "solo", proc, log_path)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        with contextlib.suppress(ProcessLookupError):
            worker.proc.terminate()
        try:
            worker.proc.wait(10)
        except subprocess.TimeoutExpired:
            worker.kill()


def _lines(worker: Worker, fragment: str) -> list[str]:
    return [line for line in worker.log().splitlines() if fragment in line]


def _wait_for_sweeps(worker: Worker, fragment: str, count: int) -> None:
    wait_for(lambda: len(_lines(worker, fragment)) >= count, OUTAGE_TIMEOUT_S,
             f"{count} log lines with {fragment!r}", worker.log)


def test_a_worker_names_each_unreachable_service_once_not_every_sweep(
        outage_worker: Callable[..., Worker]) -> None:
    mongo_port, redis_port = free_port(), free_port()
    worker = outage_worker(f"mongodb://shop:s3cret@127.0.0.1:{mongo_port}/shop",
                           f"redis://:s3cret@127.0.0.1:{redis_port}/0")
    wait_for(lambda: "ready." in worker.log(), OUTAGE_TIMEOUT_S, "the worker to be ready",
             worker.log)
    # Two failed sweeps, at least (each lasts its deadline, at least 10 s: the reaper rides
    # out an election), and still one ERROR line per service.
    _wait_for_sweeps(worker, "sweep failed while", 2)
    errors = _lines(worker, "ERROR/")
    assert len(errors) == 2, worker.log()
    assert any(f"pikku: MongoDB at mongodb://127.0.0.1:{mongo_port}/shop is unreachable"
               in line for line in errors), errors
    assert any(f"pikku: Redis at redis://127.0.0.1:{redis_port}/0 is unreachable"
               in line for line in errors), errors
    assert "Traceback" not in worker.log()
    assert "s3cret" not in worker.log()
    assert worker.alive()  # it keeps running, retrying quietly


def test_a_worker_started_with_mongodb_down_says_so_within_seconds(
        outage_worker: Callable[..., Worker], redis_client: redis.Redis) -> None:
    """Configured as the quickstart is (settings only, every default: a 30 s reaper
    interval), a worker whose MongoDB does not answer names it, and the setting to check, in
    one ERROR line a few seconds after "ready", not a reaper interval later (issue 36)."""
    mongo_port = free_port()
    redis_host = redis_client.connection_pool.connection_kwargs
    worker = outage_worker(f"mongodb://127.0.0.1:{mongo_port}/shop",
                           f"redis://{redis_host['host']}:{redis_host['port']}/"
                           f"{redis_host.get('db', 0)}", as_configured=True)
    wait_for(lambda: "ready." in worker.log(), OUTAGE_TIMEOUT_S, "the worker to be ready",
             worker.log)
    ready = time.monotonic()
    # The probe at start waits 5 s for a server (pikku's server-selection timeout); the
    # bound leaves a loaded machine room, well under the 30 s of a sweep's deadline.
    wait_for(lambda: _lines(worker, "ERROR/"), 15.0, "the outage line", worker.log)
    took = time.monotonic() - ready
    errors = _lines(worker, "ERROR/")
    assert len(errors) == 1 and took < 15.0, (took, worker.log())
    assert f"pikku: MongoDB at mongodb://127.0.0.1:{mongo_port}/shop is unreachable" \
        in errors[0], errors
    assert "(check the pikku_mongo_url setting)" in errors[0], errors
    assert "retries every 30 s" in errors[0], errors
    assert worker.alive()


def test_a_worker_logs_once_when_redis_answers_again(
        outage_worker: Callable[..., Worker], mongo_server: MongoTarget, redis_client: redis.Redis,
        key_prefix: str) -> None:
    redis_host = redis_client.connection_pool.connection_kwargs
    forwarder = _Forwarder((redis_host["host"], int(redis_host["port"])))
    try:
        worker = outage_worker(mongo_server.url_for(f"pikku_outage_{uuid.uuid4().hex[:8]}"),
                               f"redis://127.0.0.1:{forwarder.port}/"
                               f"{redis_host.get('db', 0)}")
        _wait_for_sweeps(worker, "is unreachable", 1)
        _wait_for_sweeps(worker, "sweep failed while", 3)
        forwarder.open()  # Redis comes back on the same URL
        _wait_for_sweeps(worker, "answers again; the reaper resumed", 1)
        # Sweeps run again: each takes the reaper lease afresh.
        counter = RedisLeaseService(redis_client, key_prefix=key_prefix).token_counter_key(
            "workflow-reaper")
        wait_for(lambda: int(redis_client.get(counter) or 0) >= 3, OUTAGE_TIMEOUT_S,
                 "three sweeps after Redis came back", worker.log)
        # One ERROR line for the outage (the quiet DEBUG lines of the failed sweeps name it
        # too, as the error they carry does).
        unreachable = [ln for ln in _lines(worker, "is unreachable") if "ERROR/" in ln]
        assert len(unreachable) == 1, worker.log()
        assert len(_lines(worker, "answers again; the reaper resumed")) == 1, worker.log()
        assert "Traceback" not in worker.log()
    finally:
        forwarder.close()
