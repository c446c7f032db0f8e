"""Real processes for a chaos run: a private Redis (so it can be restarted), the nx-27017
MongoDB stand-in on a file database (so it survives ``kill -9`` and restarts), a broker,
and ``celery -A tests.chaos.chaosapp`` workers, each in its own process group."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import kombu
import pymongo
import redis

from tests.support.nx import free_port

NX = str(Path(sys.executable).with_name("nx-27017"))
RABBIT_URL = "amqp://guest:guest@127.0.0.1:5672//"


def _wait(ready: object, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ready():  # type: ignore[operator]
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"chaos: {what} did not come up within {timeout_s}s")


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    pool: str
    skew_s: float = 0.0
    pids: set[int] = field(default_factory=set)
    replaced: bool = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def group_pids(self) -> set[int]:
        out = subprocess.run(["ps", "-o", "pid=", "-g", str(self.proc.pid)],
                             capture_output=True, text=True).stdout
        return {int(p) for p in out.split()}

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)


class Cluster:
    def __init__(self, workdir: Path, broker: str) -> None:
        self.workdir = workdir
        self.broker_kind = broker
        self.redis_port = free_port()
        self.mongo_port = free_port()
        self.tag = uuid.uuid4().hex[:8]
        (workdir / "ledger").mkdir(parents=True, exist_ok=True)
        (workdir / "mongo").mkdir(exist_ok=True)
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.mongo_proc: subprocess.Popen[bytes] | None = None
        self.workers: list[Worker] = []
        self._count = 0

    # --- services -----------------------------------------------------------------------

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def mongo_url(self) -> str:
        return f"mongodb://127.0.0.1:{self.mongo_port}/chaos?directConnection=true"

    @property
    def broker_url(self) -> str:
        return RABBIT_URL if self.broker_kind == "amqp" else f"redis://127.0.0.1:{self.redis_port}/1"

    def env(self) -> dict[str, str]:
        return {**os.environ, "CHAOS_BROKER": self.broker_url, "CHAOS_REDIS": self.redis_url,
                "CHAOS_MONGO": self.mongo_url, "CHAOS_QUEUE": f"chaos-{self.tag}",
                "CHAOS_PREFIX": f"chaos-{self.tag}",
                "CHAOS_LEDGER": str(self.workdir / "ledger"),
                "CHAOS_VISIBILITY_S": "5"}

    def start_redis(self) -> None:
        self.redis_proc = subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.redis_port, socket_timeout=1)
        _wait(client.ping, "redis")

    def start_mongo(self) -> None:
        pid_file = self.workdir / "nx.pid"
        pid_file.unlink(missing_ok=True)  # a stale pid file blocks a restart
        self.mongo_proc = subprocess.Popen(
            [NX, "--data-dir", str(self.workdir / "mongo"), "--port", str(self.mongo_port),
             "--pid-file", str(pid_file), "--log-file", str(self.workdir / "nx.log")],
            cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(
            self.mongo_url, serverSelectionTimeoutMS=300)
        _wait(lambda: client.admin.command("ping"), "nx-27017")
        client.close()

    def restart_redis(self) -> None:
        assert self.redis_proc is not None
        self.redis_proc.kill()
        self.redis_proc.wait()
        self.start_redis()

    def restart_mongo(self) -> None:
        assert self.mongo_proc is not None
        self.mongo_proc.kill()
        self.mongo_proc.wait()
        self.start_mongo()

    # --- workers ------------------------------------------------------------------------

    def start_worker(self, pool: str, skew_s: float = 0.0) -> Worker:
        self._count += 1
        name = f"w{self._count}-{pool}" + (f"-skew{int(skew_s)}" if skew_s else "")
        log = self.workdir / f"{name}.log"
        env = self.env()
        if skew_s:
            env["CHAOS_SKEW_S"] = str(skew_s)
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.chaos.chaosapp", "worker", "-P", pool,
             "-c", "3", "-n", f"{name}-{self.tag}@%h", "--without-gossip", "--without-mingle",
             "--without-heartbeat", "--loglevel", "INFO"],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
            start_new_session=True)
        worker = Worker(name, proc, log, pool, skew_s)
        self.workers.append(worker)
        return worker

    def wait_ready(self, worker: Worker, timeout_s: float = 30.0) -> None:
        _wait(lambda: "ready." in worker.log.read_text(errors="replace"),
              f"worker {worker.name}", timeout_s)
        worker.pids = worker.group_pids()

    def supervise(self) -> list[Worker]:
        """Restart workers that exited on their own, as systemd or Kubernetes would: a Redis
        broker restart can crash a Celery worker ("Unrecoverable error: AttributeError:
        'NoneType' object has no attribute 'hostname'" in kombu's Redis transport; the same
        class of bug as celery/kombu#582). Returns the workers that had exited."""
        crashed = [w for w in self.workers if not w.alive() and not w.replaced]
        for worker in crashed:
            worker.replaced = True
            self.start_worker(worker.pool, worker.skew_s)
        return crashed

    def live_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.alive()]

    def stop(self) -> None:
        for worker in self.workers:
            worker.signal(signal.SIGCONT)
            worker.signal(signal.SIGTERM)
        for worker in self.workers:
            try:
                worker.proc.wait(10)
            except subprocess.TimeoutExpired:
                worker.signal(signal.SIGKILL)
        for proc in (self.redis_proc, self.mongo_proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.broker_kind == "amqp":  # the RabbitMQ server is shared: leave no queue behind
            with contextlib.suppress(Exception), kombu.Connection(RABBIT_URL) as conn:
                channel = conn.channel()
                channel.queue_delete(f"chaos-{self.tag}")
                channel.exchange_delete(f"chaos-{self.tag}")

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
