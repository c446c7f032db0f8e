"""``workerapp``'s app for the observability tests of issue 33 (parts 3-5), with what a
production worker would add: ``sentry-sdk`` with its Celery integration (its events written
to a file, one JSON document a line, instead of sent), and a log file of the records of the
``pikku_celery`` logger in a format that names pikku's structured fields."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from celery import Celery

from tests.integration import workerapp as wa

ENV_SENTRY_FILE = "PIKKU_IT_SENTRY_FILE"
ENV_FIELDS_LOG = "PIKKU_IT_FIELDS_LOG"
FIELDS_FORMAT = "%(run_id)s|%(workflow)s|%(step)s|%(attempt)s|%(levelname)s|%(message)s"

_built: dict[str, Celery] = {}


def _sentry(path: str) -> None:
    import sentry_sdk
    from sentry_sdk.integrations.celery import CeleryIntegration
    from sentry_sdk.transport import Transport

    class ToFile(Transport):  # type: ignore[misc]
        def capture_envelope(self, envelope: Any) -> None:
            event = envelope.get_event()
            if event is not None:
                with open(path, "a", encoding="utf-8") as out:
                    out.write(json.dumps(event, default=str) + "\n")

    sentry_sdk.init(dsn="http://key@127.0.0.1:9/1", transport=ToFile,
                    integrations=[CeleryIntegration()], default_integrations=False)


BOOM = "it.obs_boom"


def add_workflows(pikku: Any) -> None:
    """``obs_fail``: a first step, a sleep, then a step that fails for good (no retries),
    run in place by the pass the sleep's timer starts in a worker (without the sleep, the
    starting process's pass may still hold the run when the first step settles, and send
    the next step itself)."""

    @pikku.step(BOOM, retries=0)
    def boom(data: dict[str, Any]) -> None:
        raise LookupError(f"no such thing: {data['after']}")

    @pikku.workflow("obs_fail")
    def obs_fail(wf: Any, data: dict[str, Any]) -> None:
        first = wf.do("first", wa.ADD, {"a": 1, "b": 1})
        wf.sleep("nap", "50ms")
        wf.do("boom", boom, {"after": first})


def build(env: Any) -> Celery:
    if env.get(ENV_SENTRY_FILE):
        _sentry(env[ENV_SENTRY_FILE])
    if env.get(ENV_FIELDS_LOG):
        handler = logging.FileHandler(env[ENV_FIELDS_LOG])
        handler.setFormatter(logging.Formatter(FIELDS_FORMAT))
        logging.getLogger("pikku_celery").addHandler(handler)
    app = wa.build(env)
    add_workflows(app.pikku)  # type: ignore[attr-defined]
    return app


def __getattr__(name: str) -> Any:
    if name in ("app", "celery"):
        if "app" not in _built:
            _built["app"] = build(os.environ)
        return _built["app"]
    raise AttributeError(name)
