"""A real three-node Redis Cluster on loopback, started and stopped by the tests.

Three ``redis-server --cluster-enabled yes`` processes (Debian's ``redis-server`` package,
which ``./dev`` installs when missing) on free ports, each in its own temporary directory
(its ``nodes.conf`` and log), joined with ``redis-cli --cluster create ... --cluster-replicas
0``: every node a primary with a third of the 16384 slots. A node also listens on its port
+ 10000 (the cluster bus), so both ports are checked free. ``stop`` terminates exactly the
processes ``start`` made and removes the directory.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

NODES = 3
BUS_OFFSET = 10_000  # Redis Cluster's bus port is the client port + 10000


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_cluster_port(taken: set[int]) -> int:
    """A port free now whose bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port + BUS_OFFSET > 65535 or port in taken or port + BUS_OFFSET in taken:
            continue
        if _bindable(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free pair of ports for a Redis Cluster node")


def _executable(name: str) -> str:
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} is not installed: apt-get install redis-server "
                           "(./dev test installs it)")
    return found


def _ask(port: int, *command: str) -> object:
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        return client.execute_command(*command)
    finally:
        client.close()


def _cluster_ok(port: int) -> bool:
    info = _ask(port, "CLUSTER", "INFO")
    if isinstance(info, dict):
        return info.get("cluster_state") in ("ok", b"ok")
    return isinstance(info, bytes | str) and "cluster_state:ok" in (
        info.decode() if isinstance(info, bytes) else info)


class RedisClusterServer:
    """Three cluster-enabled ``redis-server`` processes joined into one cluster."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="pikku-redis-cluster-"))
        taken: set[int] = set()
        self.ports: list[int] = []
        for _ in range(NODES):
            port = _free_cluster_port(taken)
            taken.update((port, port + BUS_OFFSET))
            self.ports.append(port)
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """The ``redis+cluster://`` URL ``RedisLeaseService.from_url`` reads."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def client(self, **kwargs: object) -> RedisCluster:
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port)  # type: ignore[no-untyped-call]
                                           for port in self.ports], **kwargs)

    def start(self, timeout_s: float = 30.0) -> RedisClusterServer:
        server = _executable("redis-server")
        try:
            for port in self.ports:
                node_dir = self.workdir / str(port)
                node_dir.mkdir()
                self.procs.append(subprocess.Popen(
                    [server, "--port", str(port), "--bind", "127.0.0.1",
                     "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "5000", "--dir", str(node_dir),
                     "--save", "", "--appendonly", "no", "--daemonize", "no",
                     "--logfile", str(node_dir / "redis.log")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout_s
            for port in self.ports:
                self._await(lambda port=port: _ask(port, "PING"), deadline,
                            f"redis-server on port {port} to answer PING")
            created = subprocess.run(
                [_executable("redis-cli"), "--cluster", "create",
                 *(f"127.0.0.1:{port}" for port in self.ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, timeout=timeout_s, check=False)
            if created.returncode != 0:
                raise RuntimeError("redis-cli --cluster create failed: "
                                   + created.stdout.decode(errors="replace")[-2000:]
                                   + created.stderr.decode(errors="replace")[-2000:])
            for port in self.ports:  # every node must agree all slots are served
                self._await(lambda port=port: _cluster_ok(port), deadline,
                            f"node {port} to report cluster_state:ok")
        except BaseException:
            self.stop()
            raise
        return self

    def _await(self, check: object, deadline: float, what: str) -> None:
        assert callable(check)
        while True:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a redis-server exited with {proc.returncode} "
                                       f"while waiting for {what}; see {self.workdir}")
            try:
                if check():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs = []
        shutil.rmtree(self.workdir, ignore_errors=True)
