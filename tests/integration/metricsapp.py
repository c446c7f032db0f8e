"""The app of ``test_metrics_prometheus.py``'s workers: ``workerapp``'s, serving its metrics
on the port in ``PIKKU_IT_METRICS_PORT`` (``pikku_metrics_port``, read at the worker's
start)."""

from __future__ import annotations

import os
from typing import Any

from tests.integration import workerapp

ENV_METRICS_PORT = "PIKKU_IT_METRICS_PORT"


def __getattr__(name: str) -> Any:
    if name in ("app", "celery"):
        app = workerapp.app
        app.conf.pikku_metrics_port = int(os.environ[ENV_METRICS_PORT])
        app.conf.pikku_metrics_addr = "127.0.0.1"
        return app
    raise AttributeError(name)
