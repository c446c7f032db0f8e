"""A Redis that does not answer, reported by name: redis-py's bare ``ConnectionError``
("Error 111 connecting to 127.0.0.1:6379") does not say which setting to look at."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import redis

# The lease service's methods that talk to Redis.
_TALKING = ("acquire", "refresh", "refresh_many", "release", "get", "acquire_or_mark", "mark",
            "release_or_take_marks", "announce", "now_ms")


class RedisUnreachableError(redis.exceptions.ConnectionError):
    """Redis did not answer a lease call: names the server (never its password) and the
    setting (``pikku_redis_url``). A ``redis.exceptions.ConnectionError``, so code that
    catches redis-py's catches it too."""


def name_outages(cls: type) -> None:
    """Wrap ``cls``'s talking methods so a connection error names the server (``describe``)
    and the setting."""
    for name in _TALKING:
        setattr(cls, name, _named(getattr(cls, name)))


def _named(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except RedisUnreachableError:
            raise
        except redis.exceptions.ConnectionError as exc:
            raise RedisUnreachableError(
                f"{self.describe()} is unreachable (pikku_redis_url, or the leases= given "
                f"to PikkuCelery): {exc}") from exc
    return call
