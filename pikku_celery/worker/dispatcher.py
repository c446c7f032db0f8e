"""Sends the engine's work as Celery messages, and decides when the task running now may run
a step in place instead (``runs_here``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from celery import Celery, Task

from pikku_celery.worker.pool_limits import enforces_time_limits
from pikku_celery.worker.task_names import ORCHESTRATE_KIND, TIMER_KIND, internal_task
from pikku_celery.worker.time_budget import covers, message_limits

if TYPE_CHECKING:
    from pikku_celery.engine.facade import Engine

Route = Callable[[str, tuple[Any, ...], Any], dict[str, Any]]

#: The message header that carries a step as recorded (``store._claim_hint``): a worker that
#: does not know it ignores it, and claims as before.
CLAIM_HEADER = "pikku_claim"


def carried_claim(request: Any) -> object:
    """The step as the delivery's message says it was recorded, if it says (untrusted: the
    store checks it against the step). Celery gives a custom header as an attribute of the
    request, or in its ``headers`` (by version and protocol)."""
    found = getattr(request, CLAIM_HEADER, None)
    if found is None:
        found = (getattr(request, "headers", None) or {}).get(CLAIM_HEADER)
    return found


class CeleryDispatcher:
    """Sends engine work as Celery messages; long waits are chained, never one long ETA."""

    def __init__(self, app: Celery, engine_ref: Callable[[], Engine], max_countdown_s: float,
                 route: Route | None = None) -> None:
        self._app = app
        self._engine = engine_ref
        self.max_countdown_s = max_countdown_s
        # Extra routing options per message (pikku's queue, when one is configured).
        self._route: Route = route or (lambda name, args, task: {})
        self._local = threading.local()  # the producer of a batch, per thread

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Send the steps dispatched inside on one producer, as a Celery group does (a
        fan-out's messages: a third less time per message than a producer each)."""
        if getattr(self._local, "producer", None) is not None:
            yield
            return
        with self._app.producer_or_acquire() as producer:
            self._local.producer = producer
            try:
                yield
            finally:
                self._local.producer = None

    #: Its messages carry the step as recorded (``dispatch_step``'s ``expected``).
    carries_claims = True

    def dispatch_step(self, function: str, run_id: str, step_name: str, *,
                      expected: object = None) -> None:
        task = self._app.tasks.get(function)
        route = self._route(function, (run_id, step_name), task)
        producer = getattr(self._local, "producer", None)
        if producer is not None:
            route = {**route, "producer": producer}
        if expected is not None:
            route = {**route, "headers": {**(route.get("headers") or {}),
                                          CLAIM_HEADER: expected}}
        if task is not None:
            task.apply_async((run_id, step_name), **self._limits(task), **route)
        else:
            self._app.send_task(function, args=(run_id, step_name), **route)

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        task = internal_task(self._app, ORCHESTRATE_KIND)
        args = (run_id,) if step_name is None else (run_id, step_name)
        task.apply_async(args, countdown=countdown_s or None, **self._limits(task),
                         **self._route(task.name, args, task))

    def _limits(self, task: Task) -> dict[str, float]:
        """The app's time limits plus the in-place budget's margin (``time_budget``)."""
        settings = self._engine().settings
        if not settings.continue_in_place or settings.in_place_steps <= 0:
            return {}
        return message_limits(task, settings.in_place_ms)

    def runs_here(self, function: str, run_id: str, step_name: str) -> bool:
        """Whether the task running now in this worker may run step ``function`` in place
        (``passes``) instead of sending it: the message would go where this task's came
        from (same queue, exchange and routing key, by the same routing), the step's task
        has the same task class call (the app's ``task_cls`` around it, or not around
        either), the step has no rate limit, this task has time enough left under the
        limits the pool enforces to give the step all of its own (``time_budget``; the
        threads and solo pools enforce none), and the worker is not shutting down.
        Anything else, and the step is sent as a message."""
        current = self._app.current_worker_task
        task = self._app.tasks.get(function)
        if current is None or current.app is not self._app or task is None or _stopping():
            return False
        request = current.request
        if request.is_eager or request.called_directly or task.rate_limit:
            return False
        if enforces_time_limits(self._app) and not covers(current, task):
            return False
        if _task_call(type(task)) is not _task_call(type(current)):
            return False
        here = self._here(current)
        return here is not None and here == self._destination(function, (run_id, step_name),
                                                               task)

    def _here(self, current: Task) -> tuple[Any, ...] | None:
        """Where the running task's message came from, worked out once per delivery (a
        streak asks at every step)."""
        request = current.request
        key = (current.name, request.id)
        cached = getattr(self._local, "here", None)
        if cached is None or cached[0] != key:
            cached = (key, self._destination(current.name, tuple(request.args or ()), current))
            self._local.here = cached
        return cached[1]

    def _destination(self, name: str, args: tuple[Any, ...], task: Task
                     ) -> tuple[Any, ...] | None:
        """Where a message of ``name`` would go: its queue, exchange and routing key, as
        ``apply_async`` routes it (the task's options, pikku's queue, the app's routes)."""
        options = {**getattr(task, "_get_exec_options", dict)(),
                   **self._route(name, args, task)}
        try:
            route = self._app.amqp.router.route(options, name, args, {}, task)
        except Exception:  # a user's router that cannot answer this: send as usual
            return None
        queue = route.get("queue")
        exchange = route.get("exchange") or getattr(getattr(queue, "exchange", None),
                                                    "name", None)
        return (getattr(queue, "name", queue), exchange,
                route.get("routing_key") or getattr(queue, "routing_key", None))

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        # A broker ETA longer than the Redis transport's visibility timeout would be
        # redelivered while it waits: chain short timers instead (each re-arms the next).
        wait_s = max(0.0, (due_ms - self._engine().now_ms()) / 1000)
        task = internal_task(self._app, TIMER_KIND)
        task.apply_async((run_id, step_name), countdown=min(wait_s, self.max_countdown_s) or None,
                         **self._limits(task), **self._route(task.name, (run_id, step_name), task))


def _task_call(task_type: type) -> Any:
    """The ``__call__`` a task class runs, seen through sentry-sdk's Celery integration:
    in a worker (where Celery's stack protection makes ``__call__`` look custom to it) it
    wraps each task class's ``__call__`` on its own, so no two tasks would share one and
    no step could run in place. Its wrapper reports the task's exception and times it; a
    step run in place is reported to Sentry by ``observe.errors`` instead."""
    call: Any = task_type.__call__
    while (getattr(call, "__wrapped__", None) is not None
           and "sentry_sdk" in getattr(getattr(call, "__code__", None), "co_filename", "")):
        call = call.__wrapped__
    return call


def _stopping() -> bool:
    """A worker asked to stop (warm shutdown) finishes its tasks: they must not go on."""
    from celery.worker import state

    return any(flag is not None and flag is not False
               for flag in (state.should_stop, state.should_terminate))
