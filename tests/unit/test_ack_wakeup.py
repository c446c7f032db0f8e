"""A late ack handed to the worker's event loop from a pool thread goes out on the loop's next
turn (``worker.ack_wakeup``), on the installed kombu's real hub: before kombu 5.7 it waited
for the loop's next timer, and a threads-pool worker of pikku's queue fetched nothing
meanwhile (the oldest matrix cell's runs waited ten seconds after each burst of steps)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from kombu.asynchronous import Hub
from kombu.asynchronous.timer import Timer

from pikku_celery.worker import ack_wakeup


class _LoopThread:
    """A kombu hub looping in a thread of its own, as a worker's main thread loops, with a
    far timer and an idle reader: the poll waits its longest unless something wakes it."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.stop = threading.Event()
        self.idle_reader, self.idle_writer = socket.socketpair()
        hub.add_reader(self.idle_reader, lambda: None)
        hub.call_later(3600, lambda: None)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        loop = self.hub.create_loop()
        while not self.stop.is_set():
            next(loop)

    def in_loop(self, fn: object) -> None:
        """Run ``fn`` in the loop's thread and wait for it."""
        done = threading.Event()

        def call() -> None:
            fn()  # type: ignore[operator]
            done.set()
        self.hub.call_soon(call)
        if not self.thread.is_alive():
            self.thread.start()
        assert done.wait(15), "the loop never ran its first callbacks"

    def close(self) -> None:
        self.stop.set()
        self.hub.call_soon(lambda: None)
        self.idle_writer.send(b"x")  # the loop is polling: wake it to see the stop
        self.thread.join(15)
        self.idle_reader.close()
        self.idle_writer.close()


@pytest.fixture
def looping(monkeypatch: pytest.MonkeyPatch) -> Iterator[_LoopThread]:
    # The one-second guard would hide a wake-up that does not work: push it out of reach.
    monkeypatch.setattr(ack_wakeup, "GUARD_INTERVAL_S", 3600.0)
    # A worker's hub polls for up to its timer's max_interval (Celery's event loop: 10 s).
    loop = _LoopThread(Hub(timer=Timer(max_interval=10.0)))
    try:
        yield loop
    finally:
        loop.close()


def test_a_callback_handed_over_from_another_thread_runs_without_waiting_for_a_timer(
        looping: _LoopThread) -> None:
    installed: list[bool] = []
    looping.in_loop(lambda: installed.append(ack_wakeup.install(looping.hub)))
    assert installed == [not ack_wakeup.has_native_wakeup(looping.hub)]
    for _ in range(3):  # and again: one pending byte per wake, cleared by each read
        acked = threading.Event()
        done = threading.Event()

        def pool_thread(acked: threading.Event = acked, done: threading.Event = done) -> None:
            looping.hub.call_soon(acked.set)  # what Celery does with message.ack
            done.set()
        threading.Thread(target=pool_thread).start()
        assert done.wait(5)
        # Without a wake-up the loop sleeps until its next timer: up to 10 s in kombu.
        assert acked.wait(5), "the ack waited for the loop's next timer"


def test_it_is_installed_once_and_never_over_kombus_own() -> None:
    hub = Hub()
    if ack_wakeup.has_native_wakeup(hub):
        assert not ack_wakeup.install(hub)
        return
    assert ack_wakeup.install(hub)
    assert not ack_wakeup.install(hub)
    assert not ack_wakeup.install(None)
