"""The Celery app of ``test_hardening_infra.py``'s outage tests: a real ``celery -A
tests.integration.outage_app worker`` whose MongoDB or Redis (leases) URL points at a port
where nothing answers. Everything comes from environment variables the test sets; the
``pikku_celery`` logger is at DEBUG so the test can count the failed sweeps it must not see
as ERROR lines."""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery

from pikku_celery import MongoWorkflowStore, PikkuCelery, RedisLeaseService

ENV_BROKER = "PIKKU_OUTAGE_BROKER_URL"
ENV_MONGO = "PIKKU_OUTAGE_MONGO_URL"
ENV_REDIS = "PIKKU_OUTAGE_REDIS_URL"
ENV_PREFIX = "PIKKU_OUTAGE_KEY_PREFIX"
ENV_QUEUE = "PIKKU_OUTAGE_QUEUE"
# "1": configured as a user does, by settings only, with every default (a reaper interval
# of 30 s, pikku's server-selection timeout of 5 s)
ENV_AS_CONFIGURED = "PIKKU_OUTAGE_AS_CONFIGURED"
REAPER_INTERVAL_S = 0.2


def build(env: Any) -> Celery:
    logging.getLogger("pikku_celery").setLevel(logging.DEBUG)
    app = Celery(f"pikku_outage_{env[ENV_QUEUE]}", broker=env[ENV_BROKER],
                 set_as_current=False)
    app.conf.update(
        task_default_queue=env[ENV_QUEUE],
        broker_connection_retry_on_startup=True,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        broker_transport_options={"global_keyprefix": f"{env[ENV_PREFIX]}:kombu:"},
    )
    if env.get(ENV_AS_CONFIGURED) == "1":
        app.conf.update(pikku_mongo_url=env[ENV_MONGO], pikku_redis_url=env[ENV_REDIS],
                        pikku_key_prefix=env[ENV_PREFIX])
        PikkuCelery(app).workflow("noop")(lambda wf, data: data)
        return app
    pikku = PikkuCelery(
        app,
        store=MongoWorkflowStore.from_url(env[ENV_MONGO], server_selection_timeout="300ms"),
        leases=RedisLeaseService.from_url(env[ENV_REDIS], key_prefix=env[ENV_PREFIX]),
        reaper_interval=REAPER_INTERVAL_S,
    )
    pikku.workflow("noop")(lambda wf, data: data)
    return app


_built: dict[str, Celery] = {}


def __getattr__(name: str) -> Any:
    # Built on first access, so importing this module needs no environment.
    if name in ("app", "celery"):
        if "app" not in _built:
            _built["app"] = build(os.environ)
        return _built["app"]
    raise AttributeError(name)
