"""Issue 25 item 5: ``start_on_commit`` in the Django project of ``tests/djangoproject``
writes its start intent (``StartIntent``) in the caller's transaction (real sqlite
commits and rollbacks), starts it at the commit and deletes it; with MongoDB unreachable
at the commit the row stays and ``drain_start_intents`` (run by every worker's reaper
through ``sweep_hooks``) starts the run later, once; Django's usual values go through
``CELERY_PIKKU_JSON_ENCODER`` (default ``DjangoJSONEncoder``); the migration is there
and up to date."""

from __future__ import annotations

import datetime
import io
import json
import logging
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from pymongo.errors import ServerSelectionTimeoutError

from pikku_celery import InvalidInputError, PikkuCelery, WorkflowContext
from tests.support import django_project
from tests.unit.test_contrib import make_pikku


@pytest.fixture(autouse=True)
def _django() -> None:
    django_project.setup()


@pytest.fixture
def pikku() -> PikkuCelery:
    return make_pikku()


class Rollback(Exception):
    pass


def intents() -> list[tuple[str, str, Any, bool]]:
    from pikku_celery.contrib.django.models import StartIntent

    return [(i.run_id, i.workflow, json.loads(i.data), i.refused)
            for i in StartIntent.objects.all()]


@pytest.fixture(autouse=True)
def _no_rows() -> Iterator[None]:
    from orders.models import Order

    from pikku_celery.contrib.django.models import StartIntent

    for model in (Order, StartIntent):
        model.objects.all().delete()
    yield
    for model in (Order, StartIntent):
        model.objects.all().delete()


class MongoDown:
    """The store refuses every run creation while ``down`` (as pymongo does when no
    server answers)."""

    def __init__(self, pikku: PikkuCelery, monkeypatch: pytest.MonkeyPatch) -> None:
        self.down = True
        self.calls = 0
        store = pikku.engine.store
        real = store.create_run

        def create_run(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.down:
                raise ServerSelectionTimeoutError("localhost:27017: connection refused")
            return real(*args, **kwargs)

        monkeypatch.setattr(store, "create_run", create_run)


def test_the_intent_commits_with_the_transaction_and_is_gone_once_started(
        pikku: PikkuCelery) -> None:
    from django.db import transaction
    from orders.models import Order

    with transaction.atomic():
        Order.objects.create(sku="tea", quantity=1)
        run_id = pikku.start_on_commit("sum", {"a": 1, "b": 2}, run_id="si-1")
        assert intents() == [("si-1", "sum", {"a": 1, "b": 2}, False)]  # in the transaction
        assert pikku.list_runs() == []
    assert pikku.get_run(run_id).input == {"a": 1, "b": 2}
    assert intents() == []


def test_the_intent_rolls_back_with_the_transaction(pikku: PikkuCelery) -> None:
    from django.db import transaction
    from orders.models import Order

    with pytest.raises(Rollback), transaction.atomic():
        Order.objects.create(sku="tea", quantity=1)
        pikku.start_on_commit("sum", {"a": 1, "b": 2}, run_id="si-2")
        assert len(intents()) == 1
        raise Rollback
    assert intents() == [] and Order.objects.count() == 0
    assert pikku.list_runs() == []


def test_mongodb_down_at_the_commit_leaves_the_intent_and_the_drain_starts_it_once(
        pikku: PikkuCelery, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from django.db import transaction
    from orders.models import Order

    from pikku_celery.contrib.django import drain_start_intents

    mongo = MongoDown(pikku, monkeypatch)
    with caplog.at_level(logging.WARNING, "pikku_celery.contrib"), transaction.atomic():
        order = Order.objects.create(sku="tea", quantity=1)
        order.run_id = pikku.start_on_commit("sum", {"a": 1, "b": 2})
        order.save(update_fields=["run_id"])
    # The commit went through (no 500): the order and its intent are both there.
    assert Order.objects.get().run_id == order.run_id
    assert intents() == [(order.run_id, "sum", {"a": 1, "b": 2}, False)]
    assert "could not be started yet" in caplog.text
    assert pikku.list_runs() == []
    # Still down: the drain keeps the row and stops at the first failure.
    assert drain_start_intents(pikku) == {"started": 0, "refused": 0, "failed": 1}
    assert len(intents()) == 1

    mongo.down = False
    assert drain_start_intents(pikku) == {"started": 1, "refused": 0, "failed": 0}
    assert drain_start_intents(pikku) == {"started": 0, "refused": 0, "failed": 0}
    assert [r.run_id for r in pikku.list_runs()] == [order.run_id]
    assert intents() == []


def test_a_start_drained_twice_makes_one_run(pikku: PikkuCelery) -> None:
    """The commit's start and a drain that read the row before it was deleted."""
    from pikku_celery.contrib.django import drain_start_intents
    from pikku_celery.contrib.django.models import StartIntent

    for _ in range(2):
        StartIntent.objects.create(run_id="twice", workflow="sum", data='{"a":1,"b":1}')
    assert drain_start_intents(pikku)["started"] == 2
    assert [r.run_id for r in pikku.list_runs()] == ["twice"]
    assert pikku.engine.dispatcher.wakes == [("twice", 0.0)] * 2  # type: ignore[attr-defined]


def test_a_conflicting_run_id_is_marked_refused_and_not_retried(
        pikku: PikkuCelery, caplog: pytest.LogCaptureFixture) -> None:
    from pikku_celery.contrib.django import drain_start_intents
    from pikku_celery.contrib.django.models import StartIntent

    pikku.start("sum", {"a": 5, "b": 5}, run_id="taken")
    StartIntent.objects.create(run_id="taken", workflow="sum", data='{"a":1,"b":1}')
    StartIntent.objects.create(run_id="free", workflow="sum", data='{"a":2,"b":2}')
    with caplog.at_level(logging.ERROR, "pikku_celery.contrib"):
        assert drain_start_intents(pikku) == {"started": 1, "refused": 1, "failed": 0}
    assert "refused" in caplog.text
    row = StartIntent.objects.get()
    assert (row.run_id, row.refused, row.attempts) == ("taken", True, 1)
    assert "WorkflowRunConflictError" in row.last_error
    assert drain_start_intents(pikku) == {"started": 0, "refused": 0, "failed": 0}
    assert pikku.get_run("taken").input == {"a": 5, "b": 5}


def test_the_drain_takes_at_most_limit_rows_oldest_first(pikku: PikkuCelery) -> None:
    from pikku_celery.contrib.django import drain_start_intents
    from pikku_celery.contrib.django.models import StartIntent

    for n in range(3):
        StartIntent.objects.create(run_id=f"l-{n}", workflow="sum", data='{"a":1,"b":1}')
    assert drain_start_intents(pikku, limit=2)["started"] == 2
    assert [i[0] for i in intents()] == ["l-2"]


def test_every_workers_reaper_drains_after_its_sweep(pikku: PikkuCelery) -> None:
    """``WorkerReaper.sweep_once`` runs ``sweep_hooks``, which contrib.django registered;
    a reaper of another Celery app's engine leaves the project's intents alone."""
    from django.test import override_settings

    from pikku_celery.contrib.django.models import StartIntent
    from pikku_celery.worker.tasks import WorkerReaper

    StartIntent.objects.create(run_id="swept", workflow="sum", data='{"a":1,"b":1}')
    other = make_pikku()
    with override_settings(PIKKU_CELERY_APP=pikku):
        WorkerReaper(lambda: other.engine, 1.0).sweep_once()
        assert len(intents()) == 1
        WorkerReaper(lambda: pikku.engine, 1.0).sweep_once()
    assert intents() == []
    assert pikku.get_run("swept").status == "running"


def test_django_values_are_stored_as_json_with_the_default_encoder(
        pikku: PikkuCelery) -> None:
    from django.db import transaction

    key = uuid.UUID("12345678-1234-5678-1234-567812345678")
    at = datetime.datetime(2026, 12, 3, 7, 30, tzinfo=datetime.timezone.utc)
    with transaction.atomic():
        run_id = pikku.start_on_commit(
            "sum", {"price": Decimal("12.50"), "at": at, "key": key, "a": 1})
    assert pikku.get_run(run_id).input == {
        "price": "12.50", "at": "2026-12-03T07:30:00Z",
        "key": "12345678-1234-5678-1234-567812345678", "a": 1}


class CentsEncoder(json.JSONEncoder):
    def default(self, o: Any) -> Any:
        if isinstance(o, Decimal):
            return int(o * 100)
        return super().default(o)


def test_the_encoder_setting_names_another_encoder(pikku: PikkuCelery) -> None:
    run_id = "enc-1"
    pikku.app.conf.pikku_json_encoder = f"{__name__}.CentsEncoder"
    pikku.start_on_commit("sum", {"price": Decimal("12.50")}, run_id=run_id)
    assert pikku.get_run(run_id).input == {"price": 1250}
    # Not Django's: a UUID is refused inside the transaction, as before.
    with pytest.raises(InvalidInputError, match="CentsEncoder"):
        pikku.start_on_commit("sum", {"key": uuid.uuid4()})
    pikku.app.conf.pikku_json_encoder = "json.JSONDecoder"
    with pytest.raises(InvalidInputError, match="JSONEncoder subclass"):
        pikku.start_on_commit("sum", {})
    assert [i[0] for i in intents()] == []


def test_the_projects_view_keeps_its_order_when_mongodb_is_down(
        pikku: PikkuCelery, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case end to end: the view answers 201 and the run starts later."""
    from django.test import Client
    from orders import views
    from orders.models import Order

    from pikku_celery.contrib.django import drain_start_intents

    @pikku.workflow("order")
    def order(wf: WorkflowContext, data: Any) -> Any:
        return data

    monkeypatch.setattr(views, "pikku", pikku)
    mongo = MongoDown(pikku, monkeypatch)
    answer = Client().post("/orders/", {"sku": "tea", "quantity": 2},
                           content_type="application/json")
    assert answer.status_code == 201, answer.content
    run_id = answer.json()["run_id"]
    assert Order.objects.get().run_id == run_id and pikku.list_runs() == []
    mongo.down = False
    drain_start_intents(pikku)
    assert pikku.get_run(run_id).workflow == "order"


def test_the_migration_is_there_and_up_to_date() -> None:
    from django.core.management import call_command
    from django.db.migrations.loader import MigrationLoader

    assert ("pikku", "0001_initial") in MigrationLoader(None).disk_migrations
    out = io.StringIO()
    call_command("makemigrations", "pikku", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()
