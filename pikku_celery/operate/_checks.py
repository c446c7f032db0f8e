"""``pikku check``: can this deployment run workflows?

In order, each check only when the one before it passed: the settings resolve (a missing
``pikku_mongo_url`` is named), MongoDB answers a ping, the store's indexes exist (a
database no ``start`` has touched has none yet: ``--create-indexes`` makes them), Redis
answers a ping; then what is registered. Every problem is one line; stores and lease
services without ``ping`` (the in-memory ones) have nothing to reach.

Then where pikku's tasks go (warnings: the exit status stays 0): Celery's default queue
``celery``, which every app that names no queue shares, and, when workers answer the
broker (``inspect``, one second), a worker that consumes that queue without this app's
tasks registered (another app's worker: it discards this app's tasks as unregistered, and
each lost one waits for the reaper's sweep).

Then what is insecure: runs shared with any other app left at the defaults (the default
database and key prefix, ``_isolation``), the standalone dashboard's environment (a short
``PIKKU_DASHBOARD_TOKEN`` or ``PIKKU_DASHBOARD_SECRET_KEY``), and, run as ``flask pikku
check`` or ``manage.py pikku check``, the framework's web settings (``web_checks``: a
session or CSRF cookie that is not Secure, HttpOnly or SameSite, the removed
``allow-local``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pikku_celery.app import PikkuCelery
from pikku_celery.model._isolation import shared_by_default
from pikku_celery.operate._text import error_line

MIN_TOKEN_CHARS = 16       # dashboard.standalone's (not imported: it needs Flask)
MIN_SECRET_KEY_CHARS = 32
CELERY_DEFAULT_QUEUE = "celery"  # every app's task_default_queue unless it names one
INSPECT_TIMEOUT_S = 1.0


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def ok(self, line: str) -> None:
        self.lines.append(f"ok       {line}")

    def problem(self, line: str) -> None:
        self.problems.append(line)

    def warn(self, line: str) -> None:
        self.lines.append(f"warning  {line}")


def run_checks(app: PikkuCelery, *, create_indexes: bool = False,
               web_checks: Callable[[], list[str]] | None = None,
               ask_workers: bool = True) -> Report:
    report = Report()
    try:
        engine = app.engine
    except Exception as exc:
        report.problem(_line(exc))
    else:
        _check_store(report, engine.store, create_indexes)
        _check_leases(report, engine.leases)
        shared = shared_by_default(app.app, engine.store, engine.leases)
        if shared is not None:
            report.problem(shared.removeprefix("pikku: "))
    _list_registered(report, app)
    _check_queue(report, app, ask_workers)
    for problem in _dashboard_environment() + (web_checks() if web_checks else []):
        report.problem(f"insecure: {problem}")
    return report


def _dashboard_environment() -> list[str]:
    found = []
    token = os.environ.get("PIKKU_DASHBOARD_TOKEN")
    if token and len(token) < MIN_TOKEN_CHARS:
        found.append(f"PIKKU_DASHBOARD_TOKEN has fewer than {MIN_TOKEN_CHARS} characters")
    key = os.environ.get("PIKKU_DASHBOARD_SECRET_KEY")
    if key and len(key) < MIN_SECRET_KEY_CHARS:
        found.append(f"PIKKU_DASHBOARD_SECRET_KEY has fewer than {MIN_SECRET_KEY_CHARS} "
                     "characters")
    return found


def _check_store(report: Report, store: Any, create_indexes: bool) -> None:
    where = _describe(store, "the store")
    ping = getattr(store, "ping", None)
    if ping is None:
        report.ok(f"{where}: nothing to reach")
        return
    try:
        ping()
    except Exception as exc:
        report.problem(_line(exc, where, "did not answer"))
        return
    report.ok(f"{where} answered")
    try:
        if create_indexes:
            store.create_indexes()
        missing = store.check_indexes() if hasattr(store, "check_indexes") else []
    except Exception as exc:
        report.problem(_line(exc, where, "indexes could not be read"))
        return
    for index in missing:
        report.problem(f"{where} lacks the index {index} (the first start creates it, or "
                       "run `pikku check --create-indexes`)")
    if not missing:
        report.ok(f"{where}: every index exists")


def _check_leases(report: Report, leases: Any) -> None:
    where = _describe(leases, "the lease service")
    ping = getattr(leases, "ping", None)
    if ping is None:
        report.ok(f"{where}: nothing to reach")
        return
    try:
        ping()
    except Exception as exc:
        report.problem(_line(exc, where, "did not answer"))
        return
    report.ok(f"{where} answered")


def _list_registered(report: Report, app: PikkuCelery) -> None:
    workflows = sorted(app.registry.workflows)
    steps = sorted(app.registry.steps)
    if not workflows:
        report.problem("no workflow is registered: is the module that declares them "
                       "imported by the app (-A) module?")
    report.lines.append(f"workflows ({len(workflows)}): {', '.join(workflows) or '-'}")
    report.lines.append(f"steps ({len(steps)}): {', '.join(steps) or '-'}")


def pikku_queue(app: PikkuCelery) -> str | None:
    """The queue pikku's messages go to (its orchestrate task's): pikku's own queue unless
    the app's routing names another, else where Celery routes the task (``task_routes``,
    else ``task_default_queue``)."""
    from pikku_celery.worker.task_names import ORCHESTRATE_KIND, internal_task_names

    celery_app = app.app
    name = internal_task_names(celery_app)[ORCHESTRATE_KIND]
    task = celery_app.tasks.get(name)
    queue = app.routing.options(name, (), task).get("queue")
    if queue is None:
        queue = celery_app.amqp.router.route({}, name, (), {}, task).get("queue")
    found = getattr(queue, "name", queue)
    return str(found) if found else None


def _check_queue(report: Report, app: PikkuCelery, ask_workers: bool) -> None:
    try:
        queue = pikku_queue(app)
    except Exception as exc:  # a routing function of the user's that raises
        report.lines.append(f"queue: not known ({_line(exc)})")
        return
    if queue is None:
        return
    report.lines.append(f"queue: {queue}")
    if queue == CELERY_DEFAULT_QUEUE:
        report.warn(
            f"pikku's tasks go to Celery's default queue {queue!r}, which every app that "
            "names no queue shares: a worker of another app consuming it discards this "
            "app's tasks as unregistered, and each lost one waits for the reaper's sweep. "
            f"Give the app its own: app.conf.task_default_queue = {app.app.main or 'proj'!r} "
            "(or pikku_queue, for pikku's tasks only)")
    if ask_workers:
        _check_workers(report, app, queue)


def _check_workers(report: Report, app: PikkuCelery, queue: str) -> None:
    """Ask the workers that answer the broker which queues they consume and which tasks
    they know: one consuming ``queue`` without this app's orchestrate task is another
    app's, and discards what it takes of this app's tasks."""
    from pikku_celery.worker.task_names import ORCHESTRATE_KIND, internal_task_names

    celery_app = app.app
    if celery_app.conf.broker_url and str(celery_app.conf.broker_url).startswith("memory"):
        return  # an in-process broker: no worker elsewhere to ask
    orchestrate = internal_task_names(celery_app)[ORCHESTRATE_KIND]
    try:
        with celery_app.connection_for_write() as conn:  # a broker down: no 6 s of retries
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0,
                                   timeout=INSPECT_TIMEOUT_S)
        inspector = celery_app.control.inspect(timeout=INSPECT_TIMEOUT_S)
        consumed = inspector.active_queues() or {}
        registered = (inspector.registered() or {}) if consumed else {}
    except Exception as exc:
        report.lines.append(f"workers: not asked, the broker did not answer ({_line(exc)})")
        return
    ours = sorted(node for node, queues in consumed.items()
                  if queue in {q.get("name") for q in queues or ()})
    strangers = [node for node in ours if orchestrate not in (registered.get(node) or ())]
    for node in strangers:
        report.warn(
            f"worker {node} consumes queue {queue!r} but has not registered this app's "
            f"{orchestrate}: it discards this app's tasks it takes as unregistered (another "
            "app's worker?), and each lost one waits for the reaper's sweep. Give each app "
            "its own queue (task_default_queue or pikku_queue)")
    running = [node for node in ours if node not in strangers]
    report.lines.append(f"workers ({len(running)}) running this app's workflows from "
                        f"{queue!r}: {', '.join(running) or '-'}"
                        + ("" if consumed else " (none answered within "
                           f"{INSPECT_TIMEOUT_S:g} s)"))


def _describe(service: Any, fallback: str) -> str:
    describe = getattr(service, "describe", None)
    if describe is None:
        return f"{fallback} ({type(service).__name__})"
    try:
        return str(describe())
    except Exception:
        return fallback


def _line(exc: BaseException, where: str | None = None, what: str = "") -> str:
    """``Type: message``, after ``<where> <what>:`` unless the message names ``where``."""
    message = error_line({"type": type(exc).__name__, "message": str(exc)}, limit=400)
    return message if where is None or where in str(exc) else f"{where} {what}: {message}"
