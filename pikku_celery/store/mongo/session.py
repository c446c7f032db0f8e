"""Every public call of the MongoDB store runs in this thread's causally consistent session
(``MongoStoreBase._causally`` says why), and names an unreachable server.

``public`` wraps each public method of the composed ``MongoWorkflowStore`` (its package's
``__init__`` applies it to every one, whichever concern's module defines it)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

from bson.timestamp import Timestamp
from pymongo.client_session import ClientSession
from pymongo.errors import ConfigurationError, ServerSelectionTimeoutError

from pikku_celery.store.mongo.errors import MongoUnreachableError, unreachable

P = ParamSpec("P")
T = TypeVar("T")


class CausalClock(threading.local):
    """Per thread and store: the newest cluster and operation times the thread's calls
    saw, and the session of its call in progress (``MongoStoreBase._causally``).
    Plain values, so a forked worker's copy is harmless."""

    session: ClientSession | None = None
    cluster_time: Mapping[str, Any] | None = None
    operation_time: Timestamp | None = None


def public(method: Callable[P, T]) -> Callable[P, T]:
    """A public store method: run in this thread's causal session, and an unreachable
    server reported by name, whichever call (a start, a read of the web API, a worker's
    sweep) met it first."""
    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        store: Any = args[0]
        try:
            try:
                with store._causally():
                    return method(*args, **kwargs)
            except (ConfigurationError, NotImplementedError) as exc:
                if not store._sessions or not _no_sessions(exc):
                    raise
                # A deployment without sessions (a standalone server too old, an emulator)
                # refuses the session before its first command is sent: nothing was
                # written, so the call runs again without one, as every later call will.
                store._sessions = False
                return method(*args, **kwargs)
        except MongoUnreachableError:
            raise
        except ServerSelectionTimeoutError as exc:
            raise unreachable(store.db, exc) from exc
    return call


def _no_sessions(exc: Exception) -> bool:
    return ("Sessions are not supported" in str(exc)
            or "does not support sessions" in str(exc))
