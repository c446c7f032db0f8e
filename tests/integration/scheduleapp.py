"""The app of ``test_schedules_workers.py``'s ``celery -A tests.integration.scheduleapp
worker`` subprocesses: ``workerapp``'s app (the same environment variables) plus a workflow
``ticked`` and its schedule ``every-2s`` (every 2 s, ``catch_up`` from
``PIKKU_IT_CATCH_UP``, default ``latest``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from celery import Celery

from tests.integration import workerapp as wa

ENV_CATCH_UP = "PIKKU_IT_CATCH_UP"
SCHEDULE = "every-2s"


def build(env: Mapping[str, str]) -> Celery:
    app = wa.build(env)
    pikku = app.pikku

    @pikku.step("it.sched.echo")
    def echo(data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "pid": os.getpid()}

    @pikku.workflow("ticked")
    def ticked(wf: Any, data: dict[str, Any]) -> dict[str, Any]:
        when = wf.scheduled_for
        echoed = wf.do("echo", echo, {"n": data["n"], "at": when.isoformat()})
        return {"scheduled_for": echoed["at"], "pid": echoed["pid"]}

    pikku.schedule(SCHEDULE, "ticked", every="2s", data={"n": 1},
                   catch_up=env.get(ENV_CATCH_UP, "latest"))
    return app


_built: dict[str, Celery] = {}


def __getattr__(name: str) -> Any:
    # ``celery -A tests.integration.scheduleapp`` reads ``app``: built on first access.
    if name in ("app", "celery"):
        if "app" not in _built:
            _built["app"] = build(os.environ)
        return _built["app"]
    raise AttributeError(name)
