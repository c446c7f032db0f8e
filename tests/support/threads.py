"""Threads in tests whose failures fail the test.

An exception raised in a plain ``threading.Thread`` only prints (pytest turns it into a
warning), and a race test counting winners can pass with some contenders crashed. Threads
started here are joined on leaving the block and the first exception any of them raised is
re-raised in the test; one still running after ``timeout_s`` fails the test too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any


class ThreadsJoined:
    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    def start(self, target: Callable[..., Any], *args: Any) -> threading.Thread:
        def run() -> None:
            try:
                target(*args)
            except BaseException as exc:
                with self._lock:
                    self.errors.append(exc)

        thread = threading.Thread(target=run, name=f"test-{getattr(target, '__name__', 'fn')}",
                                  daemon=True)
        self.threads.append(thread)
        thread.start()
        return thread

    def join(self) -> None:
        # One deadline for all: joined one by one with ``timeout_s`` each, N hung threads
        # took N times that, past pytest's timeout, instead of failing here.
        deadline = time.monotonic() + self.timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self.threads if t.is_alive()]
        if self.errors:
            raise self.errors[0]
        if alive:
            raise AssertionError(f"threads still running after {self.timeout_s}s: {alive}")

    def __enter__(self) -> ThreadsJoined:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.join()
        else:  # the test already failed: still reap the threads, keep its error
            deadline = time.monotonic() + self.timeout_s
            for thread in self.threads:
                thread.join(max(0.0, deadline - time.monotonic()))


def race(target: Callable[[int], Any], contenders: int, timeout_s: float = 60.0) -> None:
    """Run ``target(i)`` for ``i`` in ``range(contenders)`` on threads released together by
    a barrier; raises the first exception any of them raised."""
    barrier = threading.Barrier(contenders, timeout=timeout_s)

    def contend(i: int) -> None:
        barrier.wait()
        target(i)

    with ThreadsJoined(timeout_s) as threads:
        for i in range(contenders):
            threads.start(contend, i)
