"""README's "Why not a chain?" (issue 36 item 3): both versions of the checkout run as
written, the chain on an in-process Celery worker, the workflow through the test kit, and
give the same reservation and charge."""

from __future__ import annotations

import types
from typing import Any

from celery.contrib.testing.worker import start_worker

from pikku_celery.testing import inline
from tests.support.readme import readme_example


def module_of(name: str) -> Any:
    module = types.ModuleType(name.removesuffix(".py"))
    exec(compile(readme_example(name), name, "exec"), module.__dict__)
    return module


ORDER = {"id": "o-1", "amount": 42}


def test_the_chain_runs_as_written() -> None:
    shop = module_of("chain_checkout.py")
    shop.app.conf.update(broker_url="memory://", result_backend="cache+memory://")
    with start_worker(shop.app, pool="solo", perform_ping_check=False):
        result = shop.checkout(ORDER).get(timeout=30)
    assert result == {**ORDER, "reservation": "r-o-1", "charged": 42}


def test_the_workflow_runs_as_written() -> None:
    shop = module_of("workflow_checkout.py")
    with inline(shop.pikku):
        run_id = shop.pikku.start("checkout", ORDER)
        run = shop.pikku.get_run(run_id)
        history = shop.pikku.get_history(run_id)
    assert (run.status, run.output) == ("completed", {"reservation": "r-o-1", "charged": 42})
    assert [(a.step_name, a.attempt) for a in history] == [("reserve", 1), ("charge", 1)]
