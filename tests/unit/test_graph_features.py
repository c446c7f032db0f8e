"""Graph workflow features of issue 12: error routes (``on_error``), per-item fan-out
(``for_each``), loops (back-edges, ``max_visits``)."""

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
    with_state,
)
from tests.unit.test_engine import Recorder


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


def _fan_out_graph(pikku: PikkuCelery, *, sequential: bool = False,
                   items: Any = (3, 1, 2)) -> None:
    @pikku.step(name="gf.list")
    def list_items(data: Any) -> Any:
        return list(items) if isinstance(items, tuple) else items

    @pikku.step(name="gf.square")
    def square(data: dict[str, Any]) -> Any:
        return {"index": data["index"], "square": data["item"] ** 2}

    @pikku.step(name="gf.total")
    def total(data: dict[str, Any]) -> Any:
        return [r["square"] for r in data["from"]["square"]]

    pikku.graph("squares", nodes={"list": list_items, "square": square, "total": total},
                edges=[("list", "square"), ("square", "total")],
                for_each={"square": {"over": "list", "sequential": True} if sequential
                          else "list"})


def test_a_for_each_node_runs_once_per_item_and_successors_get_results_in_order(
        pikku: PikkuCelery) -> None:
    _fan_out_graph(pikku)
    run_id = pikku.start("squares", None, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "completed", run.error
    assert run.output == {"total": [9, 1, 4]}
    names = {s.step_name for s in pikku.get_steps(run_id)}
    assert {"square[0]", "square[1]", "square[2]"} <= names and "square" not in names


def test_a_parallel_fan_out_dispatches_every_item_in_one_pass(pikku: PikkuCelery) -> None:
    _fan_out_graph(pikku)
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    run_id = pikku.start("squares", None)
    pikku.engine.advance(run_id)
    pikku.engine.execute_step(pikku.registry.steps["gf.list"], run_id, "list")
    pikku.engine.advance(run_id)
    assert [s[2] for s in recorder.steps] == ["list", "square[0]", "square[1]", "square[2]"]


def test_a_sequential_fan_out_starts_an_item_only_after_the_one_before(
        pikku: PikkuCelery) -> None:
    _fan_out_graph(pikku, sequential=True)
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    run_id = pikku.start("squares", None)
    pikku.engine.advance(run_id)

    def run(step: str, name: str) -> None:
        pikku.engine.execute_step(pikku.registry.steps[step], run_id, name)
        pikku.engine.advance(run_id)

    run("gf.list", "list")
    assert [s[2] for s in recorder.steps] == ["list", "square[0]"]
    run("gf.square", "square[0]")
    assert [s[2] for s in recorder.steps] == ["list", "square[0]", "square[1]"]
    run("gf.square", "square[1]")
    run("gf.square", "square[2]")
    assert recorder.steps[-1][2] == "total"
    run("gf.total", "total")
    assert pikku.get_run(run_id).output == {"total": [9, 1, 4]}


def test_an_empty_list_runs_no_item_and_passes_an_empty_list(pikku: PikkuCelery) -> None:
    _fan_out_graph(pikku, items=[])
    run = pikku.get_run(pikku.start("squares", None, inline=True))
    assert run.status == "completed" and run.output == {"total": []}


def test_a_for_each_over_a_non_list_fails_the_run_clearly(pikku: PikkuCelery) -> None:
    _fan_out_graph(pikku, items={"not": "a list"})
    run = pikku.get_run(pikku.start("squares", None, inline=True))
    assert run.status == "failed" and run.error is not None
    assert "needs a list from 'list'" in run.error["message"]


@pytest.mark.parametrize(("for_each", "fragment"), [
    ({"zz": "a"}, "for_each on unknown node 'zz'"),
    ({"b": "c"}, "not one of its predecessors"),
    ({"b": {"over": "a", "sequential": "yes"}}, "must be a predecessor's name"),
    ({"b": {"from": "a"}}, "must be a predecessor's name"),
])
def test_bad_for_each_declarations_are_refused(pikku: PikkuCelery, for_each: Any,
                                               fragment: str) -> None:
    step = pikku.step(name="gf.y")(lambda data: None)
    with pytest.raises(InvalidInputError, match=fragment):
        pikku.graph("bad", nodes={"a": step, "b": step, "c": step},
                    edges=[("a", "b")], for_each=for_each)


def _loop_graph(pikku: PikkuCelery, ran: list[str], *, rounds: int,
                max_visits: Any = None) -> None:
    @pikku.step(name="gf.seed")
    def seed(data: Any) -> int:
        ran.append("seed")
        return 0

    @pikku.step(name="gf.inc")
    def inc(data: dict[str, Any]) -> int:
        ran.append("inc")
        came = data["from"]
        return int(came["check"] if "check" in came else came["seed"]) + 1

    @pikku.step(name="gf.check")
    def check(data: dict[str, Any]) -> int:
        ran.append("check")
        return int(data["from"]["inc"])

    @pikku.step(name="gf.done")
    def done(data: dict[str, Any]) -> Any:
        ran.append("done")
        return {"count": data["from"]["check"]}

    pikku.graph("loop", nodes={"seed": seed, "inc": inc, "check": check, "done": done},
                edges=[("seed", "inc"), ("inc", "check"), ("check", "inc"),
                       ("check", "done")],
                branch={"check": lambda n: ["done"] if n >= rounds else ["inc"]},
                max_visits=max_visits)


def test_a_back_edge_runs_new_visits_each_its_own_step_until_the_branch_leaves(
        pikku: PikkuCelery) -> None:
    ran: list[str] = []
    _loop_graph(pikku, ran, rounds=3)
    run_id = pikku.start("loop", None, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "completed", run.error
    assert run.output == {"done": {"count": 3}}
    assert ran == ["seed", "inc", "check", "inc", "check", "inc", "check", "done"]
    names = {s.step_name for s in pikku.get_steps(run_id)}
    assert names == {"seed", "inc", "check", "inc#2", "check#2", "inc#3", "check#3", "done"}


def test_a_loop_past_max_visits_fails_the_run_clearly(pikku: PikkuCelery) -> None:
    ran: list[str] = []
    _loop_graph(pikku, ran, rounds=100, max_visits={"inc": 4})
    run_id = pikku.start("loop", None, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "failed" and run.error is not None
    assert "'inc' would run a 5th time, over its max_visits of 4" in run.error["message"]
    assert ran.count("inc") == 4 and "done" not in ran


def test_the_default_max_visits_is_ten(pikku: PikkuCelery) -> None:
    ran: list[str] = []
    _loop_graph(pikku, ran, rounds=100)
    run = pikku.get_run(pikku.start("loop", None, inline=True))
    assert run.status == "failed" and ran.count("inc") == 10


@pytest.mark.parametrize(("edges", "branch", "max_visits", "fragment"), [
    ([("a", "b"), ("b", "c"), ("c", "b")], {"a": lambda r: ["b"]}, None, "with no exit"),
    ([("a", "a")], None, None, "with no exit"),
    ([("a", "b"), ("b", "a")], {"a": lambda r: []}, {"a": 0}, "positive integer"),
    ([("a", "b"), ("b", "a")], {"a": lambda r: []}, {"zz": 3}, "positive integer"),
])
def test_bad_loops_are_refused_when_declared(pikku: PikkuCelery, edges: Any, branch: Any,
                                             max_visits: Any, fragment: str) -> None:
    step = pikku.step(name="gf.z")(lambda data: None)
    with pytest.raises(InvalidInputError, match=fragment):
        pikku.graph("bad", nodes={"a": step, "b": step, "c": step}, edges=edges,
                    branch=branch, max_visits=max_visits)


def test_instance_markers_are_refused_in_node_names(pikku: PikkuCelery) -> None:
    step = pikku.step(name="gf.w")(lambda data: None)
    with pytest.raises(InvalidInputError, match="may not contain"):
        pikku.graph("bad", nodes={"a#2": step}, edges=[])


def test_loop_visits_are_planned_the_same_way_across_passes(pikku: PikkuCelery) -> None:
    ran: list[str] = []
    _loop_graph(pikku, ran, rounds=2)
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    run_id = pikku.start("loop", None)
    pikku.engine.advance(run_id)

    def run(step: str, name: str) -> None:
        pikku.engine.execute_step(pikku.registry.steps[step], run_id, name)
        pikku.engine.advance(run_id)

    run("gf.seed", "seed")
    run("gf.inc", "inc")
    run("gf.check", "check")
    assert [s[2] for s in recorder.steps] == ["seed", "inc", "check", "inc#2"]
    run("gf.inc", "inc#2")
    run("gf.check", "check#2")
    assert [s[2] for s in recorder.steps][-1] == "done"
    run("gf.done", "done")
    run_state = pikku.get_run(run_id)
    assert run_state.status == "completed" and run_state.output == {"done": {"count": 2}}


def test_an_error_route_inside_a_loop_runs_again_for_each_failing_visit(
        pikku: PikkuCelery) -> None:
    """``attempt`` fails on every visit: its handler runs once per failing visit
    (``handle``, ``handle#2``, ...), each visit's error handed to its own handler visit."""
    @pikku.step(name="gf.attempt", retries=0)
    def attempt(data: dict[str, Any]) -> Any:
        raise ValueError(f"try {data['state'].get('tries', 0) + 1} failed")

    @pikku.step(name="gf.handle")
    def handle(data: dict[str, Any]) -> Any:
        tries = data["state"].get("tries", 0) + 1
        return with_state(data["error"]["message"], {"tries": tries})

    @pikku.step(name="gf.again")
    def again(data: dict[str, Any]) -> Any:
        return data["state"]["tries"]

    @pikku.step(name="gf.give_up")
    def give_up(data: dict[str, Any]) -> Any:
        return {"gave_up_after": data["from"]["again"]}

    @pikku.step(name="gf.begin")
    def begin(data: Any) -> None:
        return None

    nodes = {"begin": begin, "attempt": attempt, "handle": handle, "again": again,
             "give_up": give_up}
    with pytest.raises(InvalidInputError, match="no entry node"):
        pikku.graph("no-entry", nodes=nodes,
                    edges=[("attempt", "again"), ("handle", "again"), ("again", "attempt"),
                           ("again", "give_up"), ("again", "begin"), ("begin", "attempt")],
                    on_error={"attempt": "handle"}, branch={"again": lambda t: ["attempt"]})
    pikku.graph("retry-loop", nodes=nodes,
                edges=[("begin", "attempt"), ("attempt", "again"), ("handle", "again"),
                       ("again", "attempt"), ("again", "give_up")],
                on_error={"attempt": "handle"},
                branch={"again": lambda tries: ["give_up"] if tries >= 3 else ["attempt"]})
    run = pikku.get_run(pikku.start("retry-loop", None, inline=True))
    assert run.status == "completed", run.error
    assert run.output == {"give_up": {"gave_up_after": 3}}
    steps = {s.step_name: s for s in pikku.get_steps(run.run_id)}
    assert [steps[n].result for n in ("handle", "handle#2", "handle#3")] == [
        {"__pikku_state__": {"tries": n}, "result": f"try {n} failed"} for n in (1, 2, 3)]
    assert {"attempt", "attempt#2", "attempt#3"} <= set(steps)


def test_a_back_edge_from_a_node_without_a_branch_always_fires(pikku: PikkuCelery) -> None:
    """The README's ``poll`` graph: ``wait`` has no branch, so its back-edge to ``check``
    fires every time; ``check``'s branch is the way out."""
    ran: list[str] = []

    @pikku.step(name="gf.submit")
    def submit(data: Any) -> int:
        ran.append("submit")
        return 0

    @pikku.step(name="gf.poll_check")
    def check(data: Any) -> dict[str, bool]:
        ran.append("check")
        return {"ready": ran.count("check") >= 3}

    @pikku.step(name="gf.wait")
    def wait(data: Any) -> None:
        ran.append("wait")

    @pikku.step(name="gf.poll_done")
    def done(data: Any) -> str:
        ran.append("done")
        return "ok"

    pikku.graph("poll", nodes={"submit": submit, "check": check, "wait": wait, "done": done},
                edges=[("submit", "check"), ("check", "wait"), ("wait", "check"),
                       ("check", "done")],
                branch={"check": lambda r: ["done"] if r["ready"] else ["wait"]},
                max_visits={"check": 20})
    run = pikku.get_run(pikku.start("poll", None, inline=True))
    assert run.status == "completed", run.error
    assert ran == ["submit", "check", "wait", "check", "wait", "check", "done"]
    assert run.output == {"done": "ok"}
    assert {s.step_name for s in pikku.get_steps(run.run_id)} == {
        "submit", "check", "wait", "check#2", "wait#2", "check#3", "done"}


def _stepper(pikku: PikkuCelery, graph: str) -> tuple[Recorder, Any]:
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    run_id = pikku.start(graph, None)
    pikku.engine.advance(run_id)

    def run(step: str, name: str) -> list[str]:
        pikku.engine.execute_step(pikku.registry.steps[step], run_id, name)
        pikku.engine.advance(run_id)
        return [s[2] for s in recorder.steps]
    return recorder, run


def test_parallel_back_edges_fire_one_new_visit_once_both_sources_settled(
        pikku: PikkuCelery) -> None:
    """T fans out to A1 and A2, each able to loop back to T. A2 finishes (and fires) first:
    nothing new starts while A1 runs (the round is not over); once A1 has fired too, one
    new visit T#2 starts with both sources' results, and then A1#2 and A2#2 (issue 21)."""
    s = pikku.step(name="gf.s")(lambda data: 0)
    t = pikku.step(name="gf.t")(lambda data: sorted(data["from"]))
    a = pikku.step(name="gf.a")(lambda data: {"again": True})
    pikku.graph("two", nodes={"S": s, "T": t, "A1": a, "A2": a, "E1": s, "E2": s},
                edges=[("S", "T"), ("T", "A1"), ("T", "A2"), ("A1", "T"), ("A2", "T"),
                       ("A1", "E1"), ("A2", "E2")],
                branch={"A1": lambda r: ["T"] if r["again"] else ["E1"],
                        "A2": lambda r: ["T"] if r["again"] else ["E2"]})
    _, run = _stepper(pikku, "two")
    run("gf.s", "S")
    assert run("gf.t", "T") == ["S", "T", "A1", "A2"]
    assert run("gf.a", "A2") == ["S", "T", "A1", "A2"]  # A1 still runs: no new visit yet
    assert run("gf.a", "A1")[-1] == "T#2"
    run_id = pikku.list_runs(limit=1)[0].run_id
    assert set(pikku.get_steps(run_id)[-1].data["from"]) == {"S", "A1", "A2"}
    assert run("gf.t", "T#2")[-2:] == ["A1#2", "A2#2"]


@pytest.mark.parametrize("first", ["A", "B"])
def test_a_node_beside_a_loop_ends_its_visit_before_the_next_starts(
        pikku: PikkuCelery, first: str) -> None:
    """A loops back to T while B (beside it, of T's first visit) may still run. B's
    successor C is not after A, so it runs in that visit whether B finishes before or
    after A; T#2 starts only once C has settled, and the second visit runs B#2, M#2 and,
    after B#2, C#2 (before issue 21, C ran only when B happened to finish first)."""
    n = pikku.step(name="gf.n")(lambda data: 1)
    pikku.graph("stale", nodes={k: n for k in ("S", "T", "B", "M", "C", "A", "E")},
                edges=[("S", "T"), ("T", "B"), ("T", "M"), ("B", "C"), ("M", "A"),
                       ("A", "T"), ("A", "E")],
                branch={"A": lambda r: ["T"]}, max_visits={"T": 3})
    _, run = _stepper(pikku, "stale")
    for name in ("S", "T", "M"):
        run("gf.n", name)
    run("gf.n", first)
    sent = run("gf.n", "B" if first == "A" else "A")
    assert sent[-1] == "C"
    assert run("gf.n", "C")[-1] == "T#2"
    assert run("gf.n", "T#2")[-2:] == ["B#2", "M#2"]
    assert run("gf.n", "B#2")[-1] == "C#2"


@pytest.mark.parametrize("chosen", ["done", None, [1]])
def test_a_branch_that_returns_no_list_of_names_fails_the_run_clearly(
        pikku: PikkuCelery, chosen: Any) -> None:
    step = pikku.step(name="gf.v")(lambda data: 1)
    pikku.graph("badbranch", nodes={"a": step, "done": step}, edges=[("a", "done")],
                branch={"a": lambda r: chosen})
    run = pikku.get_run(pikku.start("badbranch", None, inline=True))
    assert run.status == "failed" and run.error is not None
    assert "branch of 'a' must return a list of node names" in run.error["message"]


def test_a_for_each_node_a_loop_starts_without_its_list_fails_the_run_clearly(
        pikku: PikkuCelery) -> None:
    one = pikku.step(name="gf.one")(lambda data: 1)
    pikku.graph("fe", nodes={"S": one, "P": pikku.step(name="gf.lst")(lambda d: [1, 2]),
                             "F": one, "X": one},
                edges=[("S", "P"), ("P", "F"), ("F", "X"), ("S", "X"), ("X", "F")],
                branch={"S": lambda r: ["X"], "X": lambda r: ["F"]},
                for_each={"F": "P"})
    run = pikku.get_run(pikku.start("fe", None, inline=True))
    assert run.status == "failed" and run.error is not None
    assert run.error["type"] == "InvalidInputError"
    assert "'P', whose list it runs over, did not run" in run.error["message"]
