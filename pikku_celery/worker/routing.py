"""Where pikku's tasks go, and the prefetch of a worker that runs them.

Binding pikku to an app changes nothing app-wide that the app's own tasks feel: no setting
is written to ``app.conf`` and, by default, pikku's tasks (steps, and the app's own
``<namespace>.orchestrate``, ``<namespace>.timer`` and ``<namespace>.reap``) are routed like
any task (``task_routes``, a ``queue=`` task option, else the default queue) and run with
the worker's prefetch.

The namespace is the ``pikku_task_namespace`` setting, by default ``pikku.<main>`` (the
Celery app's main name; ``pikku`` for an app without one or ``__main__``), so two apps on
one broker never share a task name: ``pikku_celery.worker.tasks.internal_task_names(app)`` gives
an app's names. A glob route ``"pikku.*"`` matches them all; an exact route on a name of
before namespaces (``"pikku.timer"``) matches only with ``pikku_task_namespace = "pikku"``,
which restores those names.

Why pikku does not simply set ``worker_prefetch_multiplier = 1``: a step holds its pool slot
for its whole body, so steps want a small prefetch, but Celery's prefetch is one number per
worker (one channel QoS for every queue it consumes). Setting it app-wide changed the user's
tasks: with RabbitMQ, a task sent with ``expires=1`` behind busy tasks stayed in the broker
instead of being reserved, RabbitMQ dropped it at its TTL, no worker stored REVOKED and
``AsyncResult.get()`` never returned (Celery's own ``test_expired`` hangs).

So a small prefetch is opt-in, through a queue of pikku's own (``PikkuCelery(queue=...)`` or
the ``pikku_queue`` setting):

* pikku's tasks are published to it, unless the user's routing names another destination
  for a task (``task_routes``, or a ``queue``/``exchange``/``routing_key`` task option): the
  user's routing wins task by task;
* a worker started without ``-Q`` consumes it as well as the app's own queues, so
  ``celery -A proj worker`` keeps running workflows; ``-Q`` and ``-X`` choose as usual;
* a worker that consumes only that queue (``celery -A proj worker -Q <queue>``) runs with
  prefetch multiplier 1, unless the user set ``worker_prefetch_multiplier`` anywhere:
  ``app.conf``, ``config_from_object`` / Django settings (any namespace, old or new name),
  ``--prefetch-multiplier`` or ``CELERY_WORKER_PREFETCH_MULTIPLIER``. It is the worker's own
  value that changes (before its consumer is built), never the app's configuration.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import click
from celery import Celery, signals
from celery.utils.nodenames import worker_direct
from click.core import ParameterSource

from pikku_celery.worker import ack_wakeup
from pikku_celery.worker.nodes import forget_worker_node, note_worker_node, worker_host
from pikku_celery.worker.pool_limits import forget_worker_pool, note_worker_pool

log = logging.getLogger("pikku_celery")

QUEUE_SETTING = "pikku_queue"
PREFETCH_SETTING = "worker_prefetch_multiplier"
PREFETCH_PARAM = "prefetch_multiplier"  # the worker command's option and keyword argument
STEP_PREFETCH_MULTIPLIER = 1
ROUTING_OPTIONS = ("queue", "exchange", "routing_key")


def conf_sets(conf: Any, setting: str) -> bool:
    """Did any configuration source, rather than Celery's defaults, set ``setting``?

    ``conf.changes`` only holds direct assignments; ``config_from_object`` (Django settings
    included) and ``add_defaults`` live in further layers of the same chain. The last layer
    is Celery's table of defaults. Each layer is asked for every name the setting has: its
    own, the namespaced one (``CELERY_WORKER_PREFETCH_MULTIPLIER``) and the old one
    (``CELERYD_PREFETCH_MULTIPLIER``).
    """
    conf.finalize()  # an app not configured yet holds one pending layer: load it first
    layers = list(conf.maps)[:-1]
    # The old name's function too: Celery before 5.7 leaves it out of _to_keys.
    names = {*conf._to_keys(setting), *(f(setting) for f in conf._keys or ())}
    return any(name in layer for layer in layers for name in names)


def cli_sets(param: str) -> bool | None:
    """Did the user give ``param`` to the running ``celery worker`` command (on the command
    line, through its environment variable or a default map)? ``None`` outside that command.

    Needed because the command fills an omitted ``--prefetch-multiplier`` with the
    configured value, so the value alone cannot tell an explicit ``4`` from the default."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or param not in ctx.params:
        return None
    return ctx.get_parameter_source(param) not in (None, ParameterSource.DEFAULT)


def user_sets_prefetch(worker: Any) -> bool:
    """Whether the user chose this worker's prefetch multiplier, from any source."""
    given = cli_sets(PREFETCH_PARAM)
    if given is None:  # an in-process WorkController: its keyword arguments are the user's
        given = worker.options.get(PREFETCH_PARAM) is not None
    return given or conf_sets(worker.app.conf, PREFETCH_SETTING)


class Routing:
    """pikku's queue (if one is configured), the routing options of pikku's messages, and
    the set-up of a worker that consumes that queue."""

    def __init__(self, app: Celery, queue: str | None = None) -> None:
        self._app = app
        self._queue = queue
        self._prepared: weakref.WeakSet[Any] = weakref.WeakSet()
        self._notes: list[str] = []

    def connect(self) -> None:
        # A dispatch_uid of this object's: Celery before 5.7 keys a bound method by its
        # function alone, so a second app's handlers were taken for the first's and dropped.
        uid = f"pikku-routing-{id(self)}"
        signals.celeryd_init.connect(self._on_celeryd_init, weak=False, dispatch_uid=uid)
        signals.worker_init.connect(self._on_worker_init, weak=False, dispatch_uid=uid)
        signals.worker_ready.connect(self._on_worker_ready, weak=False, dispatch_uid=uid)
        signals.worker_shutdown.connect(self._on_worker_shutdown, weak=False, dispatch_uid=uid)

    @property
    def queue_name(self) -> str | None:
        """The explicit ``queue`` argument, else the ``pikku_queue`` setting (read when used,
        like any Celery setting), else ``None``: route like any task."""
        if self._queue is not None:
            return self._queue or None
        name = self._app.conf.get(QUEUE_SETTING)
        return str(name) if name else None

    def queue(self) -> Any:
        """pikku's ``kombu.Queue``: the user's declaration when ``task_queues`` has one,
        else declared the way Celery declares a missing queue (so producers and workers
        declare it identically, even with ``task_create_missing_queues = False``)."""
        name = self.queue_name
        if name is None:
            return None
        queues = self._app.amqp.queues
        if name in queues:
            return queues[name]
        return queues.add(queues.new_missing(name))

    def options(self, name: str, args: tuple[Any, ...], task: Any = None) -> dict[str, Any]:
        """Extra ``apply_async`` options for one of pikku's messages: the queue, unless no
        queue is configured or the user's routing decides this task's destination."""
        if self.queue_name is None:
            return {}
        if task is not None and any(getattr(task, opt, None) for opt in ROUTING_OPTIONS):
            return {}
        if self._app.amqp.router.lookup_route(name, args, {}, {}, task) is not None:
            return {}
        return {"queue": self.queue()}

    # --- worker set-up ----------------------------------------------------------------------

    def _ours(self, worker_or_consumer: Any) -> bool:
        return getattr(worker_or_consumer, "app", None) is self._app

    def _on_celeryd_init(self, sender: Any = None, instance: Any = None, **_: Any) -> None:
        # Sent by the ``celery worker`` command before it applies -Q/-X: adding the queue to
        # the default selection here lets Celery's own -Q/-X handling decide about it.
        if not self._ours(instance):
            return
        queue = self.queue()
        if queue is not None:
            self._app.amqp.queues.select_add(queue)
            self._prepared.add(instance)

    def _on_worker_init(self, sender: Any = None, **_: Any) -> None:
        # Sent after the queues were selected and before the consumer (which reads the
        # worker's prefetch multiplier) is built, and before a prefork pool forks.
        if not self._ours(sender):
            return
        note_worker_pool(self._app, sender.pool_cls)
        note_worker_node(self._app, getattr(sender, "hostname", None))
        queue = self.queue()
        if queue is None:
            return
        queues = self._app.amqp.queues
        if sender not in self._prepared and getattr(queues, "_consume_from", None) is None:
            queues.select_add(queue)  # an in-process worker given no queues
        consumed = set(queues.consume_from) - {worker_direct(sender.hostname).name}
        if consumed == {queue.name}:
            self._dedicated(sender, queue.name)
        elif queue.name not in consumed:
            self._notes.append(f"pikku: this worker does not consume pikku's queue "
                               f"{queue.name!r}; workflows need at least one worker that "
                               f"does (celery worker -Q {queue.name})")

    def _dedicated(self, worker: Any, queue_name: str) -> None:
        if user_sets_prefetch(worker):
            self._notes.append(f"pikku: this worker consumes only pikku's queue "
                               f"{queue_name!r}; keeping your prefetch multiplier "
                               f"{worker.prefetch_multiplier}")
            return
        worker.prefetch_multiplier = STEP_PREFETCH_MULTIPLIER
        self._notes.append(f"pikku: this worker consumes only pikku's queue {queue_name!r}: "
                           f"prefetch multiplier {STEP_PREFETCH_MULTIPLIER}")

    def _on_worker_ready(self, sender: Any = None, **_: Any) -> None:
        # Logged here, not at worker_init: the worker's logging is set up in between.
        if self._ours(sender):
            # Sent from the event loop's own thread: where the loop's wake-up is installed.
            ack_wakeup.install(getattr(sender, "hub", None))
            for note in self._notes:
                log.info(note)
            self._notes.clear()
            self._say_why_steps_are_sent()
            from pikku_celery.model._isolation import warn_at_worker_start

            warn_at_worker_start(self._app)  # runs shared with other apps by default

    def _on_worker_shutdown(self, sender: Any = None, **_: Any) -> None:
        if self._ours(sender):
            forget_worker_pool(self._app)
            forget_worker_node(self._app)

    def worker_host(self) -> str:
        """The name of this process in the worker recorded with each attempt, before
        ``:<pid>``: the Celery node name (``w1@host``) of this app's worker when one started
        here (``nodes``), else the host name."""
        return worker_host(self._app)

    def _say_why_steps_are_sent(self) -> None:
        pikku = getattr(self._app, "pikku", None)
        if pikku is None:
            return
        from pikku_celery.worker.in_place_notes import sent_reasons
        from pikku_celery.worker.pool_limits import enforces_time_limits, pool_name

        settings = pikku.settings
        for line in sent_reasons(self._app, list(pikku.registry.steps),
                                 continue_in_place=settings.continue_in_place,
                                 in_place_steps=settings.in_place_steps,
                                 in_place_ms=settings.in_place_ms,
                                 limits_enforced=enforces_time_limits(self._app),
                                 pool=pool_name(self._app)):
            log.info(line)
