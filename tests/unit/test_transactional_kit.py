"""Transactional steps in the test kit (issue 26, item 4): the kit's in-memory store has no
transactions, so a transactional body runs as any step's with ``ctx.session`` ``None``
(pymongo takes ``session=None`` as "no session"), and never in place."""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery

from pikku_celery import PikkuCelery
from pikku_celery.testing import inline


def test_a_transactional_step_runs_in_the_kit_with_no_session() -> None:
    pikku = PikkuCelery(Celery(f"txn-kit-{uuid.uuid4().hex[:8]}", broker="memory://"))
    sessions: list[Any] = []

    @pikku.step(name="kit.place", bind=True, transactional=True)
    def place(ctx: Any, data: Any) -> str:
        sessions.append(ctx.session)
        return f"placed {data}"

    @pikku.workflow("kit_order")
    def order(wf: Any, data: Any) -> Any:
        return wf.do("place", place, data)

    with inline(pikku):
        run_id = pikku.start("kit_order", "o-1")
        assert pikku.get_run(run_id).output == "placed o-1"
    assert sessions == [None]
    definition = pikku.registry.steps["kit.place"]
    assert definition.transactional and definition.bind


class _Here:
    """A dispatcher that would run any step in place."""

    def runs_here(self, function: str | None, run_id: str, step_name: str) -> bool:
        return True


def test_a_transactional_step_is_never_run_in_place() -> None:
    """Its settle commits in its own transaction, not with the next step's claim."""
    from pikku_celery.engine.in_place import InPlace
    from pikku_celery.store.base import NewStep
    from pikku_celery.workflow.definitions import Registry, make_step

    registry = Registry()
    for name, transactional in (("plain", False), ("txn", True)):
        registry.add_step(make_step(lambda ctx, data: data, name, retries=0,
                                    retry_delay=None, lease=None, bind=True,
                                    transactional=transactional))
    in_place = InPlace(runner=None, steps=10, ms=10_000, pass_ms=10_000)  # type: ignore[arg-type]
    for name, runs in (("plain", True), ("txn", False)):
        step = NewStep(run_id="r", step_name=name, function=name)
        chosen = in_place.runnable([step], name, registry, _Here())  # type: ignore[arg-type]
        assert (chosen is not None) is runs, name
