"""The names of each app's own pikku tasks (orchestrate, timer, reap): one namespace per app,
so a worker of one app never runs another's."""

from __future__ import annotations

from celery import Celery, Task

from pikku_celery.worker.config import task_namespace

# The kinds of pikku's own tasks. Each app names them ``<namespace>.<kind>`` (the setting
# ``pikku_task_namespace``, default ``pikku.<main>``: ``internal_task_names``), so a worker
# of another app never runs one: a message it takes from a shared queue is refused there
# as an unregistered task, never run against the wrong app's engine.
ORCHESTRATE_KIND = "orchestrate"
TIMER_KIND = "timer"
REAP_KIND = "reap"
INTERNAL_KINDS = (ORCHESTRATE_KIND, TIMER_KIND, REAP_KIND)
# The names every app used before namespaces (``pikku_task_namespace = "pikku"`` keeps
# them); not the names of an app's tasks otherwise.
ORCHESTRATE = "pikku.orchestrate"
TIMER = "pikku.timer"
REAP = "pikku.reap"
NAMES_ATTR = "_pikku_task_names"  # on the Celery app, once its tasks are registered


def internal_task_names(app: Celery) -> dict[str, str]:
    """The names of ``app``'s own pikku tasks, for routing (``task_routes``, ``-X``,
    monitoring): ``{"orchestrate": ..., "timer": ..., "reap": ...}``, each
    ``<namespace>.<kind>`` where the namespace is the ``pikku_task_namespace`` setting
    (default ``pikku.<main>``, ``pikku`` for an app without a main name or ``__main__``).
    Once the app is finalized, the names its tasks were registered under; before, the
    names the configuration gives now."""
    registered: dict[str, str] | None = getattr(app, NAMES_ATTR, None)
    if registered is not None:
        return dict(registered)
    namespace = task_namespace(app)
    return {kind: f"{namespace}.{kind}" for kind in INTERNAL_KINDS}


def internal_task(app: Celery, kind: str) -> Task:
    """``app``'s own pikku task of ``kind`` (``"orchestrate"``, ``"timer"``, ``"reap"``),
    finalizing the app first (its tasks, and so their names, are made then)."""
    tasks = app.tasks
    return tasks[internal_task_names(app)[kind]]
