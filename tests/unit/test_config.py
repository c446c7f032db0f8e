"""``PikkuCelery(app)`` configured Celery's way: settings read from ``app.conf`` at first use.

Each test builds its Celery app first, binds pikku, and only then configures the app (as a
Flask factory or Django's ``config_from_object`` does), so a setting read at construction
would be missed and fail the test.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pymongo
import pytest
import redis
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    MongoWorkflowStore,
    PikkuCelery,
    PikkuConfigurationError,
    RedisLeaseService,
)
from tests.conftest import REDIS_URL
from tests.support.mongod import MongoTarget


def _app(name: str | None = None) -> Celery:
    return Celery(name or f"cfg-{uuid.uuid4().hex[:8]}", broker="memory://")


def _bind_workflow(pikku: PikkuCelery, prefix: str) -> str:
    @pikku.step(name=f"{prefix}.add")
    def add(data: dict[str, int]) -> int:
        return data["a"] + data["b"]

    @pikku.workflow(f"{prefix}-sum")
    def total(wf: Any, data: dict[str, int]) -> int:
        return int(wf.do("add", add, data))

    return f"{prefix}-sum"


@pytest.fixture
def mongo_url(mongo_server: MongoTarget) -> Iterator[str]:
    database = f"pikku_cfg_{uuid.uuid4().hex[:10]}"
    yield mongo_server.url_for(database)
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(mongo_server.url)
    client.drop_database(database)
    client.close()


class ObjectSettings:
    """What ``config_from_object(obj)`` reads: lowercase Celery names."""

    broker_url = "memory://"


def test_config_from_object_is_read_at_first_use_and_runs_a_workflow(
        mongo_url: str, key_prefix: str, redis_client: redis.Redis) -> None:
    app = _app()
    pikku = PikkuCelery(app)  # before the app is configured, as in a Flask factory
    workflow = _bind_workflow(pikku, "cfgobj")
    settings = ObjectSettings()
    settings.pikku_mongo_url = mongo_url  # type: ignore[attr-defined]
    settings.pikku_redis_url = REDIS_URL  # type: ignore[attr-defined]
    settings.pikku_key_prefix = key_prefix  # type: ignore[attr-defined]
    settings.pikku_step_lease = "12s"  # type: ignore[attr-defined]
    settings.pikku_run_lease = 7  # type: ignore[attr-defined]
    app.config_from_object(settings)

    run_id = pikku.start(workflow, {"a": 2, "b": 3}, inline=True)

    assert pikku.get_run(run_id).output == 5
    engine = pikku.engine
    assert isinstance(engine.store, MongoWorkflowStore)
    assert engine.store.db.name == mongo_url.split("/")[3].split("?")[0]
    assert isinstance(engine.leases, RedisLeaseService)
    assert engine.leases.key_prefix == key_prefix
    assert (engine.settings.step_lease_ms, engine.settings.run_lease_ms) == (12_000, 7_000)
    assert pikku.reaper_interval_s == 6.0  # half the configured step lease
    assert redis_client.exists(engine.leases.token_counter_key(f"workflow-run:{run_id}"))


def test_django_style_namespace_reads_celery_pikku_settings(mongo_url: str,
                                                            key_prefix: str) -> None:
    """``config_from_object("django.conf:settings", namespace="CELERY")`` maps Django's
    ``CELERY_PIKKU_MONGO_URL`` to ``pikku_mongo_url``: Celery's own mapping of a namespaced
    key (``Settings._to_keys``), for names it does not know as well as those it does."""
    app = _app()
    pikku = PikkuCelery(app)
    workflow = _bind_workflow(pikku, "cfgns")
    django_settings = SimpleNamespace(
        CELERY_BROKER_URL="memory://", CELERY_PIKKU_MONGO_URL=mongo_url,
        CELERY_PIKKU_REDIS_URL=REDIS_URL, CELERY_PIKKU_KEY_PREFIX=key_prefix,
        CELERY_PIKKU_STEP_LEASE="9s", CELERY_PIKKU_MAX_COUNTDOWN="1m",
        CELERY_PIKKU_CONTINUE_IN_PLACE="true", CELERY_PIKKU_WORKER_REAPER=False,
        PIKKU_MONGO_URL="mongodb://not-this-one:1/x",  # not in the namespace: ignored
    )
    app.config_from_object(django_settings, namespace="CELERY")

    run_id = pikku.start(workflow, {"a": 20, "b": 22}, inline=True)

    assert pikku.get_run(run_id).output == 42
    settings = pikku.settings
    assert (settings.step_lease_ms, settings.max_countdown_s) == (9_000, 60.0)
    assert (settings.continue_in_place, settings.worker_reaper) == (True, False)
    assert pikku.engine.leases.key_prefix == key_prefix  # type: ignore[attr-defined]


def test_construction_reads_no_setting_and_opens_no_connection() -> None:
    app = _app()
    # A configuration source that cannot even be imported: reading app.conf would raise.
    app.config_from_object("tests.unit.no_such_settings_module")
    pikku = PikkuCelery(app)
    _bind_workflow(pikku, "cfglazy")
    with pytest.raises(ImportError):
        pikku.engine  # noqa: B018 - first use is where the configuration is read

    app = _app()
    # Unreachable services: building the engine connects to neither.
    app.conf.update(pikku_mongo_url="mongodb://127.0.0.1:1/nothing?serverSelectionTimeoutMS=50",
                    pikku_redis_url="redis://127.0.0.1:1/0")
    pikku = PikkuCelery(app)
    assert pikku.engine.store is not None


def test_a_missing_url_is_a_clear_error_at_first_use_naming_the_setting() -> None:
    app = _app("shop")
    pikku = PikkuCelery(app)  # no error here: the app may be configured later
    workflow = _bind_workflow(pikku, "cfgmissing")
    with pytest.raises(PikkuConfigurationError) as missing_mongo:
        pikku.start(workflow, {"a": 1, "b": 1})
    message = str(missing_mongo.value)
    assert "pikku_mongo_url" in message and "CELERY_PIKKU_MONGO_URL" in message
    assert "'shop'" in message and "store=" in message

    app.conf.pikku_mongo_url = "mongodb://127.0.0.1:1/x"
    with pytest.raises(PikkuConfigurationError, match="pikku_redis_url"):
        pikku.get_run("any")

    namespaced = _app()
    namespaced.config_from_object(SimpleNamespace(CELERY_BROKER_URL="memory://"),
                                  namespace="DJANGO_CELERY")
    with pytest.raises(PikkuConfigurationError, match="DJANGO_CELERY_PIKKU_MONGO_URL"):
        PikkuCelery(namespaced).engine  # noqa: B018


def test_explicit_arguments_win_over_settings() -> None:
    app = _app()
    store, leases = InMemoryWorkflowStore(), InMemoryLeaseService()
    pikku = PikkuCelery(app, store=store, leases=leases, step_lease=5, reaper_interval="1s",
                        continue_in_place=False, worker_reaper=True)
    app.conf.update(pikku_mongo_url="mongodb://elsewhere:1/x", pikku_redis_url="redis://x:1",
                    pikku_step_lease=100, pikku_reaper_interval=50, pikku_run_lease=3,
                    pikku_continue_in_place=True, pikku_worker_reaper=False)
    assert pikku.engine.store is store and pikku.engine.leases is leases
    settings = pikku.settings
    assert settings.step_lease_ms == 5_000 and settings.reaper_interval_s == 1.0
    assert settings.run_lease_ms == 3_000  # not given: the setting applies
    assert (settings.continue_in_place, settings.worker_reaper) == (False, True)


def test_defaults_and_the_key_prefix_default_to_the_app_name() -> None:
    app = _app("billing")
    app.conf.update(pikku_mongo_url="mongodb://127.0.0.1:1/db", pikku_redis_url=REDIS_URL,
                    pikku_server_selection_timeout="250ms")
    pikku = PikkuCelery(app)
    settings = pikku.settings
    assert (settings.step_lease_ms, settings.run_lease_ms, settings.reaper_interval_s,
            settings.max_countdown_s, settings.undispatched_after_ms,
            settings.stalled_after_ms, settings.continue_in_place,
            settings.worker_reaper) == (60_000, 30_000, 30.0, 300.0, 30_000, 30_000, True, True)
    assert pikku.engine.leases.key_prefix == "billing"  # type: ignore[attr-defined]
    store = pikku.engine.store
    assert isinstance(store, MongoWorkflowStore)
    assert store.db.client.options.server_selection_timeout == 0.25


@pytest.mark.parametrize(("setting", "value"), [
    ("pikku_step_lease", "soon"), ("pikku_step_lease", 0), ("pikku_run_lease", -1),
    ("pikku_stalled_after", "a while"), ("pikku_continue_in_place", "maybe"),
])
def test_a_bad_setting_is_a_value_error_naming_it(setting: str, value: Any) -> None:
    app = _app()
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService())
    app.conf[setting] = value
    with pytest.raises(ValueError, match=setting):
        pikku.engine  # noqa: B018


def test_a_bad_explicit_argument_still_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="step_lease"):
        PikkuCelery(_app(), store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                    step_lease=0)


def test_threads_using_it_first_at_once_build_one_engine(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """A threads-pool worker's first tasks can reach ``pikku.engine`` together."""
    pikku = PikkuCelery(_app(), store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    builds: list[object] = []
    second_entered = threading.Event()
    make_engine = PikkuCelery.make_engine

    def slow_first_build(self: PikkuCelery, **kwargs: Any) -> Any:
        builds.append(threading.current_thread())
        if len(builds) == 1:
            # Without the lock another thread enters here meanwhile; with it, none can.
            second_entered.wait(0.5)
        else:
            second_entered.set()
        return make_engine(self, **kwargs)

    monkeypatch.setattr(PikkuCelery, "make_engine", slow_first_build)
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(pikku.engine)) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1
    assert len(seen) == 6 and all(engine is seen[0] for engine in seen)


def test_a_worker_of_an_unconfigured_app_logs_one_error_line(
        caplog: pytest.LogCaptureFixture) -> None:
    app = _app()
    pikku = PikkuCelery(app)
    with caplog.at_level(logging.ERROR, logger="pikku_celery"):
        pikku._on_worker_ready(sender=SimpleNamespace(app=app))
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "pikku_mongo_url" in errors[0].getMessage()
    assert pikku._reaper is None


def test_the_worker_reaper_setting_is_read_when_the_worker_starts() -> None:
    app = _app()
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService())
    app.conf.pikku_worker_reaper = False
    pikku._on_worker_ready(sender=SimpleNamespace(app=app))
    assert pikku._reaper is None

    app = _app()
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService())
    app.conf.pikku_reaper_interval = "40s"
    pikku._on_worker_ready(sender=SimpleNamespace(app=app))
    try:
        assert pikku._reaper is not None and pikku._reaper.interval_s == 40.0
    finally:
        pikku._on_worker_shutdown()


# --- a configured URL the driver refuses ----------------------------------------------------

LEAKY_PASSWORD = "Xk9pQ2mZ/7vLr"  # an unescaped '/': the drivers read 'Xk9pQ2mZ' as the port


def _misconfigured(**urls: Any) -> PikkuCelery:
    app = _app("shop")
    app.conf.update(pikku_mongo_url="mongodb://127.0.0.1:1/shop",
                    pikku_redis_url="redis://127.0.0.1:1/0")
    app.conf.update(urls)
    return PikkuCelery(app, worker_reaper=False)


def _refused(pikku: PikkuCelery) -> str:
    with pytest.raises(PikkuConfigurationError) as refused:
        pikku.engine  # noqa: B018 - the URL is parsed when the engine is first built
    # raised ``from None``: a log's traceback does not show the driver's message either
    error = refused.value
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    return str(refused.value)


@pytest.mark.parametrize(("setting", "url", "shown"), [
    ("pikku_redis_url", f"redis://:{LEAKY_PASSWORD}@redis.internal:6379/0",
     "redis://:***@redis.internal:6379/0"),
    ("pikku_mongo_url", f"mongodb://app:{LEAKY_PASSWORD}@mongo.internal:27017/shop",
     "mongodb://app:***@mongo.internal:27017/shop"),
    ("pikku_mongo_url", "mongodb://app:p@ss@mongo.internal/shop",  # pymongo's InvalidURI
     "mongodb://app:***@mongo.internal/shop"),
    ("pikku_redis_url", f"redis+cluster://:{LEAKY_PASSWORD}@10.0.0.1:7000,10.0.0.2:7000",
     "redis+cluster://:***@10.0.0.1:7000,10.0.0.2:7000"),
])
def test_a_password_a_url_cannot_hold_is_named_without_the_password(
        setting: str, url: str, shown: str) -> None:
    """The password's tail after an unescaped '/' becomes the path, its head the port:
    redis-py says 'Port could not be cast to integer value as 'Xk9pQ2mZ''. The error names
    the setting and the URL with its password masked, and says what to escape."""
    message = _refused(_misconfigured(**{setting: url}))
    assert setting in message and shown in message
    assert "percent-encode" in message and "%2F" in message
    assert "Xk9pQ2mZ" not in message and "7vLr" not in message and "ss@" not in message


@pytest.mark.parametrize(("setting", "url", "secret"), [
    ("pikku_redis_url", "redis://:s3cret@redis.internal:6379/0?socket_timeout=soon", "s3cret"),
    ("pikku_redis_url", "redis://redis.internal:6379/0?password=s3cret&socket_timeout=soon",
     "s3cret"),
    ("pikku_mongo_url", "mongodb://app:s3cret@mongo.internal:port/shop", "s3cret"),
])
def test_a_url_with_a_password_never_shows_the_drivers_message(
        setting: str, url: str, secret: str) -> None:
    message = _refused(_misconfigured(**{setting: url}))
    assert setting in message and "***" in message and secret not in message
    assert "its message is not shown" in message


@pytest.mark.parametrize(("setting", "url", "says"), [
    ("pikku_redis_url", "http://redis.internal:6379/0", "must specify one of the following"),
    # redis-py quotes the option as 'this' or (5.0) as `this`: the words are the same
    ("pikku_redis_url", "redis://redis.internal:6379/0?socket_timeout=soon",
     "Invalid value for "),
    ("pikku_mongo_url", "mongodb://mongo.internal:port/shop", "Port"),
])
def test_a_url_without_a_secret_shows_what_the_driver_refused(setting: str, url: str,
                                                              says: str) -> None:
    message = _refused(_misconfigured(**{setting: url}))
    assert setting in message and url in message and says in message


def test_a_url_that_is_not_a_string_is_not_shown() -> None:
    message = _refused(_misconfigured(pikku_redis_url=b"redis://:s3cret@redis.internal/0"))
    assert "pikku_redis_url" in message and "bytes" in message and "s3cret" not in message


def test_a_bad_key_prefix_is_still_named_as_the_setting() -> None:
    with pytest.raises(ValueError, match="invalid pikku_key_prefix") as refused:
        _misconfigured(pikku_key_prefix="{braced}").engine  # noqa: B018
    assert not isinstance(refused.value, PikkuConfigurationError)
