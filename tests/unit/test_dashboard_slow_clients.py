"""Issue 35 item 4: slow clients cannot lock the standalone dashboard (``pikku dashboard``,
on waitress) before login. Real sockets against the real server on a free loopback port:
a cap on open connections per client address, and a deadline for receiving a request
that a trickle of bytes cannot extend (waitress's own ``channel_timeout`` restarts at
every byte). Every connection here comes from loopback; the cap's "other address" is
127.0.0.2, which Linux routes to the loopback interface like 127.0.0.1."""

from __future__ import annotations

import contextlib
import http.client
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from waitress import wasyncore

from pikku_celery.dashboard import standalone
from tests.unit.test_contrib import make_pikku

pytestmark = pytest.mark.timeout(60)
TOKEN = "slow-clients-" + "t" * 20
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OTHER = "127.0.0.2"  # another client address, on loopback too


@contextlib.contextmanager
def serving(app: Any = None, **limits: Any) -> Iterator[Any]:
    """``standalone.create_server`` on a free port of 127.0.0.1, serving in a thread."""
    if app is None:
        app = standalone.make_app(make_pikku(), token=TOKEN, plain_http=True)
    server = standalone.create_server(app, "127.0.0.1", 0, **limits)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield server
    finally:  # its threads, then every socket, closed in the loop's own thread
        server.task_dispatcher.shutdown()
        server.trigger.pull_trigger(lambda: wasyncore.close_all(server._map))
        thread.join(10)
        assert not thread.is_alive()


def connect(server: Any, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.effective_port), timeout=5,
                                    source_address=(source, 0))


def get(server: Any, path: str = "/api/runs", timeout: float = 3.0,
        source: str = "127.0.0.1") -> int | None:
    """A whole request on a new connection from ``source``: its status (``None``: the
    connection was closed before an answer)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.effective_port,
                                            timeout=timeout, source_address=(source, 0))
    try:
        connection.request("GET", path, headers=AUTH)
        response = connection.getresponse()
        response.read()
        return response.status
    except (ConnectionError, http.client.RemoteDisconnected):
        return None
    finally:
        connection.close()


def closed_by_server(sock: socket.socket, wait_s: float = 0.0) -> bool:
    """Whether the server has closed ``sock`` (end of stream or reset) within ``wait_s``."""
    if not select.select([sock], [], [], wait_s)[0]:
        return False
    try:
        return sock.recv(4096) == b""
    except OSError:
        return True


def trickle_until_cut(sock: socket.socket, limit_s: float, every_s: float = 0.1) -> float:
    """Send one more header byte every ``every_s`` until the server closes the
    connection: the seconds that took (``limit_s`` when it never did)."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        try:
            sock.send(b"x")
        except OSError:
            return time.monotonic() - started
        if closed_by_server(sock):
            return time.monotonic() - started
        time.sleep(every_s)
    return limit_s


def refused(sock: socket.socket) -> bool:
    """A request sent on ``sock`` gets the 503 of a refused connection, or none at all
    (closed before it was read), never the app's answer."""
    with contextlib.suppress(OSError):
        sock.sendall(b"GET /api/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + TOKEN.encode() + b"\r\n\r\n")
    try:
        answer = sock.recv(4096)
    except ConnectionResetError:
        return True
    return answer == b"" or answer.startswith(b"HTTP/1.1 503 ")


def keep_alive_request(connection: http.client.HTTPConnection) -> int:
    connection.request("GET", "/api/runs", headers=AUTH)
    response = connection.getresponse()
    response.read()
    return response.status


# --- the deadline ------------------------------------------------------------------------------


def test_a_trickle_of_header_bytes_is_cut_at_the_deadline() -> None:
    """One byte every 0.1 s restarts waitress's idle timeout; the deadline (1 s here)
    counts from the connection's start whatever arrives meanwhile. A connection that
    sends nothing is cut at the same deadline, and neither touches another connection."""
    with serving(request_deadline_s=1.0) as server:
        silent = connect(server)
        trickler = connect(server)
        trickler.sendall(b"GET /api/runs HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        took = trickle_until_cut(trickler, limit_s=6.0)
        assert 0.9 <= took <= 3.5, f"the trickler was cut after {took:.1f} s"
        assert closed_by_server(silent, wait_s=1.0)  # cut at the same turn of the loop
        assert get(server) == 200  # the server serves on
        trickler.close()
        silent.close()


def test_the_deadline_spares_a_slow_app_and_a_busy_keep_alive_connection() -> None:
    """What the deadline times is the client sending a request: not the app answering
    it (1.5 s here, past a 1 s deadline), and it starts again once an answer is sent,
    so a keep-alive connection asking every 0.3 s lives on past the deadline."""
    def slow_app(environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/slow":
            time.sleep(1.5)
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
        return [b"ok"]

    with serving(slow_app, request_deadline_s=1.0) as server:
        assert get(server, "/slow", timeout=5) == 200
        connection = http.client.HTTPConnection("127.0.0.1", server.effective_port,
                                                timeout=3)
        started = time.monotonic()
        asked = 0
        while time.monotonic() - started < 2.5:
            assert keep_alive_request(connection) == 200
            asked += 1
            time.sleep(0.3)
        first = connection.sock
        assert keep_alive_request(connection) == 200
        assert connection.sock is first and asked >= 6  # one connection all along
        connection.close()


# --- the cap per client address ------------------------------------------------------------------


def test_one_address_gets_at_most_its_cap_of_connections(
        caplog: pytest.LogCaptureFixture) -> None:
    """With a cap of 3, a fourth open connection from 127.0.0.2 is refused (503 or
    closed) while its three others are served on, and 127.0.0.1 is not affected;
    once one of the three closes, 127.0.0.2 may open another. Refusals are logged once
    a minute, not once each."""
    # An in-process Celery worker earlier in this process may have left the root logger at
    # ERROR: ask for the server's warnings here.
    with caplog.at_level(logging.WARNING, logger="pikku_celery.dashboard.server"), \
            serving(connections_per_address=3) as server:
        port = server.effective_port
        held = [http.client.HTTPConnection("127.0.0.1", port, timeout=3,
                                           source_address=(OTHER, 0)) for _ in range(3)]
        for connection in held:  # each accepted and served: its slot taken
            assert keep_alive_request(connection) == 200
        for _ in range(2):
            extra = connect(server, OTHER)
            assert refused(extra)
            extra.close()
        warned = [r.getMessage() for r in caplog.records if "refused a connection" in r.message]
        assert warned == ["refused a connection from 127.0.0.2: it has 3 open, the cap per "
                          "address (1 so far)"]
        assert get(server) == 200  # another address is not capped by 127.0.0.2's
        for connection in held:  # the refusal closed only the fourth connection
            assert keep_alive_request(connection) == 200
        held.pop().close()
        deadline = time.monotonic() + 3
        while get(server, source=OTHER) != 200:  # the server sees the close at its next turn
            assert time.monotonic() < deadline, "127.0.0.2 stayed refused"
            time.sleep(0.1)
        for connection in held:
            connection.close()


def test_trickling_connections_from_one_address_do_not_block_a_real_request() -> None:
    """The issue's attack: 70 connections trickling header bytes (more than waitress's
    64-connection limit) from one address. With the defaults (8 per address, a 10 s
    deadline) a request from another address is answered at once."""
    with serving() as server:
        tricklers = []
        for _ in range(70):
            sock = connect(server, OTHER)
            with contextlib.suppress(OSError):
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            tricklers.append(sock)
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.5):
                for sock in tricklers:
                    with contextlib.suppress(OSError):
                        sock.send(b"x")

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        try:
            time.sleep(1.0)  # the server has taken (or refused) every one of them
            started = time.monotonic()
            assert get(server, timeout=3) == 200
            assert time.monotonic() - started < 3
        finally:
            stop.set()
            thread.join(5)
            for sock in tricklers:
                sock.close()


def test_pikku_dashboard_serves_with_the_documented_defaults() -> None:
    assert (standalone.CONNECTIONS_PER_ADDRESS, standalone.REQUEST_DEADLINE_S) == (8, 10)
    with serving() as server:
        assert (server.connections_per_address, server.request_deadline_s) == (8, 10)
        assert server.effective_host == "127.0.0.1"
