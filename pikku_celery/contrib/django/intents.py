"""``start_on_commit`` in a Django project: the start is a row of the project's own
database (``models.StartIntent``), written in the caller's transaction, so it commits or
rolls back with the caller's rows. Once the transaction commits, the run is started at
once (``pikku.start(workflow, data, run_id=...)``) and the row deleted; when that fails
(MongoDB unreachable) the failure is logged, the commit is not disturbed, and the row
stays for ``drain_start_intents``, which every worker's reaper runs after its sweep
(``pikku_celery.engine.sweep_hooks``). A start by run id is idempotent, so a row started twice
(at the commit and by a drain that read it before it was deleted) still makes one run.

The input is converted to JSON data before it is stored, with the JSON encoder named by
the ``pikku_json_encoder`` setting (``CELERY_PIKKU_JSON_ENCODER`` in Django settings; a
``json.JSONEncoder`` subclass or its dotted path), by default Django's
``DjangoJSONEncoder``: a ``Decimal`` becomes a string (``"12.50"``), a ``datetime`` an ISO
8601 string, a ``UUID`` its string. The run gets that JSON data as its input."""

from __future__ import annotations

import json
import logging
from typing import Any

from pikku_celery.model.errors import InvalidInputError, WorkflowRunConflictError
from pikku_celery.model.validate import check_run_id, check_value
from pikku_celery.worker.config import conf_value

log = logging.getLogger("pikku_celery.contrib")

ENCODER_SETTING = "json_encoder"  # pikku_json_encoder, CELERY_PIKKU_JSON_ENCODER

# A start that can never succeed as stored: kept (``refused``) for an operator, not retried.
_REFUSED = (WorkflowRunConflictError, InvalidInputError)


def json_encoder(pikku: Any) -> type[json.JSONEncoder]:
    """The ``pikku_json_encoder`` setting of ``pikku``'s Celery app, read at every call
    (tests change settings); ``DjangoJSONEncoder`` when unset."""
    from django.core.serializers.json import DjangoJSONEncoder
    from django.utils.module_loading import import_string

    named = conf_value(pikku.app, ENCODER_SETTING)
    if named in (None, ""):
        default: type[json.JSONEncoder] = DjangoJSONEncoder
        return default
    found = import_string(named) if isinstance(named, str) else named
    if not (isinstance(found, type) and issubclass(found, json.JSONEncoder)):
        raise InvalidInputError(
            f"pikku_json_encoder (CELERY_PIKKU_JSON_ENCODER) must name a json.JSONEncoder "
            f"subclass, got {named!r}")
    return found


def to_json(pikku: Any, data: Any) -> str:
    """``data`` as the JSON text to store: converted by the configured encoder, then held
    to what the store accepts (``validate.check_value``). Raises ``InvalidInputError``."""
    encoder = json_encoder(pikku)
    try:
        text = json.dumps(data, cls=encoder, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(
            f"workflow input cannot be converted to JSON by {encoder.__qualname__} "
            f"(pikku_json_encoder): {exc}") from exc
    check_value("workflow input", json.loads(text))
    return text


def record_start(pikku: Any, workflow: str, data: Any, run_id: str,
                 using: str | None) -> None:
    """``on_commit.RecordStart``: write the intent in the transaction open on ``using``
    (a savepoint in it; its own transaction when none is open) and start it once that
    commits. What cannot be stored raises here, inside the caller's transaction."""
    from django.db import DEFAULT_DB_ALIAS, transaction

    from pikku_celery.contrib.django.models import StartIntent

    check_run_id(run_id)
    text = to_json(pikku, data)
    alias = using or DEFAULT_DB_ALIAS
    with transaction.atomic(using=alias):
        intent = StartIntent.objects.using(alias).create(
            run_id=run_id, workflow=workflow, data=text)
        transaction.on_commit(lambda: start_intent(pikku, intent, alias), using=alias)


def start_intent(pikku: Any, intent: Any, alias: str) -> str:
    """Start ``intent``'s run by its run id and delete the row: ``"started"``. When the
    start failed the row is kept: ``"refused"`` (marked so) when it can never succeed,
    else ``"failed"``. Never raises what the start raised: it is logged."""
    from pikku_celery.contrib.django.models import StartIntent

    rows = StartIntent.objects.using(alias).filter(pk=intent.pk)
    try:
        pikku.start(intent.workflow, json.loads(intent.data), run_id=intent.run_id)
    except _REFUSED as exc:
        log.error("pikku: the start of run %r (%s) is refused and will not be retried: "
                  "%s; its start intent (pk %s) is kept, marked refused", intent.run_id,
                  intent.workflow, exc, intent.pk)
        _note(rows, intent, exc, refused=True)
        return "refused"
    except Exception as exc:
        log.warning("pikku: run %r (%s) could not be started yet: %s; its start intent "
                    "is kept, and a worker's reaper starts it (drain_start_intents)",
                    intent.run_id, intent.workflow, exc)
        _note(rows, intent, exc, refused=False)
        return "failed"
    try:
        rows.delete()
    except Exception as exc:  # started: a later drain starts it again, idempotently
        log.warning("pikku: run %r started, but its start intent could not be deleted: "
                    "%s", intent.run_id, exc)
    return "started"


def _note(rows: Any, intent: Any, exc: Exception, *, refused: bool) -> None:
    from django.db.models import F

    try:
        rows.update(attempts=F("attempts") + 1, refused=refused,
                    last_error=f"{type(exc).__name__}: {exc}"[:2000])
    except Exception as update_exc:
        log.warning("pikku: could not note the failed start of run %r: %s",
                    intent.run_id, update_exc)


def drain_start_intents(pikku: Any, limit: int = 100, *,
                        using: str | None = None) -> dict[str, int]:
    """Start up to ``limit`` pending start intents (oldest first, ``refused`` ones
    skipped) of database ``using`` (default: every database the intents table migrates
    to), each by its run id, deleting each row once started. A start refused for good
    (``WorkflowRunConflictError``: the id names another workflow or input) marks its row
    ``refused``; any other failure (MongoDB unreachable) keeps the row and ends the drain
    of that database until the next call. Returns ``{"started": n, "refused": n,
    "failed": n}``."""
    from django.db import connections, router

    from pikku_celery.contrib.django.models import StartIntent

    counts = {"started": 0, "refused": 0, "failed": 0}
    aliases = [using] if using is not None else [
        alias for alias in connections if router.allow_migrate_model(alias, StartIntent)]
    for alias in aliases:
        pending = list(StartIntent.objects.using(alias).filter(refused=False)
                       .order_by("created", "pk")[:max(0, limit - sum(counts.values()))])
        for intent in pending:
            outcome = start_intent(pikku, intent, alias)
            counts[outcome] += 1
            if outcome == "failed":
                break  # MongoDB is down: the next sweep tries again
    if any(counts.values()):
        log.info("pikku: start intents: %s", counts)
    return counts


def drain_after_sweep(engine: Any) -> None:
    """``sweep_hooks``: after a worker's reaper sweep, drain the project's start intents,
    when Django is set up with pikku's app and the sweeping engine is the project's
    ``PikkuCelery``'s (``PIKKU_CELERY_APP``)."""
    from django.apps import apps
    from django.core.exceptions import ImproperlyConfigured
    from django.db import close_old_connections

    from pikku_celery.contrib.django import project_pikku

    if not apps.ready or not apps.is_installed("pikku_celery.contrib.django"):
        return
    try:
        pikku = project_pikku()
    except (ImproperlyConfigured, ImportError):
        return
    if pikku.engine is not engine:
        return  # another Celery app's reaper
    close_old_connections()  # this thread's connection, if the database dropped it
    try:
        drain_start_intents(pikku)
    finally:
        close_old_connections()
