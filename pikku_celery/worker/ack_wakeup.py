"""Late acknowledgements that reach the broker when their task ends, on kombu before 5.7.

A task of the ``threads`` pool ends in a pool thread, and Celery acknowledges its message
(pikku's tasks are all ``acks_late``) by handing ``message.ack`` to the worker's event loop
with ``hub.call_soon``. kombu 5.7 wakes the loop for it (a socket pair the loop polls);
earlier releases do not, so the ack waits until the loop wakes for something else: a message
for a free slot, or its next timer, about ten seconds away on a Redis broker. A worker that
consumes only pikku's queue prefetches one message per thread, so once its threads have
finished it has no free slot until those acks go out, and it fetches nothing meanwhile: a
run's next step, sent by the step that just ended, waited ten seconds (celery/celery#6941).

This gives an older hub the wake-up kombu 5.7 has: ``call_soon`` from any thread but the
loop's writes one byte to a socket the loop reads, so the ack goes out on the loop's next
turn. A repeating one-second timer bounds the wait should the reader ever be lost (a hub
reset on reconnection). Installed once per hub, in the loop's own thread (Celery's
``worker_ready`` is sent from there); a hub with kombu's own wake-up is left alone.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

#: The attribute that marks a hub given a wake-up (one per hub, however many apps).
_INSTALLED = "_pikku_ack_wakeup"
#: The longest an acknowledgement can wait should the wake-up socket stop being read.
GUARD_INTERVAL_S = 1.0


def has_native_wakeup(hub: Any) -> bool:
    """kombu 5.7's hub wakes its own loop for ``call_soon`` from another thread."""
    return "_waker" in vars(hub)


def install(hub: Any) -> bool:
    """Give ``hub`` (a worker's event loop) a wake-up for callbacks handed over from other
    threads. Call it from the loop's thread. Returns whether one was installed now."""
    if hub is None or has_native_wakeup(hub) or getattr(hub, _INSTALLED, None) is not None:
        return False
    wakeup = _LoopWakeup(hub)
    setattr(hub, _INSTALLED, wakeup)
    return True


class _LoopWakeup:
    """A socket pair the loop reads; ``call_soon`` from another thread writes to it."""

    def __init__(self, hub: Any) -> None:
        self._hub = hub
        self._loop_thread = threading.get_ident()
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._lock = threading.Lock()
        self._pending = False  # a byte is on its way: one is enough for any number of calls
        original = hub.call_soon

        def call_soon(callback: Any, *args: Any) -> Any:
            handed = original(callback, *args)
            if threading.get_ident() != self._loop_thread:
                self._wake()
            return handed

        hub.call_soon = call_soon
        self._read()
        hub.call_repeatedly(GUARD_INTERVAL_S, self._read)

    def _read(self) -> None:
        """(Re-)register the reader: a hub reset on reconnection drops every reader."""
        if self._reader.fileno() not in self._hub.readers:
            self._hub.add_reader(self._reader, self._drain)

    def _wake(self) -> None:
        with self._lock:
            if self._pending:
                return
            self._pending = True
        with contextlib.suppress(OSError):  # a full buffer is a wake-up already on its way
            self._writer.send(b"\0")

    def _drain(self) -> None:
        # Cleared before reading: a call made meanwhile writes again, and a callback added
        # before this read runs at the top of the loop's next turn anyway.
        with self._lock:
            self._pending = False
        with contextlib.suppress(OSError):
            self._reader.recv(4096)
