"""Announcements of a key: "what this key guards is done", pushed to whoever listens, so a
caller waiting for a run's end (``PikkuCelery.wait``) hears of it at once instead of at
its next poll, as Celery's ``AsyncResult.get`` hears of a task's result from the Redis
result backend.

They are hints, never the record: an announcement is fire and forget (Redis pub/sub keeps
nothing for a subscriber that is not connected), so a listener reads what the key guards
once it listens and keeps reading on a backstop timer; a missed announcement costs latency,
never a wrong answer. In memory they are a condition variable; in Redis one ``PUBLISH``
(made inside the hand-back script of the pass that ended the run: no extra round trip) and
one ``SUBSCRIBE`` connection per listener."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("pikku_celery.leases")

# How long a Redis listener waits for its subscription to be confirmed before it reads:
# past it, it listens on without the confirmation (the backstop timer covers the gap).
SUBSCRIBE_CONFIRM_S = 1.0
# How often a Redis listener's thread looks up from its connection to see whether the
# caller is done with it.
LISTEN_TURN_S = 0.5


class LocalAnnouncements:
    """Announcements within one process (``InMemoryLeaseService``). Only keys someone
    listens to are counted, so nothing grows with keys announced and never listened to."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._counts: dict[str, int] = {}
        self._listeners: dict[str, int] = {}

    def announce(self, key: str) -> None:
        with self._changed:
            if key in self._counts:
                self._counts[key] += 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def listen(self, key: str) -> Iterator[_LocalListener]:
        with self._changed:
            self._listeners[key] = self._listeners.get(key, 0) + 1
            self._counts.setdefault(key, 0)
            listener = _LocalListener(self, key, self._counts[key])
        try:
            yield listener
        finally:
            with self._changed:
                self._listeners[key] -= 1
                if not self._listeners[key]:
                    del self._listeners[key], self._counts[key]

    def _wait(self, listener: _LocalListener, timeout_s: float) -> bool:
        key = listener.key
        with self._changed:
            heard = self._changed.wait_for(lambda: self._counts[key] > listener.seen,
                                           max(0.0, timeout_s))
            listener.seen = self._counts[key]
            return heard


class _LocalListener:
    def __init__(self, announcements: LocalAnnouncements, key: str, seen: int) -> None:
        self._announcements = announcements
        self.key = key
        self.seen = seen

    def wait(self, timeout_s: float) -> bool:
        return self._announcements._wait(self, timeout_s)


@contextlib.contextmanager
def redis_listener(client: Any, channel: str) -> Iterator[_RedisListener]:
    """Listen on ``channel`` (a ``SUBSCRIBE`` connection of its own, let go on exit)."""
    listener = _RedisListener(client, channel)
    try:
        yield listener
    finally:
        listener.close()


class _RedisListener:
    """A subscription held by a thread of its own, so that a Redis that does not answer
    (a partition dropping packets, where a connect or a read blocks) never holds the
    caller past its own timeout: the caller only ever waits on events, each with its
    timeout. The caller reads once the subscription is confirmed (or after
    ``SUBSCRIBE_CONFIRM_S``), so an announcement is either heard or made before that read,
    which then sees what was announced."""

    def __init__(self, client: Any, channel: str) -> None:
        self._heard = threading.Event()
        self._ready = threading.Event()  # confirmed, or given up
        self._closed = threading.Event()
        threading.Thread(target=self._listen, args=(client, channel), daemon=True,
                         name="pikku-run-end-listener").start()
        self._ready.wait(SUBSCRIBE_CONFIRM_S)

    def _listen(self, client: Any, channel: str) -> None:
        pubsub: Any = None
        try:
            pubsub = client.pubsub()
            pubsub.subscribe(channel)
            while not self._closed.is_set():
                message = pubsub.get_message(timeout=LISTEN_TURN_S)
                if message is None:
                    continue
                if message["type"] == "subscribe":
                    self._ready.set()
                elif message["type"] == "message":
                    self._heard.set()
        except Exception as exc:
            if not self._closed.is_set():
                log.debug("pikku: not listening on %s (%s); reading instead", channel, exc)
        finally:
            self._ready.set()  # the caller must not wait for a confirmation never coming
            if pubsub is not None:
                with contextlib.suppress(Exception):
                    pubsub.close()

    def wait(self, timeout_s: float) -> bool:
        # An announcement landing between the wait and the clear is not reported: it was
        # made after an end written before it, which the caller's next read sees.
        heard = self._heard.wait(max(0.0, timeout_s))
        if heard:
            self._heard.clear()
        return heard

    def close(self) -> None:
        """The thread lets its connection go within ``LISTEN_TURN_S``."""
        self._closed.set()
