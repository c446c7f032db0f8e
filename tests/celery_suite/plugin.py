"""pytest plugin for Celery's own ``t/integration`` suite: binds a ``PikkuCelery`` to the
suite's session app, the app its session worker runs, as a user binds pikku to the app they
already have (default options; the reaper sweeping every second so it runs throughout).

The suite's conftest imports ``celery_session_app`` from ``celery.contrib.pytest``, and a
conftest fixture beats a plugin's of the same name, so the plugin cannot replace the fixture:
it wraps its set-up instead (``pytest_fixture_setup``) and binds pikku to the app it returns,
before the session worker starts. When the session worker is torn down (its last test done,
the worker still running), one workflow runs on it end to end and its outcome is written to
the JSON file named by ``PIKKU_SUITE_REPORT``.

Loaded with ``-p tests.celery_suite.plugin`` by ``tests/celery_suite/run.py``.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Generator
from typing import Any

import pytest

from pikku_celery import MongoWorkflowStore, PikkuCelery, RedisLeaseService

ENV_MONGO = "PIKKU_SUITE_MONGO_URL"
ENV_REDIS = "PIKKU_SUITE_REDIS_URL"
ENV_PREFIX = "PIKKU_SUITE_KEY_PREFIX"
ENV_REPORT = "PIKKU_SUITE_REPORT"
WORKFLOW = "pikku_suite.check"
WORKFLOW_TIMEOUT_S = 60.0

_bound: dict[str, PikkuCelery] = {}


def bind(app: Any) -> PikkuCelery:
    pikku = PikkuCelery(
        app,
        store=MongoWorkflowStore.from_url(os.environ[ENV_MONGO], serverSelectionTimeoutMS=5000),
        leases=RedisLeaseService.from_url(os.environ[ENV_REDIS],
                                          key_prefix=os.environ[ENV_PREFIX]),
        reaper_interval=1.0,
    )

    @pikku.step("pikku_suite.double")
    def double(n: int) -> int:
        return n * 2

    @pikku.workflow(WORKFLOW)
    def check(wf: Any, n: int) -> dict[str, Any]:
        first = wf.do("first", double, n)
        left, right = wf.gather(wf.call("left", double, first), wf.call("right", double, 1))
        return {"first": first, "left": left, "right": right}

    return pikku


def run_workflow(pikku: PikkuCelery) -> dict[str, Any]:
    try:
        run = pikku.wait(pikku.start(WORKFLOW, 21), WORKFLOW_TIMEOUT_S)
        return {"status": run.status, "output": run.output, "error": run.error}
    except Exception as exc:  # reported by the runner, never a test failure of the suite
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()}


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Generator[None, Any, Any]:
    result = yield
    if fixturedef.argname == "celery_session_app":
        _bound["pikku"] = bind(result)
    elif fixturedef.argname == "celery_session_worker" and "pikku" in _bound:
        # Added after the fixture's own teardown, so it runs first: the worker is still up.
        fixturedef.addfinalizer(_report)
    return result


def _report() -> None:
    outcome = run_workflow(_bound["pikku"])
    with open(os.environ[ENV_REPORT], "w") as f:
        json.dump(outcome, f)
