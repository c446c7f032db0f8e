"""``PikkuCelery.wait`` is woken by the announcement of a run's end, not by its next read.

The backstop timer is made longer than each test's timeout, so only the announcement can
end the wait in time: the pass that ends the run announces it as it hands the run back,
a cancel right after its write. Without them each wait here times out."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.engine import reads
from tests.unit.test_engine import Recorder

WAIT_S = 20.0  # far below the backstop below; far above what an announced end takes


@pytest.fixture
def pikku(monkeypatch: pytest.MonkeyPatch) -> Iterator[PikkuCelery]:
    monkeypatch.setattr(reads, "BACKSTOP_S", (60.0, 60.0))
    app = Celery(f"test-{id(object())}", broker="memory://")
    made = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                       worker_reaper=False)
    made.engine.dispatcher = Recorder()
    yield made


def _meanwhile(action: Callable[[], object]) -> threading.Thread:
    def later() -> None:
        time.sleep(0.2)
        action()

    thread = threading.Thread(target=later)
    thread.start()
    return thread


def _workflow(pikku: PikkuCelery) -> tuple[Any, Any]:
    @pikku.step()
    def charge(data: Any) -> str:
        return "charged"

    @pikku.workflow()
    def checkout(wf: Any, data: Any) -> Any:
        return wf.do("charge", charge)

    return checkout, charge


def test_a_pass_that_ends_the_run_wakes_its_waiter(pikku: PikkuCelery) -> None:
    checkout, charge = _workflow(pikku)
    run_id = pikku.start(checkout, None)
    pikku.engine.advance(run_id)  # the step is recorded; its message is not delivered yet
    definition = pikku.registry.steps[charge.name]

    def deliver() -> None:
        pikku.engine.execute_step(definition, run_id, "charge")
        pikku.engine.advance(run_id)

    thread = _meanwhile(deliver)
    started = time.monotonic()
    run = pikku.wait(run_id, WAIT_S)
    thread.join()
    assert (run.status, run.output) == ("completed", "charged")
    assert time.monotonic() - started < WAIT_S / 2  # not the read at the wait's end


def test_a_cancel_wakes_its_waiter(pikku: PikkuCelery) -> None:
    checkout, _ = _workflow(pikku)
    run_id = pikku.start(checkout, None)
    thread = _meanwhile(lambda: pikku.cancel(run_id))
    started = time.monotonic()
    run = pikku.wait(run_id, WAIT_S)
    thread.join()
    assert run.status == "cancelled"
    assert time.monotonic() - started < WAIT_S / 2  # not the read at the wait's end


def test_a_run_ended_before_the_wait_is_read_at_once(pikku: PikkuCelery) -> None:
    checkout, _ = _workflow(pikku)
    run_id = pikku.start(checkout, None)
    pikku.cancel(run_id)  # announced before anyone listened: the first read finds it
    started = time.monotonic()
    assert pikku.wait(run_id, WAIT_S).status == "cancelled"
    assert time.monotonic() - started < 1.0
