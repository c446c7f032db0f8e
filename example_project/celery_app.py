"""The Celery app that ``celery -A example_project worker`` runs.

Configuration lives in ``app.conf`` as in any Celery project; pikku binds to the app and
registers its own tasks on it, so the ordinary worker command runs steps, orchestration and
the reaper.
"""

from __future__ import annotations

from celery import Celery

from example_project import settings
from pikku_celery import MongoWorkflowStore, PikkuCelery, RedisLeaseService

app = Celery("example_project", broker=settings.BROKER_URL)
app.conf.update(
    task_default_queue=settings.QUEUE,
    task_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # Long waits are chained by pikku, so a visibility timeout shorter than the default
    # hour is fine; it only bounds how late a lost message is redelivered.
    broker_transport_options={"visibility_timeout": 3600},
)

pikku = PikkuCelery(
    app,
    store=MongoWorkflowStore.from_url(settings.MONGO_URL),
    leases=RedisLeaseService.from_url(settings.REDIS_URL, key_prefix=settings.KEY_PREFIX),
    step_lease=settings.STEP_LEASE_S,
    reaper_interval=settings.REAPER_INTERVAL_S,
    undispatched_after=settings.UNDISPATCHED_AFTER_S,
    stalled_after=settings.STALLED_AFTER_S,
    # This app runs only workflows, so pikku's queue is its default queue: its workers
    # consume nothing else and run with prefetch 1. An app with tasks of its own would
    # give pikku a queue apart (see "Adding pikku to an existing app" in the README).
    queue=settings.QUEUE,
)

# Importing the workflows registers their steps on this app.
from example_project import orders  # noqa: E402,F401
