"""Start the nx-27017 MongoDB wire-protocol stand-in as a real server process.

It speaks the MongoDB protocol over TCP, so pymongo in any number of processes (workers,
race tests) shares it, as they would share a real mongod. See
``../shared/design/test-infrastructure.md`` for what it gets right and wrong.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pymongo


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _executable() -> str:
    beside = Path(sys.executable).with_name("nx-27017")
    found = str(beside) if beside.exists() else shutil.which("nx-27017")
    if not found:
        raise RuntimeError("nx-27017 is not installed: pip install -e '.[test]'")
    return found


class NxServer:
    """One nx-27017 process on a free port, with its own pid and log files."""

    def __init__(self, data_dir: str = "memory") -> None:
        self.port = free_port()
        self.workdir = tempfile.mkdtemp(prefix="pikku-nx-")
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}/?directConnection=true"

    def url_for(self, database: str) -> str:
        return f"mongodb://127.0.0.1:{self.port}/{database}?directConnection=true"

    def start(self, timeout_s: float = 15.0) -> NxServer:
        log = open(os.path.join(self.workdir, "stdout.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [_executable(), "--data-dir", self.data_dir, "--port", str(self.port),
             "--pid-file", os.path.join(self.workdir, "nx.pid"),
             "--log-file", os.path.join(self.workdir, "nx.log")],
            cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nx-27017 exited with {self.proc.returncode}; "
                                   f"see {self.workdir}")
            try:
                client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(
                    self.url, serverSelectionTimeoutMS=300)
                client.admin.command("ping")
                client.close()
                return self
            except pymongo.errors.PyMongoError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"nx-27017 did not accept connections within {timeout_s}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        shutil.rmtree(self.workdir, ignore_errors=True)
