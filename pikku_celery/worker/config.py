"""pikku's settings, read from the Celery app's configuration when first needed.

Celery's way: settings live in ``app.conf`` and are read when used, never at import. A
Flask factory configures its Celery app after the module that built ``PikkuCelery`` was
imported, and Django settings reach ``app.conf`` through
``config_from_object("django.conf:settings", namespace="CELERY")``, which is itself lazy.
So ``PikkuCelery(app)`` only remembers its explicit arguments; this module turns them and
the app's configuration into settings, a store and a lease service the first time the
engine is needed (a ``start``, a task, a worker's reaper).

Names: the constructor argument ``x`` is the setting ``pikku_x``; with a namespace, Celery
also reads ``<NAMESPACE>_PIKKU_X`` (``CELERY_PIKKU_MONGO_URL`` in Django settings). An
explicit argument wins over the setting, the setting over the default.

========================================  ================================================
setting                                   default
========================================  ================================================
``pikku_mongo_url``                       required unless ``store=`` is given
``pikku_redis_url``                       required unless ``leases=`` is given
``pikku_key_prefix``                      the Celery app's main name
``pikku_server_selection_timeout``        5 s (``MongoWorkflowStore.from_url``)
``pikku_write_concern``                   ``"majority"``, ``wtimeout`` 10 s, per option
                                          unless the URL sets it (``w``, ``wtimeoutMS``)
``pikku_read_concern``                    ``"majority"`` (``"local"`` when writes are not
                                          majority) unless the URL sets it
``pikku_step_lease``                      60 s
``pikku_run_lease``                       30 s
``pikku_reaper_interval``                 half the step lease
``pikku_max_countdown``                   300 s
``pikku_undispatched_after``              30 s
``pikku_stalled_after``                   30 s
``pikku_continue_in_place``               ``True``
``pikku_in_place_steps``                  100 (0: never run a step in place)
``pikku_in_place_for``                    10 s
``pikku_worker_reaper``                   ``True``
``pikku_max_events_per_run``              10,000 events kept per run (0: no limit)
``pikku_max_event_bytes``                 262,144 (256 KiB): an event's payload as JSON
                                          (0: no limit but MongoDB's, 15 MiB)
``pikku_queue``                           none (read by ``pikku_celery.worker.routing``)
``pikku_task_namespace``                  ``pikku.<main>`` (the Celery app's main name),
                                          ``pikku`` when the app has none or it is
                                          ``__main__``: pikku's own tasks are named
                                          ``<namespace>.orchestrate``, ``.timer`` and
                                          ``.reap`` (read when the app is finalized, by
                                          ``pikku_celery.worker.tasks``)
``pikku_redact_error``                    none: a callable ``(text) -> str``, or its
                                          dotted path, run on every recorded error's
                                          message and traceback after the built-in
                                          masking of credentials (``redaction.py``)
``pikku_redact_value``                    none: a callable ``(value, where) -> value``,
                                          or its dotted path, run on every value the
                                          web API and the dashboard show (not on what
                                          is stored; ``redaction.py``)
``pikku_metrics_registry``                prometheus-client's default registry: a
                                          ``CollectorRegistry`` or its dotted path, where
                                          ``pikku_celery.observe.metrics`` counts
``pikku_metrics_port``                    none: the port on which a worker's main process
                                          serves the metrics (``observe/serve.py``)
``pikku_metrics_addr``                    ``0.0.0.0``: the address it listens on
``pikku_step_retries``                    none: a step that gives no ``retries`` gets 0,
                                          or 3 with ``autoretry_for`` (Celery's
                                          ``max_retries``); set, every such step gets it
``pikku_step_autoretry_for``              none (every ``Exception`` is retried while
                                          attempts are left): the exception classes (or
                                          their names, dotted paths) retried for a step
                                          that gives no ``autoretry_for``
``pikku_step_retry_backoff``              none: Celery's ``retry_backoff`` (``True``: 1 s,
                                          a number: seconds) for a step that sets
                                          neither ``retry_delay`` nor ``retry_backoff``
``pikku_step_retry_backoff_max``          600 s
``pikku_step_retry_jitter``               ``True`` (applies with a backoff)
========================================  ================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pikku_celery.engine.protocols import (
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_EVENTS_PER_RUN,
)
from pikku_celery.engine.protocols import Settings as EngineSettings
from pikku_celery.leases.base import LeaseService
from pikku_celery.model._urls import carries_secret, redact_url, reserved_in_userinfo
from pikku_celery.model.dotted import import_dotted
from pikku_celery.model.durations import Duration, to_ms, to_seconds
from pikku_celery.model.errors import PikkuConfigurationError
from pikku_celery.model.redaction import (
    Redactor,
    ValueRedactor,
    load_redactor,
    load_value_redactor,
)
from pikku_celery.store.base import WorkflowStore
from pikku_celery.workflow.retry import NO_DEFAULTS, StepDefaults, step_defaults

if TYPE_CHECKING:
    from celery import Celery

PREFIX = "pikku_"
DEFAULT_STEP_LEASE_S = 60.0
DEFAULT_RUN_LEASE_S = 30.0
DEFAULT_MAX_COUNTDOWN_S = 300.0
DEFAULT_UNDISPATCHED_AFTER_S = 30.0
DEFAULT_STALLED_AFTER_S = 30.0
DEFAULT_IN_PLACE_STEPS = 100
DEFAULT_IN_PLACE_FOR_S = 10.0
_POSITIVE = ("step_lease", "run_lease")
_DURATIONS = ("reaper_interval", "max_countdown", "undispatched_after", "stalled_after",
              "in_place_for")
_COUNTS = ("in_place_steps", "max_events_per_run", "max_event_bytes")
_FLAGS = ("continue_in_place", "worker_reaper")
# Dot-separated words of letters, digits, '_' and '-': a task name Celery's glob routes
# ("pikku.*") and its command line read as written, with no glob characters of its own.
_NAMESPACE = re.compile(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*")
_NOT_IN_NAMESPACE = re.compile(r"[^A-Za-z0-9_\-.]")
MAX_NAMESPACE_LEN = 150
LEGACY_TASK_NAMESPACE = "pikku"  # the names of pikku's tasks before namespaces
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Resolved:
    """Every setting of one ``PikkuCelery``, explicit arguments and ``app.conf`` merged."""

    step_lease_ms: int
    run_lease_ms: int
    reaper_interval_s: float
    max_countdown_s: float
    undispatched_after_ms: int
    stalled_after_ms: int
    continue_in_place: bool
    worker_reaper: bool
    in_place_steps: int = DEFAULT_IN_PLACE_STEPS
    in_place_ms: int = round(DEFAULT_IN_PLACE_FOR_S * 1000)
    redact_error: Redactor | None = None
    # What the web surface shows of a value (not read by the engine: nothing stored).
    redact_value: ValueRedactor | None = None
    # Every run's limits on its events (0: none).
    max_events_per_run: int = DEFAULT_MAX_EVENTS_PER_RUN
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    # prometheus-client's registry to count into (None: its default one), and where a
    # worker serves it (``pikku_celery.observe``).
    metrics_registry: Any = None
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    # The ``pikku_step_*`` settings: how steps that do not say retry (``workflow.retry``).
    step_defaults: StepDefaults = NO_DEFAULTS

    def engine_settings(self) -> EngineSettings:
        """What of these the engine reads (``engine.protocols.Settings``)."""
        return EngineSettings(
            step_lease_ms=self.step_lease_ms, run_lease_ms=self.run_lease_ms,
            undispatched_after_ms=self.undispatched_after_ms,
            stalled_after_ms=self.stalled_after_ms,
            continue_in_place=self.continue_in_place, in_place_steps=self.in_place_steps,
            in_place_ms=self.in_place_ms, redact_error=self.redact_error,
            max_events_per_run=self.max_events_per_run,
            max_event_bytes=self.max_event_bytes, step_defaults=self.step_defaults)


def setting_names(app: Celery, name: str) -> str:
    """How a user writes ``pikku_<name>``: ``pikku_mongo_url``, and the namespaced form when
    the app reads its configuration with a namespace (``CELERY_PIKKU_MONGO_URL``)."""
    key = PREFIX + name
    namespace = getattr(app, "namespace", None)
    if namespace:
        return f"{key} ({namespace.rstrip('_')}_{key.upper()} in your settings)"
    return f"{key} (CELERY_{key.upper()} in Django settings read with namespace='CELERY')"


def conf_value(app: Celery, name: str) -> Any:
    """``pikku_<name>`` from ``app.conf`` (any layer, any namespace), else ``None``."""
    return app.conf.get(PREFIX + name)


def default_task_namespace(app: Celery) -> str:
    """``pikku.<main>``: unique to the app as its main name is (each character a namespace
    cannot hold becomes ``_``); ``pikku`` for an app with no main name or ``__main__``."""
    main = getattr(app, "main", None)
    if not isinstance(main, str) or main in ("", "__main__"):
        return LEGACY_TASK_NAMESPACE
    words = [w for w in _NOT_IN_NAMESPACE.sub("_", main).split(".") if w]
    return ".".join([LEGACY_TASK_NAMESPACE, *words]) if words else LEGACY_TASK_NAMESPACE


def task_namespace(app: Celery) -> str:
    """The ``pikku_task_namespace`` setting (``default_task_namespace`` when unset or
    empty). Raises ``PikkuConfigurationError`` naming the setting for a value that cannot
    start a task name."""
    value = conf_value(app, "task_namespace")
    if value is None or value == "":
        return default_task_namespace(app)
    if (not isinstance(value, str) or len(value) > MAX_NAMESPACE_LEN
            or not _NAMESPACE.fullmatch(value)):
        shown = repr(value) if isinstance(value, str) else f"a {type(value).__name__}"
        raise PikkuConfigurationError(
            f"invalid {setting_names(app, 'task_namespace')}: {shown[:MAX_NAMESPACE_LEN + 20]} "
            f"(1 to {MAX_NAMESPACE_LEN} characters: words of letters, digits, '_' and '-' "
            "joined by single dots, such as 'pikku.shop'; pikku's tasks are named "
            "<namespace>.orchestrate, <namespace>.timer and <namespace>.reap)")
    return value


class Settings:
    """The explicit constructor arguments of one ``PikkuCelery`` (``None``: not given)."""

    def __init__(self, app: Celery, explicit: dict[str, Any]) -> None:
        self._app = app
        self._explicit = explicit

    def raw(self, name: str) -> tuple[Any, str]:
        """The value to use for ``name`` and what to call it in an error message."""
        given = self._explicit.get(name)
        if given is not None:
            return given, name
        return conf_value(self._app, name), PREFIX + name

    def duration_ms(self, name: str, default_s: float, *, positive: bool = False) -> int:
        value, what = self.raw(name)
        ms = to_ms(default_s if value is None else _duration(value), what=what)
        if positive and ms <= 0:
            raise ValueError(f"invalid {what}: {value!r} (must be greater than zero)")
        return ms

    def count(self, name: str, default: int) -> int:
        value, what = self.raw(name)
        if value is None:
            return default
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"invalid {what}: {value!r} (a whole number, 0 or more)")
        return value

    def flag(self, name: str, default: bool) -> bool:
        value, what = self.raw(name)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"invalid {what}: {value!r} (use True or False)")

    def check_explicit(self) -> None:
        """Refuse a bad explicit argument at construction; reads no configuration."""
        for name in _POSITIVE + _DURATIONS:
            if self._explicit.get(name) is not None:
                self.duration_ms(name, 0, positive=name in _POSITIVE)
        for name in _FLAGS:
            if self._explicit.get(name) is not None:
                self.flag(name, False)
        for name in _COUNTS:
            if self._explicit.get(name) is not None:
                self.count(name, 0)
        if self._explicit.get("redact_error") is not None:
            self.redactor()
        if self._explicit.get("redact_value") is not None:
            self.value_redactor()

    def redactor(self) -> Redactor | None:
        """The user's ``redact_error`` hook: a callable, or the dotted path of one."""
        value, what = self.raw("redact_error")
        return load_redactor(value, what)

    def value_redactor(self) -> ValueRedactor | None:
        """The user's ``redact_value`` hook: a callable, or the dotted path of one."""
        value, what = self.raw("redact_value")
        return load_value_redactor(value, what)

    def resolve(self) -> Resolved:
        task_namespace(self._app)  # a bad one fails where every bad setting does
        step_lease_ms = self.duration_ms("step_lease", DEFAULT_STEP_LEASE_S, positive=True)
        interval, what = self.raw("reaper_interval")
        return Resolved(
            step_lease_ms=step_lease_ms,
            run_lease_ms=self.duration_ms("run_lease", DEFAULT_RUN_LEASE_S, positive=True),
            reaper_interval_s=(step_lease_ms / 2000 if interval is None
                               else to_seconds(_duration(interval), what=what)),
            max_countdown_s=self.duration_ms("max_countdown", DEFAULT_MAX_COUNTDOWN_S) / 1000,
            undispatched_after_ms=self.duration_ms("undispatched_after",
                                                   DEFAULT_UNDISPATCHED_AFTER_S),
            stalled_after_ms=self.duration_ms("stalled_after", DEFAULT_STALLED_AFTER_S),
            continue_in_place=self.flag("continue_in_place", True),
            worker_reaper=self.flag("worker_reaper", True),
            in_place_steps=self.count("in_place_steps", DEFAULT_IN_PLACE_STEPS),
            in_place_ms=self.duration_ms("in_place_for", DEFAULT_IN_PLACE_FOR_S),
            redact_error=self.redactor(),
            redact_value=self.value_redactor(),
            max_events_per_run=self.count("max_events_per_run", DEFAULT_MAX_EVENTS_PER_RUN),
            max_event_bytes=self.count("max_event_bytes", DEFAULT_MAX_EVENT_BYTES),
            metrics_registry=metrics_registry(self._app),
            metrics_port=metrics_port(self._app),
            metrics_addr=metrics_addr(self._app),
            step_defaults=step_defaults(lambda name: conf_value(self._app, name),
                                        lambda name: setting_names(self._app, name)),
        )

    def store(self) -> WorkflowStore:
        """The explicit store, else a ``MongoWorkflowStore`` on ``pikku_mongo_url`` (which
        connects at its first call, not here)."""
        given = self._explicit.get("store")
        if given is not None:
            return given  # type: ignore[no-any-return]
        url = self._url("mongo_url", "MongoDB", "store")
        from pymongo.errors import ConfigurationError

        from pikku_celery.store.mongo import MongoWorkflowStore

        timeout = conf_value(self._app, "server_selection_timeout")
        server_selection_timeout = None if timeout is None else to_seconds(
            _duration(timeout), what=PREFIX + "server_selection_timeout")
        concerns = {name: conf_value(self._app, name)
                    for name in ("write_concern", "read_concern")}
        try:
            return MongoWorkflowStore.from_url(
                url, server_selection_timeout=server_selection_timeout,
                **{name: value for name, value in concerns.items() if value not in (None, "")})
        except ValueError as exc:
            if str(exc).startswith(("invalid write_concern", "invalid read_concern")):
                raise ValueError(f"invalid {PREFIX}{str(exc).removeprefix('invalid ')}") from exc
            raise self._unusable_url("mongo_url", "MongoDB", "pymongo", url, exc) from None
        except ConfigurationError as exc:  # pymongo's InvalidURI among them
            raise self._unusable_url("mongo_url", "MongoDB", "pymongo", url, exc) from None

    def leases(self) -> LeaseService:
        """The explicit lease service, else a ``RedisLeaseService`` on ``pikku_redis_url``
        under ``pikku_key_prefix`` (default: the app's main name)."""
        given = self._explicit.get("leases")
        if given is not None:
            return given  # type: ignore[no-any-return]
        url = self._url("redis_url", "Redis", "leases")
        from pikku_celery.leases.redis import RedisLeaseService

        prefix = conf_value(self._app, "key_prefix")
        try:
            leases = RedisLeaseService.from_url(url, key_prefix=prefix or None)
        except (ValueError, TypeError) as exc:
            if str(exc).startswith("invalid key_prefix"):  # pikku_key_prefix, not the URL
                raise ValueError(f"invalid {PREFIX}{str(exc).removeprefix('invalid ')}"
                                 ) from exc
            cluster = url.startswith(("redis+cluster://", "rediss+cluster://"))
            raise self._unusable_url("redis_url", "Redis", "pikku's Redis Cluster URL parser"
                                     if cluster else "redis-py", url, exc) from None
        leases.adopt_prefix(self._app.main)
        return leases

    def _url(self, name: str, service: str, argument: str) -> str:
        url = conf_value(self._app, name)
        if url is None or url == "":
            raise PikkuConfigurationError(
                f"pikku has no {service} for Celery app {self._app.main!r}: set "
                f"{setting_names(self._app, name)} in the Celery app's configuration, or pass "
                f"{argument}= to PikkuCelery")
        if not isinstance(url, str):
            raise PikkuConfigurationError(  # not its repr: it can hold the password
                f"invalid {setting_names(self._app, name)}: a {type(url).__name__} (must be "
                "a URL string)")
        return url

    def _unusable_url(self, name: str, service: str, driver: str, url: str,
                      exc: Exception) -> PikkuConfigurationError:
        """The error for a configured URL the driver refused, raised ``from None``: it
        names the setting and shows the URL with its password masked, and the driver's
        message only when the URL carries no secret (it can quote a piece of the URL: a
        password's tail read as the port). The log of a web request that built the engine
        shows this error, not the driver's."""
        if reserved_in_userinfo(url):
            why = ("its user name or password holds a character a URL reserves ('/', '?', "
                   "'#' or '@'), which ends the address early: percent-encode them "
                   "(urllib.parse.quote(password, safe=''): '/' is %2F, '@' is %40)")
        elif carries_secret(url):
            why = (f"{driver} refused it ({type(exc).__name__}; its message is not shown, "
                   "as it can quote the password)")
        else:
            why = f"{driver} refused it: {exc}"
        return PikkuConfigurationError(
            f"invalid {setting_names(self._app, name)}: {redact_url(url)} is not a usable "
            f"{service} URL: {why}")


def _duration(value: Any) -> Duration:
    """Settings come from anywhere (environment-fed Django settings): a number in a string
    is seconds, like a number."""
    if isinstance(value, str) and value.strip().replace(".", "", 1).isdigit():
        return float(value)
    return value  # type: ignore[no-any-return]


def metrics_registry(app: Celery) -> Any:
    """The ``pikku_metrics_registry`` setting: a prometheus-client ``CollectorRegistry``, or
    the dotted path of one (``proj.metrics:REGISTRY``); ``None`` (unset): the default
    registry. Raises ``PikkuConfigurationError`` naming the setting for anything else."""
    value = conf_value(app, "metrics_registry")
    if value is None or value == "":
        return None
    what = setting_names(app, "metrics_registry")
    if isinstance(value, str):
        try:
            value = import_dotted(value)
        except (ImportError, AttributeError, ValueError) as exc:
            raise PikkuConfigurationError(
                f"invalid {what}: cannot import {value!r} ({exc})") from None
    if not (callable(getattr(value, "register", None))
            and callable(getattr(value, "collect", None))):
        raise PikkuConfigurationError(
            f"invalid {what}: {value!r} is not a prometheus_client CollectorRegistry (nor "
            "the dotted path of one, such as 'proj.metrics:REGISTRY')")
    return value


def metrics_port(app: Celery) -> int | None:
    """The ``pikku_metrics_port`` setting: the port a worker serves its metrics on (0: any
    free port), ``None`` when unset. Raises ``PikkuConfigurationError`` naming the setting
    for a value that is not a port."""
    value = conf_value(app, "metrics_port")
    if value is None or value == "":
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise PikkuConfigurationError(
            f"invalid {setting_names(app, 'metrics_port')}: {value!r} (a port number, 0 to "
            "65535)")
    return value


def metrics_addr(app: Celery) -> str:
    """The ``pikku_metrics_addr`` setting: where the metrics server listens."""
    value = conf_value(app, "metrics_addr")
    if value is None or value == "":
        return "0.0.0.0"
    if not isinstance(value, str):
        raise PikkuConfigurationError(
            f"invalid {setting_names(app, 'metrics_addr')}: {value!r} (an address to listen "
            "on, such as '0.0.0.0' or '127.0.0.1')")
    return value
