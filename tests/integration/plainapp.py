"""An ordinary Celery app (plain tasks, Celery's MongoDB result backend) that
``test_non_interference.py`` runs on real ``celery -A tests.integration.plainapp worker``
processes, with or without a ``PikkuCelery`` bound to it.

Built from environment variables the test sets (its own default queue, control exchange,
Redis key prefix and MongoDB database), like ``workerapp.py``:

* ``PIKKU_NI_BIND=1`` binds a ``PikkuCelery`` with default options (as a user adds pikku to
  the app they have), its reaper sweeping every half second, and registers ``ni.flow``;
* ``PIKKU_NI_QUEUE=<name>`` gives pikku a queue of its own (``PikkuCelery(queue=...)``);
* ``PIKKU_NI_CONF_PREFETCH=<n>`` sets ``worker_prefetch_multiplier`` through
  ``config_from_object`` (not ``app.conf.changes``), as Django settings would.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from celery import Celery, Task

from pikku_celery import MongoWorkflowStore, PikkuCelery, RedisLeaseService

ENV_BROKER = "PIKKU_NI_BROKER_URL"
ENV_BACKEND = "PIKKU_NI_BACKEND_URL"  # mongodb://... (Celery's own MongoDB backend)
ENV_TAG = "PIKKU_NI_TAG"  # names the default queue, control exchange and key prefixes
ENV_BIND = "PIKKU_NI_BIND"
ENV_MONGO = "PIKKU_NI_MONGO_URL"  # pikku's store
ENV_REDIS = "PIKKU_NI_REDIS_URL"  # pikku's leases
ENV_QUEUE = "PIKKU_NI_QUEUE"
ENV_CONF_PREFETCH = "PIKKU_NI_CONF_PREFETCH"

FLOW = "ni.flow"


def default_queue(tag: str) -> str:
    return f"ni-{tag}"


def build(env: Mapping[str, str]) -> Celery:
    tag = env[ENV_TAG]
    app = Celery(f"ni_{tag}", broker=env[ENV_BROKER], backend=env[ENV_BACKEND],
                 set_as_current=False)
    if env.get(ENV_CONF_PREFETCH):  # a layer of its own, as Django settings are
        app.config_from_object({"worker_prefetch_multiplier": int(env[ENV_CONF_PREFETCH])})
    app.conf.update(_conf(env))
    _tasks(app)
    if env.get(ENV_BIND) == "1":
        _bind(app, env)
    return app


def _conf(env: Mapping[str, str]) -> dict[str, Any]:
    tag = env[ENV_TAG]
    conf: dict[str, Any] = {
        "task_default_queue": default_queue(tag),
        # Remote control stays on (inspect, revoke) on an exchange of this test's own, so
        # no other worker on the shared broker answers or hears the broadcasts.
        "control_exchange": f"ni-control-{tag}",
        "event_exchange": f"ni-events-{tag}",
        "result_extended": True,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
    }
    if env[ENV_BROKER].startswith("amqp"):
        conf["broker_heartbeat"] = 0
    else:
        conf["broker_transport_options"] = {"global_keyprefix": f"ni-{tag}:kombu:"}
    return conf


def _tasks(app: Celery) -> None:
    @app.task(name="ni.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="ni.xsum", shared=False)
    def xsum(numbers: list[int]) -> int:
        return sum(numbers)

    @app.task(name="ni.sleeping", shared=False)
    def sleeping(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @app.task(name="ni.retrying", bind=True, shared=False, max_retries=2)
    def retrying(task: Task, fail_times: int) -> int:
        if task.request.retries < fail_times:
            raise task.retry(exc=ValueError(f"try {task.request.retries}"), countdown=0.1)
        return int(task.request.retries)


def _bind(app: Celery, env: Mapping[str, str]) -> None:
    pikku = PikkuCelery(
        app,
        store=MongoWorkflowStore.from_url(env[ENV_MONGO], serverSelectionTimeoutMS=5000),
        leases=RedisLeaseService.from_url(env[ENV_REDIS], key_prefix=f"ni-{env[ENV_TAG]}"),
        reaper_interval=0.5,
        queue=env.get(ENV_QUEUE) or None,
    )

    @pikku.step("ni.double")
    def double(n: int) -> int:
        return n * 2

    @pikku.workflow(FLOW)
    def flow(wf: Any, n: int) -> dict[str, int]:
        first = wf.do("first", double, n)
        left, right = wf.gather(wf.call("left", double, first), wf.call("right", double, 1))
        return {"first": first, "left": left, "right": right}


_built: dict[str, Celery] = {}


def __getattr__(name: str) -> Any:
    # ``celery -A tests.integration.plainapp`` reads ``app``: built on first access from the
    # environment, so the test process can import this module without one.
    if name in ("app", "celery"):
        if "app" not in _built:
            _built["app"] = build(os.environ)
        return _built["app"]
    raise AttributeError(name)
