"""The standalone dashboard's waitress server, guarded against slow and greedy clients
before any request reaches the app (issue 35 item 4):

- **A cap on open connections per client address** (``connections_per_address``): a
  connection past it is answered ``503`` at once and closed, touching no other. One
  address can no longer take all of waitress's ``connection_limit`` slots.
- **A deadline for receiving a request** (``request_deadline_s``), headers and body: a
  connection waiting for a request, since it opened or since its last answer was sent,
  that has not delivered the whole request by then is closed (that one only). waitress's
  own ``channel_timeout`` is an idle timeout that every byte restarts, so a client sending
  one header byte every few seconds kept its slot for ever; nothing a client sends moves
  this deadline. The time the app takes to answer, and the time the answer takes to be
  sent, do not count against it.

``create_server`` builds the server as ``waitress.create_server`` does for TCP addresses,
with ``GuardedServer`` (a ``TcpWSGIServer``) and its ``DeadlineChannel``; everything else
(threads, limits, the asyncore loop) is waitress's own.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from typing import Any

from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import MultiSocketServer, TcpWSGIServer
from waitress.task import ThreadedTaskDispatcher

logger = logging.getLogger("pikku_celery.dashboard.server")
#: What a connection past the cap of its address is sent before it is closed.
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 5\r\n"
           b"Content-Type: text/plain\r\nContent-Length: 41\r\n\r\n"
           b"too many open connections from your host\n")
#: Seconds between two warnings of the same kind (an attack is not one line a connection).
WARN_EVERY_S = 60.0


class DeadlineChannel(HTTPChannel):  # type: ignore[misc]  # waitress has no types
    """A waitress channel that knows since when it has been waiting for a request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting_since: float = self.creation_time

    def service(self) -> None:
        """Serve a request (in a waitress thread); once none is left, the channel waits
        for the next from now."""
        super().service()
        if not self.requests:
            self.waiting_since = time.time()


class GuardedServer(TcpWSGIServer):  # type: ignore[misc]
    """waitress's TCP server with a cap on open connections per client address and a
    deadline for receiving a request (see the module)."""

    channel_class = DeadlineChannel

    def __init__(self, *args: Any, connections_per_address: int | None,
                 request_deadline_s: float, **kwargs: Any) -> None:
        if connections_per_address is not None and connections_per_address < 1:
            raise ValueError("connections_per_address must be at least 1 (None: no cap)")
        if request_deadline_s <= 0:
            raise ValueError("request_deadline_s must be positive")
        self.connections_per_address = connections_per_address
        self.request_deadline_s = request_deadline_s
        #: How often the deadline is checked (the loop also wakes at least every second).
        self.check_every_s = min(1.0, request_deadline_s / 4)
        self.next_check = 0.0
        self.counts: Counter[str] = Counter()
        self.next_warning: dict[str, float] = {}
        super().__init__(*args, **kwargs)

    def warn(self, kind: str, message: str, *args: Any) -> None:
        """Log ``message`` at most once every ``WARN_EVERY_S`` per ``kind``, with how many
        times it happened so far."""
        self.counts[kind] += 1
        now = time.time()
        if now >= self.next_warning.get(kind, 0.0):
            self.next_warning[kind] = now + WARN_EVERY_S
            logger.warning(f"{message} ({self.counts[kind]} so far)", *args)

    def readable(self) -> bool:
        """Called by the loop at each turn (at least once a second): check the deadline
        every ``check_every_s``, then waitress's own checks."""
        now = time.time()
        if now >= self.next_check:
            self.next_check = now + self.check_every_s
            self.close_late(now)
        return bool(super().readable())

    def close_late(self, now: float) -> None:
        """Close the channels that have waited longer than the deadline for a request."""
        for channel in list(self.active_channels.values()):
            if channel.requests or channel.total_outbufs_len:
                channel.waiting_since = now  # the app or the answer is in progress
            elif not channel.will_close and now - channel.waiting_since > (
                    self.request_deadline_s):
                channel.will_close = True  # waitress closes it at the loop's next turn
                self.warn("late", "closed a connection from %s: no whole request within "
                          "%g s", channel.addr[0], self.request_deadline_s)

    def accept(self) -> tuple[socket.socket, Any] | None:
        """waitress's ``handle_accept`` takes each new connection from here: one past the
        cap of its address is refused here and never becomes a channel."""
        accepted: tuple[socket.socket, Any] | None = super().accept()
        if accepted is None or self.connections_per_address is None:
            return accepted
        conn, addr = accepted
        host = addr[0]
        open_now = sum(1 for channel in self.active_channels.values()
                       if channel.addr[0] == host)
        if open_now < self.connections_per_address:
            return accepted
        refuse(conn)
        self.warn("refused", "refused a connection from %s: it has %d open, the cap per "
                  "address", host, open_now)
        return None


def refuse(conn: socket.socket) -> None:
    """Answer ``503`` on a new connection if its send buffer takes it at once, then close
    it; never blocks."""
    try:
        conn.setblocking(False)
        conn.send(REFUSAL)
    except OSError:
        pass
    finally:
        conn.close()


def create_server(application: Any, *, connections_per_address: int | None,
                  request_deadline_s: float, **adjustments: Any) -> Any:
    """A waitress server for ``application`` on the TCP addresses of ``adjustments``
    (``host``, ``port``, ``listen``: waitress's), guarded; not yet serving (``run()``).
    One address: the ``GuardedServer``; several: waitress's ``MultiSocketServer`` of them."""
    adj = Adjustments(**adjustments)
    dispatcher = ThreadedTaskDispatcher()
    dispatcher.set_thread_count(adj.threads)
    socket_map: dict[int, Any] = {}
    servers = [GuardedServer(application, socket_map, dispatcher=dispatcher, adj=adj,
                             sockinfo=sockinfo,
                             connections_per_address=connections_per_address,
                             request_deadline_s=request_deadline_s)
               for sockinfo in adj.listen]
    if len(servers) == 1:
        return servers[0]
    return MultiSocketServer(socket_map, adj,
                             [(s.effective_host, s.effective_port) for s in servers],
                             dispatcher, servers[-1].log_info)
