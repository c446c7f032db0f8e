"""The app ``test_cli_pipes.py`` runs ``celery -A tests.integration.cliapp_gates pikku ...``
on: a workflow waiting at an approval gate, configured as ``cliapp`` (``pikku_*`` settings
from environment variables the test sets)."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from pikku_celery import PikkuCelery, WorkflowContext

app = Celery("pikku_cli_gates_it", broker="memory://", set_as_current=False)
app.conf.update(pikku_mongo_url=os.environ.get("PIKKU_CLI_MONGO_URL"),
                pikku_redis_url=os.environ.get("PIKKU_CLI_REDIS_URL"),
                pikku_key_prefix=os.environ.get("PIKKU_CLI_KEY_PREFIX", "pikku_cli_gates"),
                pikku_worker_reaper=False)
pikku = PikkuCelery(app)


@pikku.workflow("gated")
def gated(wf: WorkflowContext, data: Any) -> Any:
    return wf.approval("manager", schema={"type": "boolean"})
