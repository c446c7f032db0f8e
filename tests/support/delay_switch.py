"""A userspace Ethernet switch between TAP devices that delays and drops frames (issue 37).

The partition rig (tests/support/netrig.py, ``NetRig(links="switch")``) runs on it where the
kernel has no ``sch_netem``: every node's ``eth0`` and the root namespace's address are
TAP devices of this one process instead of veths on a bridge, so a frame from any node to
any other (or to the test process) passes through here, where it is held ``delay_ms`` and
dropped with probability ``loss`` on each link it crosses.

* A learning switch: the source MAC of every frame is learned for its port; a frame to a
  known unicast MAC goes to that port, a broadcast, multicast or unknown one to every other
  port.
* Delay: each frame is queued for each destination port with the release time ``arrival +
  delay``; one FIFO per destination port, so frames leave in the order they came even when
  the delay changes (a frame never overtakes the one before it). One loop, ``poll`` with a
  timeout to the next release.
* Loss: a frame is dropped with probability ``loss`` when it comes in on a port and again
  when it goes out on one (each node's link is one port: "loss on every link", as
  ``iptables`` loss in and out of each node's namespace does: about ``2 * loss`` end to
  end), unless it comes from or goes to a port added ``lossless`` (the root namespace's,
  so the test process's own traffic is not made lossy, like ``NetRig.loss``). The delay
  applies to every frame, once (``delay_ms`` one way, twice that a round trip).
* Control: a unix stream socket (``--control PATH``), one JSON request per connection, one
  JSON reply: ``{"op": "add", "port": NAME, "ifname": "eth0", "netns": PATH|null,
  "lossless": bool}`` creates the TAP (``IFF_TAP | IFF_NO_PI``) inside the namespace whose
  file is ``netns`` (entered with ``setns``, left again at once); ``{"op": "set",
  "delay_ms": D, "loss": P}`` changes the impairment at run time (either key alone too);
  ``{"op": "remove", "port": NAME}``; ``{"op": "stats"}``. The TAPs are not persistent:
  they disappear with this process (or with their namespace).

Run as ``python delay_switch.py --control PATH [--delay-ms D] [--loss P] [--seed S]``; it
prints ``ready`` once the control socket listens. Stdlib only; Linux; needs root
(``/dev/net/tun``, ``setns``). SIGTERM ends it (its TAPs go with it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import errno
import fcntl
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from typing import Any

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
MAX_FRAME = 65536
MAX_QUEUE = 20000  # frames per destination port; beyond it the frame is dropped
READ_BURST = 64  # frames read from one port per loop turn (fairness between ports)


class Port:
    def __init__(self, name: str, fd: int, ifname: str, lossless: bool) -> None:
        self.name = name
        self.fd = fd
        self.ifname = ifname
        self.lossless = lossless
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.rx = self.tx = self.lost = self.overflow = self.errors = 0


class Switch:
    def __init__(self, control: str, delay_ms: float = 0.0, loss: float = 0.0,
                 seed: int | None = None) -> None:
        self.delay_s = delay_ms / 1000.0
        self.loss = loss
        self.rng = random.Random(seed)
        self.ports: dict[str, Port] = {}
        self.by_fd: dict[int, Port] = {}
        self.macs: dict[bytes, Port] = {}
        self.poll = select.poll()
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.root_ns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(control)
        self.control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.control.bind(control)
        self.control.listen(16)
        self.control.setblocking(False)
        self.poll.register(self.control.fileno(), select.POLLIN)

    # --- ports -----------------------------------------------------------------------------

    def _setns(self, fd: int) -> None:
        if self.libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns: {os.strerror(err)}")

    def add_port(self, name: str, ifname: str, netns: str | None, lossless: bool) -> Port:
        if name in self.ports:
            raise ValueError(f"port {name} exists")
        if len(ifname.encode()) > 15:
            raise ValueError(f"interface name {ifname!r} too long")
        ns_fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC) if netns else None
        try:
            if ns_fd is not None:
                self._setns(ns_fd)
            try:
                fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
                try:
                    ifr = struct.pack("16sH22x", ifname.encode(), IFF_TAP | IFF_NO_PI)
                    out = fcntl.ioctl(fd, TUNSETIFF, ifr)
                except BaseException:
                    os.close(fd)
                    raise
            finally:
                if ns_fd is not None:
                    self._setns(self.root_ns)  # back to the root namespace, whatever happened
        finally:
            if ns_fd is not None:
                os.close(ns_fd)
        port = Port(name, fd, out[:16].rstrip(b"\0").decode(), lossless)
        self.ports[name] = port
        self.by_fd[fd] = port
        self.poll.register(fd, select.POLLIN)
        return port

    def remove_port(self, port: Port) -> None:
        if self.ports.get(port.name) is not port:
            return
        del self.ports[port.name]
        del self.by_fd[port.fd]
        with contextlib.suppress(OSError):
            self.poll.unregister(port.fd)
        os.close(port.fd)
        for mac in [m for m, p in self.macs.items() if p is port]:
            del self.macs[mac]

    # --- frames ----------------------------------------------------------------------------

    def _lost(self, port: Port) -> bool:
        if self.rng.random() < self.loss:
            port.lost += 1
            return True
        return False

    def receive(self, port: Port, now: float) -> None:
        for _ in range(READ_BURST):
            try:
                frame = os.read(port.fd, MAX_FRAME)
            except BlockingIOError:
                return
            except OSError:  # the TAP is gone (its namespace deleted)
                self.remove_port(port)
                return
            if len(frame) < 14:
                continue
            port.rx += 1
            src, dst = frame[6:12], frame[0:6]
            if not src[0] & 1:
                self.macs[src] = port
            target = None if dst[0] & 1 else self.macs.get(dst)
            if target is port:
                continue
            targets = [target] if target is not None else [
                p for p in self.ports.values() if p is not port]
            due = now + self.delay_s
            lost_in: bool | None = None  # drawn once per frame, if a lossy target needs it
            for out in targets:
                if self.loss > 0 and not (port.lossless or out.lossless):
                    if lost_in is None:
                        lost_in = self._lost(port)
                    if lost_in or self._lost(out):
                        continue
                if len(out.queue) >= MAX_QUEUE:
                    out.overflow += 1
                    continue
                out.queue.append((due, frame))

    def release(self, now: float) -> float | None:
        """Send every frame that is due; the time of the next release (None: none
        queued)."""
        nxt = None
        for port in list(self.ports.values()):
            q = port.queue
            while q and q[0][0] <= now:
                _, frame = q.popleft()
                try:
                    os.write(port.fd, frame)
                    port.tx += 1
                except BlockingIOError:
                    port.errors += 1
                except OSError as exc:
                    port.errors += 1
                    if exc.errno in (errno.EBADFD, errno.EBADF, errno.ENODEV):
                        self.remove_port(port)
                        break
            if q and (nxt is None or q[0][0] < nxt):
                nxt = q[0][0]
        return nxt

    # --- control ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {"delay_ms": self.delay_s * 1000.0, "loss": self.loss, "ports": {
            p.name: {"ifname": p.ifname, "lossless": p.lossless, "rx": p.rx, "tx": p.tx,
                     "lost": p.lost, "overflow": p.overflow, "errors": p.errors,
                     "queued": len(p.queue)} for p in self.ports.values()}}

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "add":
            port = self.add_port(str(request["port"]), str(request.get("ifname", "eth0")),
                                 request.get("netns"), bool(request.get("lossless", False)))
            return {"ok": True, "ifname": port.ifname}
        if op == "remove":
            gone = self.ports.get(str(request["port"]))
            if gone is not None:
                self.remove_port(gone)
            return {"ok": True}
        if op == "set":
            if "delay_ms" in request:
                delay_ms = float(request["delay_ms"])
                if not 0 <= delay_ms <= 60_000:
                    raise ValueError(f"delay_ms {delay_ms} out of range")
                self.delay_s = delay_ms / 1000.0
            if "loss" in request:
                loss = float(request["loss"])
                if not 0 <= loss <= 1:
                    raise ValueError(f"loss {loss} out of range")
                self.loss = loss
            return {"ok": True, "delay_ms": self.delay_s * 1000.0, "loss": self.loss}
        if op == "stats":
            return {"ok": True, **self.stats()}
        raise ValueError(f"unknown op {op!r}")

    def serve_control(self) -> None:
        try:
            conn, _ = self.control.accept()
        except BlockingIOError:
            return
        with conn:
            conn.settimeout(2.0)
            try:
                data = _read_line(conn)
                try:
                    reply = self.handle(json.loads(data))
                except Exception as exc:  # the error goes back to the caller
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        nxt: float | None = None
        while True:
            now = time.monotonic()
            timeout_ms = -1 if nxt is None else max(0, int((nxt - now) * 1000) + 1)
            try:
                events = self.poll.poll(timeout_ms)
            except InterruptedError:
                events = []
            now = time.monotonic()
            for fd, mask in events:
                if fd == self.control.fileno():
                    self.serve_control()
                    continue
                port = self.by_fd.get(fd)
                if port is None:
                    continue
                if mask & (select.POLLERR | select.POLLHUP | select.POLLNVAL) and not (
                        mask & select.POLLIN):
                    self.remove_port(port)
                    continue
                self.receive(port, now)
            nxt = self.release(time.monotonic())


def _read_line(conn: socket.socket) -> bytes:
    """One control message: JSON ending with a newline (or what came before EOF)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def request(control: str, payload: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """One control request to the switch listening on ``control``; its reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(control)
        s.sendall(json.dumps(payload).encode() + b"\n")
        data = _read_line(s)
    reply: dict[str, Any] = json.loads(data)
    if not reply.get("ok"):
        raise RuntimeError(f"delay switch: {payload.get('op')}: {reply.get('error')}")
    return reply


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--control", required=True, help="unix socket path for control")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    switch = Switch(args.control, args.delay_ms, args.loss, args.seed)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ends it at once; the TAPs go with it
    print("ready", flush=True)
    switch.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
