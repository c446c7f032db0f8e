"""Graph workflows: joins fire once, no completion while nodes run, branches, bad graphs
(upstream scenario 48, without cycles: graphs are DAGs here)."""

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
from tests.unit.test_engine import Recorder


@pytest.fixture
def pikku() -> Iterator[PikkuCelery]:
    app = Celery("graphs", broker="memory://")
    yield PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                      worker_reaper=False)


def _diamond(pikku: PikkuCelery, ran: list[str], branch: Any = None) -> None:
    def make(name: str) -> Any:
        @pikku.step(name=f"graph.{name}")
        def node(data: dict[str, Any]) -> Any:
            ran.append(name)
            return {"node": name, "from": sorted(data["from"]), "input": data["input"]}
        return node

    steps = {n: make(n) for n in "abcd"}
    pikku.graph("diamond", nodes=steps,
                edges=[("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")], branch=branch)


def test_a_diamond_runs_each_node_once_and_joins_once(pikku: PikkuCelery) -> None:
    ran: list[str] = []
    _diamond(pikku, ran)
    run_id = pikku.start("diamond", {"order": 1}, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "completed"
    assert run.output == {"d": {"node": "d", "from": ["b", "c"], "input": {"order": 1}}}
    assert sorted(ran) == ["a", "b", "c", "d"] and ran.count("d") == 1


def test_the_join_waits_for_every_predecessor_and_fan_out_is_one_pass(
        pikku: PikkuCelery) -> None:
    ran: list[str] = []
    _diamond(pikku, ran)
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    run_id = pikku.start("diamond", None)
    pikku.engine.advance(run_id)

    def run(node: str) -> None:
        pikku.engine.execute_step(pikku.registry.steps[f"graph.{node}"], run_id, node)
        pikku.engine.advance(run_id)

    assert [s[2] for s in recorder.steps] == ["a"]
    run("a")
    assert [s[2] for s in recorder.steps] == ["a", "b", "c"]  # b and c in the same pass
    run("b")
    assert [s[2] for s in recorder.steps] == ["a", "b", "c"]  # d waits for c
    assert pikku.get_run(run_id).status == "running"
    run("c")
    assert [s[2] for s in recorder.steps] == ["a", "b", "c", "d"]
    run("d")
    assert pikku.get_run(run_id).status == "completed"


def test_a_branch_skips_the_nodes_it_did_not_choose(pikku: PikkuCelery) -> None:
    ran: list[str] = []
    _diamond(pikku, ran, branch={"a": lambda result: ["b"]})
    run_id = pikku.start("diamond", None, inline=True)
    assert "c" not in ran
    assert pikku.get_run(run_id).output == {"d": {"node": "d", "from": ["b"], "input": None}}


def test_a_node_that_fails_for_good_fails_the_run(pikku: PikkuCelery) -> None:
    @pikku.step(name="graph.ok")
    def ok(data: Any) -> int:
        return 1

    @pikku.step(name="graph.bad", retries=1, retry_delay=0)
    def bad(data: Any) -> None:
        raise ValueError("node broke")

    pikku.graph("breaks", nodes={"ok": ok, "bad": bad, "after": ok},
                edges=[("ok", "bad"), ("bad", "after")])
    run_id = pikku.start("breaks", None, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "failed" and run.error is not None
    assert "node broke" in run.error["message"]
    assert "after" not in {s.step_name for s in pikku.get_steps(run_id)}


@pytest.mark.parametrize(("edges", "fragment"), [
    ([("a", "b"), ("b", "a")], "cycle"),
    ([("a", "zz")], "unknown node"),
])
def test_bad_graphs_are_refused_when_declared(pikku: PikkuCelery, edges: Any,
                                              fragment: str) -> None:
    step = pikku.step(name="graph.x")(lambda data: None)
    with pytest.raises(InvalidInputError, match=fragment):
        pikku.graph("bad", nodes={"a": step, "b": step}, edges=edges)


def test_a_node_must_be_a_step(pikku: PikkuCelery) -> None:
    with pytest.raises(InvalidInputError, match="not a pikku step"):
        pikku.graph("bad", nodes={"a": lambda data: None}, edges=[])


def test_a_branch_choosing_a_non_successor_fails_the_run_clearly(pikku: PikkuCelery) -> None:
    ran: list[str] = []
    _diamond(pikku, ran, branch={"a": lambda result: ["d"]})
    run_id = pikku.start("diamond", None, inline=True)
    error = pikku.get_run(run_id).error
    assert error is not None and "not its successors" in error["message"]
