"""Graph workflow features of issue 12: error routes (``on_error``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    InvalidInputError,
    PikkuCelery,
)


@pytest.fixture
def pikku() -> Iterator[PikkuCelery]:
    app = Celery("graph-features", broker="memory://")
    yield PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                      worker_reaper=False)


def _error_graph(pikku: PikkuCelery, ran: list[str], *, fail: bool) -> None:
    @pikku.step(name="gf.charge", retries=1, retry_delay=0)
    def charge(data: dict[str, Any]) -> Any:
        ran.append("charge")
        if fail:
            raise ValueError("card declined")
        return {"charged": True}

    @pikku.step(name="gf.ship")
    def ship(data: dict[str, Any]) -> Any:
        ran.append("ship")
        return {"shipped": data["from"]["charge"]}

    @pikku.step(name="gf.refund")
    def refund(data: dict[str, Any]) -> Any:
        ran.append("refund")
        return {"refunded": data["error"]["message"], "order": data["input"]["input"]}

    @pikku.step(name="gf.notify")
    def notify(data: dict[str, Any]) -> Any:
        ran.append("notify")
        return {"notified": data["from"]["refund"]["refunded"]}

    pikku.graph("pay", nodes={"charge": charge, "ship": ship, "refund": refund,
                              "notify": notify},
                edges=[("charge", "ship"), ("refund", "notify")],
                on_error={"charge": "refund"})


def test_a_failed_node_runs_its_error_route_and_the_run_ends_on_the_handler_path(
        pikku: PikkuCelery) -> None:
    ran: list[str] = []
    _error_graph(pikku, ran, fail=True)
    run_id = pikku.start("pay", {"order": 7}, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "completed", run.error
    assert run.output == {"notify": {"notified": "card declined"}}
    assert ran == ["charge", "charge", "refund", "notify"]  # retried, then routed; no ship
    steps = {s.step_name: s.status for s in pikku.get_steps(run_id)}
    assert "ship" not in steps and steps["charge"] == "failed"


def test_a_handler_receives_the_error_and_the_failed_nodes_input(pikku: PikkuCelery) -> None:
    ran: list[str] = []
    _error_graph(pikku, ran, fail=True)
    run_id = pikku.start("pay", {"order": 7}, inline=True)
    refund = next(s for s in pikku.get_steps(run_id) if s.step_name == "refund")
    assert refund.data["input"] == {"input": {"order": 7}, "from": {}}
    assert refund.data["error"]["type"] == "ValueError"
    assert refund.result == {"refunded": "card declined", "order": {"order": 7}}


def test_the_handler_and_its_path_are_skipped_when_the_node_succeeds(
        pikku: PikkuCelery) -> None:
    ran: list[str] = []
    _error_graph(pikku, ran, fail=False)
    run_id = pikku.start("pay", None, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "completed"
    assert run.output == {"ship": {"shipped": {"charged": True}}}
    assert ran == ["charge", "ship"]


def test_a_failure_without_an_error_route_still_fails_the_run(pikku: PikkuCelery) -> None:
    @pikku.step(name="gf.bad", retries=0)
    def bad(data: Any) -> None:
        raise ValueError("no route")

    @pikku.step(name="gf.fine")
    def fine(data: Any) -> int:
        return 1

    pikku.graph("partial", nodes={"a": fine, "b": bad, "h": fine},
                edges=[("a", "b")], on_error={"a": "h"})
    run = pikku.get_run(pikku.start("partial", None, inline=True))
    assert run.status == "failed" and run.error is not None
    assert "no route" in run.error["message"]


@pytest.mark.parametrize(("on_error", "edges", "fragment"), [
    ({"zz": "b"}, [], "on_error on unknown node 'zz'"),
    ({"a": "zz"}, [], "handler 'zz' of 'a' is not a node"),
    ({"a": "a"}, [], "cannot handle its own error"),
    ({"a": "b"}, [("a", "b")], "has incoming edges"),
    ({"a": "c", "b": "c"}, [], "handles more than one node"),
    ({"a": "b", "b": "c"}, [], "has an error route itself"),
])
def test_bad_error_routes_are_refused_when_declared(
        pikku: PikkuCelery, on_error: Any, edges: Any, fragment: str) -> None:
    step = pikku.step(name="gf.x")(lambda data: None)
    with pytest.raises(InvalidInputError, match=fragment):
        pikku.graph("bad", nodes={"a": step, "b": step, "c": step}, edges=edges,
                    on_error=on_error)
