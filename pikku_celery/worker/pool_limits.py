"""Whether this worker's pool enforces Celery's time limits.

prefork (a child killed at the hard limit, ``SoftTimeLimitExceeded`` at the soft one) and
gevent enforce them; the threads and solo pools ignore them: a step sent as a task there
runs unlimited too, so a time limit is no reason to send it instead of running it in place
(issue 34). Learnt per app at ``worker_init``, before a prefork pool forks its children
(they inherit it); not known (no worker of the app started in this process): as if the
pool enforced them.
"""

from __future__ import annotations

import weakref
from typing import Any

#: The pools that ignore time limits, as ``module:qualname``.
UNLIMITED_POOLS = frozenset({"celery.concurrency.thread:TaskPool",
                             "celery.concurrency.solo:TaskPool"})

# The pool of the worker of each app started in this process (a test process starts
# in-process workers of many apps: one's pool says nothing of another's).
_pools: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def note_worker_pool(app: Any, pool_cls: Any) -> None:
    """Remember the pool of ``app``'s worker starting here (a class, or Celery's alias)."""
    from celery.concurrency import get_implementation

    try:
        cls = get_implementation(pool_cls)
        name = f"{cls.__module__}:{cls.__qualname__}"
    except Exception:  # a pool Celery cannot name: as if it enforced limits
        name = str(pool_cls)
    _pools[app] = name


def forget_worker_pool(app: Any) -> None:
    """``app``'s worker stopped: nothing known of its pool again."""
    _pools.pop(app, None)


def enforces_time_limits(app: Any) -> bool:
    return _pools.get(app) not in UNLIMITED_POOLS


def pool_name(app: Any) -> str | None:
    """The pool's short name (``threads``, ``solo``, ``prefork``...), for the start line."""
    known = _pools.get(app)
    if known is None:
        return None
    module = known.split(":", 1)[0].rsplit(".", 1)[-1]
    return {"thread": "threads"}.get(module, module)
