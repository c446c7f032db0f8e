"""Whether this worker's pool enforces Celery's time limits.

prefork (a child killed at the hard limit, ``SoftTimeLimitExceeded`` at the soft one) and
gevent enforce them; the threads and solo pools ignore them: a step sent as a task there
runs unlimited too, so a time limit is no reason to send it instead of running it in place
(issue 34). Learnt at ``worker_init``, before a prefork pool forks its children (they
inherit it); not known (no worker started in this process): as if the pool enforced them.
"""

from __future__ import annotations

from typing import Any

#: The pools that ignore time limits, as ``module:qualname``.
UNLIMITED_POOLS = frozenset({"celery.concurrency.thread:TaskPool",
                             "celery.concurrency.solo:TaskPool"})

_pool: list[str] = []  # the pool of the worker started in this process, if any


def note_worker_pool(pool_cls: Any) -> None:
    """Remember the pool of the worker starting here (a class, or Celery's alias of one)."""
    from celery.concurrency import get_implementation

    try:
        cls = get_implementation(pool_cls)
        name = f"{cls.__module__}:{cls.__qualname__}"
    except Exception:  # a pool Celery cannot name: as if it enforced limits
        name = str(pool_cls)
    _pool[:] = [name]


def forget_worker_pool() -> None:
    """The worker stopped (an in-process worker in a test): nothing known again."""
    _pool.clear()


def enforces_time_limits() -> bool:
    return not (_pool and _pool[0] in UNLIMITED_POOLS)


def pool_name() -> str | None:
    """The pool's short name (``threads``, ``solo``, ``prefork``...), for the start line."""
    if not _pool:
        return None
    module = _pool[0].split(":", 1)[0].rsplit(".", 1)[-1]
    return {"thread": "threads"}.get(module, module)
