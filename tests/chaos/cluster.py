"""Real processes for a chaos run: a private Redis (so it can be restarted), a real 3-node
``mongod`` replica set (MongoDB 6.0.5 from tests/support/mongod.py, election timeout 2 s, so
its primary can be killed, stepped down or stalled), a broker, and
``celery -A tests.chaos.chaosapp`` workers, each in its own process group.

With ``netns=True`` (``run.py --netns``, issue 37) every one of them runs in a network
namespace of its own on one bridge (tests/support/netrig.py): each ``mongod`` (``m0``..
``m2``), Redis (``redis``, leases and broker), each worker (``w1``, ``w2``, ...), so the
partition faults can cut links between them. The Redis broker only: RabbitMQ listens on
the root namespace's loopback, out of the namespaces' reach."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pymongo
import pymongo.errors
import redis
from kombu.connection import Connection

from tests.support import netrig
from tests.support.mongod import MongodNode, MongodReplicaSet, free_port

MONGO_MEMBERS = 3
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
    role: str = ""  # its namespace's node in the rig (``netns`` runs)
    faketime: str = ""  # libfaketime's FAKETIME for the whole process ("+30s"), if any

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
    def __init__(self, workdir: Path, broker: str, netns: bool = False) -> None:
        self.workdir = workdir
        self.broker_kind = broker
        self.redis_port = free_port()
        self.rig: netrig.NetRig | None = None
        if netns:
            if broker == "amqp":
                raise RuntimeError("chaos --netns runs on the Redis broker only: RabbitMQ "
                                   "listens on loopback, out of the namespaces' reach")
            self.rig = netrig.NetRig(workdir / "rig")
            self.rig.add_node("redis")
            self.replset = netrig.netns_replset(self.rig, MONGO_MEMBERS)
        else:
            self.replset = MongodReplicaSet(MONGO_MEMBERS)
        self.tag = uuid.uuid4().hex[:8]
        (workdir / "ledger").mkdir(parents=True, exist_ok=True)
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.workers: list[Worker] = []
        self._count = 0

    # --- services -----------------------------------------------------------------------

    @property
    def redis_host(self) -> str:
        return self.rig.node("redis").ip if self.rig is not None else "127.0.0.1"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.redis_host}:{self.redis_port}/0"

    @property
    def mongo_url(self) -> str:
        return self.replset.url_for("chaos")

    @property
    def broker_url(self) -> str:
        return (RABBIT_URL if self.broker_kind == "amqp"
                else f"redis://{self.redis_host}:{self.redis_port}/1")

    def env(self) -> dict[str, str]:
        return {**os.environ, "CHAOS_BROKER": self.broker_url, "CHAOS_REDIS": self.redis_url,
                "CHAOS_MONGO": self.mongo_url, "CHAOS_QUEUE": f"chaos-{self.tag}",
                "CHAOS_PREFIX": f"chaos-{self.tag}",
                "CHAOS_LEDGER": str(self.workdir / "ledger"),
                "CHAOS_VISIBILITY_S": "5"}

    def start_redis(self) -> None:
        argv = ["redis-server", "--port", str(self.redis_port), "--bind", self.redis_host,
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        if self.rig is not None:
            argv = ["ip", "netns", "exec", self.rig.node("redis").ns, *argv,
                    "--protected-mode", "no"]
        self.redis_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL)
        client = redis.Redis(host=self.redis_host, port=self.redis_port, socket_timeout=1)
        _wait(client.ping, "redis")

    def start_mongo(self) -> None:
        self.replset.start()

    def restart_redis(self) -> None:
        assert self.redis_proc is not None
        self.redis_proc.kill()
        self.redis_proc.wait()
        self.start_redis()

    def restart_mongo(self) -> None:
        """A power cut of the whole set: SIGKILL every node at once, start them again on
        their ports and data, and wait for a primary (majority writes were journaled on a
        majority, so none is lost)."""
        for node in self.replset.nodes:
            node.kill()
        for node in self.replset.nodes:
            node.start()
        self.replset.wait_for_primary(60)

    def primary(self, timeout_s: float = 10.0) -> MongodNode:
        return self.replset.wait_for_primary(timeout_s)

    def wait_for_new_primary(self, old: MongodNode, timeout_s: float = 60.0) -> MongodNode:
        """A primary other than ``old`` (which may be dead, stalled or stepped down)."""
        return self.replset.wait_for_primary(timeout_s, not_node=old)

    def step_down(self, node: MongodNode, seconds: int = 5) -> None:
        """``replSetStepDown`` on ``node`` (the primary); it closes its connections as it
        steps down."""
        with node.client(serverSelectionTimeoutMS=2000) as client, contextlib.suppress(
                pymongo.errors.AutoReconnect):
            client.admin.command("replSetStepDown", seconds, secondaryCatchUpPeriodSecs=2)

    def mongo_healthy(self) -> bool:
        """Every node up, one PRIMARY and the others SECONDARY (caught up enough to vote and
        to count towards a majority write)."""
        if not all(node.alive() for node in self.replset.nodes):
            return False
        try:
            primary = self.replset.wait_for_primary(1.0)
            with primary.client(serverSelectionTimeoutMS=1000) as client:
                status = client.admin.command("replSetGetStatus")
        except (RuntimeError, pymongo.errors.PyMongoError):
            return False
        states = [m["stateStr"] for m in status["members"]]
        return states.count("PRIMARY") == 1 and states.count("SECONDARY") == len(states) - 1

    def rollbacks(self) -> tuple[int, Counter[str]]:
        """How many rollbacks the nodes went through (an ex-primary, or a secondary that
        copied from it, undoing writes the new primary never had) and the operations they
        reverted, from the nodes' logs. None of those writes was majority-acknowledged: the
        checker shows whether the store lost one it acted on."""
        count, reverted = 0, Counter[str]()
        for node in self.replset.nodes:
            with contextlib.suppress(OSError):
                for line in node.log.read_text(errors="replace").splitlines():
                    if '"Rollback reverted command counts"' not in line:
                        continue
                    count += 1
                    with contextlib.suppress(ValueError, KeyError):
                        reverted.update(json.loads(line)["attr"])
        return count, reverted

    def keep_mongo_logs(self) -> None:
        for node in self.replset.nodes:
            with contextlib.suppress(OSError):
                shutil.copy(node.log, self.workdir / f"mongod-{node.port}.log")

    # --- workers ------------------------------------------------------------------------

    def start_worker(self, pool: str, skew_s: float = 0.0, faketime: str = "") -> Worker:
        """``skew_s``: pikku's clock reads moved (time-machine, in the app); ``faketime``
        (``netns`` runs): the whole process's wall clock, under libfaketime."""
        self._count += 1
        name = (f"w{self._count}-{pool}" + (f"-skew{int(skew_s)}" if skew_s else "")
                + (f"-faketime{faketime}" if faketime else ""))
        log = self.workdir / f"{name}.log"
        env = self.env()
        if skew_s:
            env["CHAOS_SKEW_S"] = str(skew_s)
        run = ["-m"]
        if faketime:
            lib = netrig.libfaketime()
            if lib is None:
                raise RuntimeError("no libfaketime: apt-get install -y faketime libfaketime")
            env.update({"LD_PRELOAD": lib, "FAKETIME": faketime,
                        "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
            run = ["-m", "tests.support.faketime_shim"]  # a time.sleep that works there
        argv = [sys.executable, *run, "celery", "-A", "tests.chaos.chaosapp", "worker", "-P",
                pool, "-c", "3", "-n", f"{name}-{self.tag}@%h", "--without-gossip",
                "--without-mingle", "--without-heartbeat", "--loglevel", "INFO"]
        role = ""
        if self.rig is not None:
            role = f"w{self._count}"
            self.rig.add_node(role)
            env["PIKKU_NETRIG"] = self.rig.tag
            argv = ["ip", "netns", "exec", self.rig.node(role).ns, *argv]
        proc = subprocess.Popen(
            argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
            start_new_session=True)
        worker = Worker(name, proc, log, pool, skew_s, role=role, faketime=faketime)
        self.workers.append(worker)
        return worker

    def wait_ready(self, worker: Worker, timeout_s: float = 30.0) -> None:
        # A worker killed while it starts (a fault may pick it) is not waited for.
        _wait(lambda: not worker.alive() or "ready." in worker.log.read_text(errors="replace"),
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
            self.start_worker(worker.pool, worker.skew_s, worker.faketime)
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
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            self.redis_proc.kill()
            self.redis_proc.wait()
        self.replset.stop()
        if self.rig is not None:
            self.rig.close()  # every namespace (and whatever still runs in it), the bridge
        if self.broker_kind == "amqp":  # the RabbitMQ server is shared: leave no queue behind
            with contextlib.suppress(Exception), Connection(RABBIT_URL) as conn:  # type: ignore[no-untyped-call]
                channel = conn.channel()
                channel.queue_delete(f"chaos-{self.tag}")
                channel.exchange_delete(f"chaos-{self.tag}")

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
