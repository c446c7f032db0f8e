"""The app ``celery -A tests.integration.cliapp pikku ...`` loads in
``test_cli_celery.py``: configured Celery's way (``pikku_*`` settings in ``app.conf``, from
environment variables the test sets), so the subprocess finds the same MongoDB database
and Redis prefix as the test process."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from pikku_celery import PikkuCelery, WorkflowContext

app = Celery("pikku_cli_it", broker="memory://", set_as_current=False)
app.conf.update(pikku_mongo_url=os.environ.get("PIKKU_CLI_MONGO_URL"),
                pikku_redis_url=os.environ.get("PIKKU_CLI_REDIS_URL"),
                pikku_key_prefix=os.environ.get("PIKKU_CLI_KEY_PREFIX", "pikku_cli_it"),
                pikku_worker_reaper=False)
pikku = PikkuCelery(app)


@pikku.step(name="cli.add")
def add(data: dict[str, int]) -> int:
    return data["a"] + data["b"]


@pikku.workflow("sum")
def total(wf: WorkflowContext, data: Any) -> Any:
    return wf.do("add", add, data)


# Ticks once a year (1 January, 00:00 UTC): no worker of a test fires it.
pikku.schedule("yearly", "sum", cron="0 0 1 1 *", data={"a": 20, "b": 22})
