"""Graph loops are rounds (issue 21, defect 4): when a back-edge fires, the next visit of
the loop starts once everything of the current one has settled, and every node after the
back-edge's target runs again in it; what a run records depends on the step results only,
never on the order in which steps finished or nodes were declared."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import PikkuCelery
from pikku_celery.store.base import NewStep
from tests.property.driver import Driver, stream


@pytest.fixture
def pikku() -> Iterator[PikkuCelery]:
    app = Celery("graph-loops", broker="memory://")
    yield PikkuCelery(app, worker_reaper=False)


def _recorded(driver: Driver, run_id: str) -> dict[str, Any]:
    return {s.step_name: (s.status, s.result) for s in driver.engine.get_steps(run_id)}


def _run_orders(pikku: PikkuCelery, graph: str, seeds: range, *, duplicates: int = 0
                ) -> list[tuple[Any, dict[str, Any]]]:
    """The graph run once per seed, its messages delivered in that seed's random order;
    for each, the run's (status, output) and its recorded steps."""
    seen = []
    driver = Driver(pikku, duplicates=10**6)
    try:
        for seed in seeds:
            driver.duplicates = duplicates
            rng = random.Random(seed)
            run_id = driver.run(graph, None, lambda n, rng=rng: rng.randrange(n))  # type: ignore[misc]
            run = driver.engine.get_run(run_id)
            seen.append(((run.status, run.output, run.error), _recorded(driver, run_id)))
    finally:
        driver.close()
    return seen


def _parallel_loop(pikku: PikkuCelery, *, order: tuple[str, ...]) -> None:
    """go -> s -> {a, b} -> end, back-edge a -> s: a loops until s's count reaches 3."""
    @pikku.step(name="gl.go")
    def go(data: Any) -> int:
        return 0

    @pikku.step(name="gl.s")
    def s(data: dict[str, Any]) -> int:
        return int(data["from"].get("a", 0)) + 1  # its visit: a brings the last count

    @pikku.step(name="gl.a")
    def a(data: dict[str, Any]) -> int:
        return int(data["from"]["s"])

    @pikku.step(name="gl.b")
    def b(data: dict[str, Any]) -> dict[str, int]:
        return {"b_of": data["from"]["s"]}

    @pikku.step(name="gl.end")
    def end(data: dict[str, Any]) -> Any:
        return data["from"]

    steps = {"go": go, "s": s, "a": a, "b": b, "end": end}
    pikku.graph("parallel-loop", nodes={n: steps[n] for n in order},
                edges=[("go", "s"), ("s", "a"), ("s", "b"), ("a", "end"), ("b", "end"),
                       ("a", "s")],
                branch={"a": lambda count: ["end"] if count >= 3 else ["s"]})


@pytest.mark.parametrize("order", [("go", "s", "a", "b", "end"), ("go", "s", "b", "a", "end"),
                                   ("end", "b", "a", "s", "go")])
def test_a_node_beside_the_back_edges_source_runs_again_in_every_visit(
        pikku: PikkuCelery, order: tuple[str, ...]) -> None:
    """``b`` runs beside ``a``, whose back-edge restarts ``s``: every visit of ``s`` runs
    ``b`` again, and ``end`` joins ``a`` and ``b`` of the same (third) visit, whatever order
    the nodes were declared in and the steps finished in. (Before: ``b`` ran once and
    ``end`` paired ``a#3`` with ``b``'s first visit.)"""
    _parallel_loop(pikku, order=order)
    expected_steps = {"go": ("succeeded", 0), "s": ("succeeded", 1), "a": ("succeeded", 1),
                      "b": ("succeeded", {"b_of": 1}), "s#2": ("succeeded", 2),
                      "a#2": ("succeeded", 2), "b#2": ("succeeded", {"b_of": 2}),
                      "s#3": ("succeeded", 3), "a#3": ("succeeded", 3),
                      "b#3": ("succeeded", {"b_of": 3}),
                      "end": ("succeeded", {"a": 3, "b": {"b_of": 3}})}
    for outcome, steps in _run_orders(pikku, "parallel-loop", range(12), duplicates=2):
        assert outcome == ("completed", {"end": {"a": 3, "b": {"b_of": 3}}}, None)
        assert steps == expected_steps


def _two_back_edges(pikku: PikkuCelery) -> None:
    """S -> T -> {A1, A2}; A1 -> T and A2 -> T are back-edges; A1 loops while T's count is
    under 3, A2 while it is under 2; each leaves to its own end node."""
    @pikku.step(name="gl.start")
    def start(data: Any) -> int:
        return 0

    @pikku.step(name="gl.t")
    def t(data: dict[str, Any]) -> int:
        return max(int(v) for v in data["from"].values()) + 1

    @pikku.step(name="gl.pass_on")
    def pass_on(data: dict[str, Any]) -> int:
        return int(data["from"]["T"])

    @pikku.step(name="gl.finish")
    def finish(data: dict[str, Any]) -> Any:
        return data["from"]

    pikku.graph("two-back-edges",
                nodes={"S": start, "T": t, "A1": pass_on, "A2": pass_on, "E1": finish,
                       "E2": finish},
                edges=[("S", "T"), ("T", "A1"), ("T", "A2"), ("A1", "T"), ("A2", "T"),
                       ("A1", "E1"), ("A2", "E2")],
                branch={"A1": lambda n: ["T"] if n < 3 else ["E1"],
                        "A2": lambda n: ["T"] if n < 2 else ["E2"]})


def test_two_back_edges_into_one_node_loop_the_same_way_in_every_delivery_order(
        pikku: PikkuCelery) -> None:
    """Both back-edges fire in T's first visit: one new visit (its ``from`` names both
    sources), not two and not one chosen by who finished first. In the second visit only A1
    loops; A2's exit E2 is not after A1, so it runs in that visit, and again in the third.
    Before: four different sets of steps over 40 delivery orders."""
    expected = {"S": 0, "T": 1, "A1": 1, "A2": 1, "T#2": 2, "A1#2": 2, "A2#2": 2,
                "E2": {"A2": 2}, "T#3": 3, "A1#3": 3, "A2#3": 3, "E1": {"A1": 3},
                "E2#2": {"A2": 3}}
    _two_back_edges(pikku)
    outcomes = _run_orders(pikku, "two-back-edges", range(40), duplicates=3)
    for outcome, steps in outcomes:
        assert outcome == ("completed", {"E1": {"A1": 3}, "E2": {"A2": 3}}, None)
        assert steps == {name: ("succeeded", result) for name, result in expected.items()}


def test_the_next_visit_waits_for_the_current_one_and_its_data_names_every_source(
        pikku: PikkuCelery) -> None:
    """Stepped by hand: A2 finishes (and fires) first; nothing new is sent until A1 has
    finished too, and T#2 then receives both sources' results."""
    _two_back_edges(pikku)
    driver = Driver(pikku)
    try:
        order = iter(["run:", "S", "T", "A2", "A1"])
        sent: list[list[str]] = []

        def choose(count: int) -> int:
            pool = driver.dispatcher.pool
            if count != len(pool):
                return 0  # what befalls a step message: a plain delivery
            want = next(order, None)
            names = [m.step_name if m.kind == "step" else f"{m.kind}:" for m in pool]
            sent.append(names)
            return names.index(want) if want in names else 0

        run_id = driver.run("two-back-edges", None, choose)
    finally:
        driver.close()
    assert sent[3] == ["A1", "A2"]
    assert sent[4] == ["A1"]  # A2 fired, A1 still runs: nothing new (before: T#2 here)
    assert sent[5] == ["T#2"]  # A1 fired too: one new visit
    t2 = driver.engine.store.get_step(run_id, "T#2")
    assert t2 is not None and t2.data["from"] == {"S": 0, "A1": 1, "A2": 1}
    assert driver.engine.get_run(run_id).status == "completed"


def test_a_run_recorded_under_the_first_firing_rule_still_replays_to_its_end(
        pikku: PikkuCelery) -> None:
    """A run recorded before loops were rounds: A2 finished first and the pass of the
    time started T#2 at once, from S and A2 alone, while A1 still ran. The recorded step
    is replayed as it is (recorded data is never rewritten): the run waits for A1, takes
    T#2 as the next visit and ends as the rounds end it."""
    _two_back_edges(pikku)
    driver = Driver(pikku)
    try:
        deliveries = iter(["run:", "S", "T", "A2"])

        def choose(count: int) -> int:
            names = [m.step_name if m.kind == "step" else f"{m.kind}:"
                     for m in driver.dispatcher.pool]
            if count != len(names):
                return 0  # what befalls a step message: a plain delivery
            want = next(deliveries, None)
            if want is None:
                raise _Stop
            return names.index(want)

        with pytest.raises(_Stop):
            driver.run("two-back-edges", None, choose)
        run_id = driver.engine.store.list_runs(limit=1)[0].run_id
        assert driver.engine.store.get_step(run_id, "T#2") is None  # A1 still runs
        driver.engine.store.insert_step(NewStep(  # what the earlier pass recorded
            run_id=run_id, step_name="T#2", function="gl.t",
            data={"input": None, "from": {"S": 0, "A2": 1}, "state": {}}, retry_delay_ms=-1),
            driver.engine.now_ms())
        driver.dispatcher.dispatch_step("gl.t", run_id, "T#2")
        driver.deliver_all(stream([1, 0, 0, 1]))
    finally:
        driver.close()
    run = driver.engine.get_run(run_id)
    assert (run.status, run.output) == ("completed", {"E1": {"A1": 3}, "E2": {"A2": 3}})
    assert {s.step_name for s in driver.engine.get_steps(run_id)} == {
        "S", "T", "A1", "A2", "T#2", "A1#2", "A2#2", "E2", "T#3", "A1#3", "A2#3", "E1",
        "E2#2"}


class _Stop(Exception):
    """Ends a driver's delivery loop where the test takes over."""


@pytest.mark.parametrize("declared", [("r1", "r2", "x", "y"), ("y", "x", "r2", "r1")])
def test_a_cycle_with_two_ways_in_loops_the_same_whatever_the_declaration_order(
        pikku: PikkuCelery, declared: tuple[str, ...]) -> None:
    """r1 enters the cycle x <-> y at x, r2 at y: which of its edges closes the loop (the
    back-edge) is chosen by node name, not by the order the graph was written in: y -> x
    here, so every declaration runs x, y, x#2, y#2 and leaves from y#2."""
    @pikku.step(name="gl.entry")
    def entry(data: Any) -> int:
        return 0

    @pikku.step(name="gl.hop")
    def hop(data: dict[str, Any]) -> int:
        return max(int(v) for v in data["from"].values()) + 1

    @pikku.step(name="gl.out")
    def out(data: dict[str, Any]) -> Any:
        return data["from"]

    nodes = {"r1": entry, "r2": entry, "x": hop, "y": hop, "out": out}
    edges = [("r1", "x"), ("r2", "y"), ("x", "y"), ("y", "x"), ("y", "out")]
    order = {name: i for i, name in enumerate(declared)}
    pikku.graph("two-ways-in", nodes=dict(sorted(nodes.items(),
                                                 key=lambda kv: order.get(kv[0], 9))),
                edges=sorted(edges, key=lambda e: (order.get(e[0], 9), order.get(e[1], 9))),
                branch={"x": lambda n: ["y"], "y": lambda n: ["out"] if n >= 4 else ["x"]})
    outcomes = _run_orders(pikku, "two-ways-in", range(3))
    for outcome, steps in outcomes:
        assert outcome == ("completed", {"out": {"y": 4}}, None)
        assert {n: r for n, (_, r) in steps.items()} == {
            "r1": 0, "r2": 0, "x": 1, "y": 2, "x#2": 3, "y#2": 4, "out": {"y": 4}}


def _counting(pikku: PikkuCelery, prefix: str) -> Any:
    """A step returning one more than the largest result it receives (0 with none)."""
    return pikku.step(name=f"{prefix}.count")(
        lambda data: max([int(v) for v in data["from"].values()] or [-1]) + 1)


def test_an_outer_loop_firing_with_an_inner_one_restarts_the_inner_loop_afresh(
        pikku: PikkuCelery) -> None:
    """t1 -> t2 -> {x, y}; x -> t2 closes the inner loop, y -> t1 the outer one. Both fire
    in the first round: the outer one wins, t1#2 starts from y, and t2#2 starts from t1#2
    alone, as a first visit of the inner loop would (x's firing is not carried over)."""
    count = _counting(pikku, "gl.nested")
    pikku.graph("nested", nodes={n: count for n in ("S", "t1", "t2", "x", "y", "ex", "ey")},
                edges=[("S", "t1"), ("t1", "t2"), ("t2", "x"), ("t2", "y"), ("x", "t2"),
                       ("y", "t1"), ("x", "ex"), ("y", "ey")],
                branch={"x": lambda n: ["t2"] if n < 5 else ["ex"],
                        "y": lambda n: ["t1"] if n < 4 else ["ey"]})
    driver = Driver(pikku)
    try:
        for choose in (stream([]), lambda n: n - 1):
            run_id = driver.run("nested", None, choose)
            steps = {s.step_name: s for s in driver.engine.get_steps(run_id)}
            assert {n: s.result for n, s in steps.items()} == {
                "S": 0, "t1": 1, "t2": 2, "x": 3, "y": 3, "t1#2": 4, "t2#2": 5, "x#2": 6,
                "y#2": 6, "ex": 7, "ey": 7}
            assert steps["t1#2"].data["from"] == {"S": 0, "y": 3}
            assert steps["t2#2"].data["from"] == {"t1": 4}
    finally:
        driver.close()


def test_two_failures_in_one_round_fail_the_run_with_the_first_by_name(
        pikku: PikkuCelery) -> None:
    """b and a fail in the same round (b declared first, and failing first): the run's
    error names a, the first in graph order, whose ties go by name."""
    @pikku.step(name="gl.fail", retries=0)
    def fail(data: Any) -> None:
        raise ValueError("no")

    ok = _counting(pikku, "gl.two_failures")
    pikku.graph("two-failures", nodes={"S": ok, "b": fail, "a": fail},
                edges=[("S", "b"), ("S", "a")])
    driver = Driver(pikku)
    try:
        for choose in (stream([]), lambda n: n - 1):
            run = driver.engine.get_run(driver.run("two-failures", None, choose))
            assert run.status == "failed" and run.error is not None
            assert run.error["message"] == "step 'a' failed: ValueError: no"
    finally:
        driver.close()


def test_a_visit_over_max_visits_fails_the_run_only_once_the_round_has_settled(
        pikku: PikkuCelery) -> None:
    """In T's second visit, D (max_visits 1, after A) is refused while P#2 may still run:
    the run fails once P#2 has settled, so P#2 is recorded as it ended, in every order
    (failing at once left P#2 fenced when A#2 finished first, succeeded otherwise)."""
    count = _counting(pikku, "gl.refused")
    pikku.graph("refused", nodes={n: count for n in ("S", "T", "A", "P", "D", "E")},
                edges=[("S", "T"), ("T", "A"), ("T", "P"), ("A", "D"), ("P", "T"),
                       ("P", "E")],
                branch={"P": lambda n: ["T"] if n < 3 else ["E"]}, max_visits={"D": 1})
    driver = Driver(pikku)
    try:
        for choose in (stream([]), lambda n: n - 1):
            run_id = driver.run("refused", None, choose)
            run = driver.engine.get_run(run_id)
            assert run.status == "failed" and run.error is not None
            assert "'D' would run a 2th time, over its max_visits of 1" in run.error["message"]
            assert _recorded(driver, run_id) == {
                "S": ("succeeded", 0), "T": ("succeeded", 1), "A": ("succeeded", 2),
                "P": ("succeeded", 2), "D": ("succeeded", 3), "T#2": ("succeeded", 3),
                "A#2": ("succeeded", 4), "P#2": ("succeeded", 4), "E": ("succeeded", 5)}
    finally:
        driver.close()


def test_the_error_route_of_a_node_after_a_firing_back_edge_waits_for_the_next_visit(
        pikku: PikkuCelery) -> None:
    """N comes after A, whose back-edge fires in the first visit, so N is left to the
    next; so are its error handler H and what follows H: J (after H and K) runs once, in
    the visit where N runs, not also in the first from K alone."""
    count = _counting(pikku, "gl.routed")
    pikku.graph("routed", nodes={n: count for n in ("S", "T", "A", "K", "N", "X", "H", "J")},
                edges=[("S", "T"), ("T", "A"), ("T", "K"), ("A", "T"), ("A", "N"),
                       ("N", "X"), ("H", "J"), ("K", "J")],
                branch={"A": lambda n: ["T"] if n < 3 else ["N"]}, on_error={"N": "H"})
    driver = Driver(pikku)
    try:
        for choose in (stream([]), lambda n: n - 1):
            run_id = driver.run("routed", None, choose)
            assert {n: r for n, (_, r) in _recorded(driver, run_id).items()} == {
                "S": 0, "T": 1, "A": 2, "K": 2, "T#2": 3, "A#2": 4, "K#2": 4, "N": 5, "X": 6,
                "J": 5}
    finally:
        driver.close()
