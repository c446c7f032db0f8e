"""Whether a deployment shares its runs with other apps by default (issue 22 item 13).

Two apps on one MongoDB and one Redis are kept apart by the database (the URL's path,
``pikku`` when it names none) and the Redis key prefix (``pikku_key_prefix``, else the
Celery app's main name: ``proj`` for every tutorial app, ``pikku`` for ``Celery()``). When
both are left to their defaults, two such apps read each other's runs, run each other's
steps under the same run leases, and reap each other's work. Nothing refuses to start (a
single app is fine that way), but the worker says so loudly when it starts, and ``pikku
check`` reports it as a problem.

Duck-typed on the engine's store and lease service (``.db.name``, ``.key_prefix``): this
module imports neither pikku's app nor its backends.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("pikku_celery")

DEFAULT_DATABASE = "pikku"  # keys.DEFAULT_DATABASE
DEFAULT_PREFIX = "pikku"    # leases.redis.DEFAULT_KEY_PREFIX


def shared_by_default(celery_app: Any, store: Any, leases: Any) -> str | None:
    """Why this app's runs are shared with any other app left at the defaults, or
    ``None`` (a database or a key prefix of its own was chosen, or the store or lease
    service is not one another process can reach)."""
    db = getattr(store, "db", None)
    database = getattr(db, "name", None)
    prefix = getattr(leases, "key_prefix", None)
    if database is None or prefix is None or database != DEFAULT_DATABASE:
        return None
    conf = getattr(celery_app, "conf", None)
    chosen = conf.get("pikku_key_prefix") if conf is not None else None
    main = getattr(celery_app, "main", None)
    if chosen or (prefix not in (DEFAULT_PREFIX, main)):
        return None
    return (f"pikku: this app's runs live in the default MongoDB database {database!r} "
            f"and its Redis keys under the default prefix {prefix!r} (the Celery app's "
            "main name or 'pikku'): any other app left at the defaults on the same servers "
            "reads these runs, runs their steps and reaps their work. Name a database in "
            "pikku_mongo_url (mongodb://host/myapp) and set pikku_key_prefix")


def warn_at_worker_start(celery_app: Any) -> None:
    """Log ``shared_by_default`` at WARNING when a worker of ``celery_app`` starts (its
    engine built; a configuration error is logged elsewhere)."""
    pikku = getattr(celery_app, "pikku", None)
    try:
        engine = pikku.engine if pikku is not None else None
    except Exception:
        return  # not configured: PikkuCelery's own start-up check says so
    if engine is None:
        return
    why = shared_by_default(celery_app, engine.store, engine.leases)
    if why is not None:
        log.warning("%s", why)
