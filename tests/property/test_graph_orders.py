"""Property: a graph run records the same steps and ends the same way in every delivery order.

Hypothesis draws a graph (branches, joins, loops with ``max_visits``, ``for_each`` fan-outs,
parallel or sequential, error routes, nodes that fail once or for good, run state writes)
and orders of delivery (which message lands next, duplicates, workers that die mid-body and
come back through the reaper); each run is driven message by message by
``tests.property.driver``, and must record exactly what the first-in, first-out run
recorded: the same steps, each with the same status, data (less the run state it saw,
which is documented to follow completion order), result and error, and the same run status,
output, error and state. Step bodies and branches are pure functions of their data, so any
difference is the engine's.

Profiles: ``ci`` by default (seeded, bounded: ``./dev test tests/property``), ``long`` with
``PIKKU_HYPOTHESIS_PROFILE=long ./dev test tests/property`` (many more examples, a new seed
each run; a failure prints the blob that reproduces it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery, signals
from hypothesis import HealthCheck, event, given, note, reject, settings
from hypothesis import strategies as st

from pikku_celery import InvalidInputError, PikkuCelery, with_state
from tests.property.driver import Choose, Driver, stream

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("pikku-graphs-ci", max_examples=300, derandomize=True,
                          deadline=None, database=None, print_blob=True,
                          suppress_health_check=_SLOW_OK)
settings.register_profile("pikku-graphs-long", max_examples=1500, deadline=None,
                          database=None, print_blob=True, suppress_health_check=_SLOW_OK)
PROFILE = settings.get_profile(
    f"pikku-graphs-{os.environ.get('PIKKU_HYPOTHESIS_PROFILE', 'ci')}")


@dataclass(frozen=True)
class GraphSpec:
    """A drawn graph: nodes ``n0``.. in a topological order of the forward edges, handlers
    ``h0``.., and how each node behaves."""

    nodes: tuple[str, ...]
    edges: tuple[tuple[str, str], ...]
    branching: tuple[str, ...]  # nodes with a branch function
    max_visits: tuple[tuple[str, int], ...]
    for_each: tuple[tuple[str, str, bool], ...]  # node, over, sequential
    listers: tuple[str, ...]  # nodes whose result is a list
    on_error: tuple[tuple[str, str], ...]
    fails: tuple[tuple[str, str], ...] = ()  # node -> "once" | "sometimes"
    writes: tuple[str, ...] = ()  # nodes that write the run state (their own key)
    handlers: tuple[str, ...] = field(default=())


def _digest(*parts: Any) -> int:
    text = json.dumps(parts, sort_keys=True, default=str)
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)


@st.composite
def graph_specs(draw: st.DrawFn) -> GraphSpec:
    count = draw(st.integers(3, 8))
    nodes = [f"n{i}" for i in range(count)]
    edges: set[tuple[str, str]] = set()
    for j in range(1, count):  # every node but n0 has a forward predecessor: n0 is the entry
        for i in draw(st.sets(st.integers(max(0, j - 3), j - 1), min_size=1, max_size=2)):
            edges.add((nodes[i], nodes[j]))
    backs = draw(st.lists(st.tuples(st.integers(1, count - 1), st.integers(1, count - 1)),
                          min_size=1, max_size=3))
    branching = set(draw(st.sets(st.sampled_from(nodes), max_size=2)))
    for a, b in backs:
        source, target = nodes[max(a, b)], nodes[min(a, b)]
        edges.add((source, target))  # to an earlier node (or itself): a loop
        branching.add(source)  # every cycle needs a way out
    listers = draw(st.sets(st.sampled_from(nodes), min_size=1, max_size=2))
    for_each = []
    for node in nodes:
        over = [a for a, b in edges if b == node and a in listers and a != node
                and nodes.index(a) < nodes.index(node)]
        if over and draw(st.sampled_from([True, True, False])):
            for_each.append((node, draw(st.sampled_from(sorted(over))), draw(st.booleans())))
    behaviour = st.sampled_from(["ok", "ok", "ok", "once", "sometimes"])
    fails = {n: b for n in nodes if (b := draw(behaviour)) != "ok"}
    handlers, on_error = [], []
    routed = st.sampled_from([True, True, True, False])
    for node in sorted(n for n in fails if fails[n] == "sometimes" and draw(routed)):
        handler = f"h{len(handlers)}"
        handlers.append(handler)
        on_error.append((node, handler))
        later = nodes[nodes.index(node) + 1:]
        for target in draw(st.sets(st.sampled_from(later), max_size=2)) if later else ():
            edges.add((handler, target))
    targets = {nodes[min(a, b)] for a, b in backs}
    # A loop's target may visit 2-4 times; a node after it as few as once, so a visit can be
    # refused in the middle of a round, beside steps still in flight.
    visits = {node: draw(st.integers(2 if node in targets else 1, 4)) for node in nodes}
    fe = {n for n, _, _ in for_each}
    writes = draw(st.sets(st.sampled_from(nodes), max_size=2)) - fe
    return GraphSpec(tuple(nodes), tuple(sorted(edges)), tuple(sorted(branching)),
                     tuple(sorted(visits.items())), tuple(for_each), tuple(sorted(listers)),
                     tuple(on_error), tuple(sorted(fails.items())), tuple(sorted(writes)),
                     tuple(handlers))


def declare(pikku: PikkuCelery, spec: GraphSpec, driver_of: Callable[[], Driver],
            shuffle: random.Random | None = None) -> None:
    """Register the spec's steps and graph on ``pikku`` (its nodes and edges declared in an
    order ``shuffle`` picks, if given). Each body is a pure function of its data (the run
    state it saw left out): a digest of it, a list for a lister; a node that fails ``once``
    fails its first attempt, one that fails ``sometimes`` fails every attempt when its
    digest says so. The first attempt of any step may be killed by the driver."""
    fails = dict(spec.fails)
    steps = {}
    names, edges = [*spec.nodes, *spec.handlers], list(spec.edges)
    if shuffle is not None:
        shuffle.shuffle(names)
        shuffle.shuffle(edges)
    for node in names:
        steps[node] = pikku.step(name=f"pg.{node}", bind=True, retries=1, retry_delay=0)(
            _body(node, fails.get(node), node in spec.listers, node in spec.writes,
                  driver_of))
    outs: dict[str, list[str]] = {}
    for a, b in spec.edges:
        outs.setdefault(a, []).append(b)
    pikku.graph("drawn", nodes=steps, edges=edges,
                branch={n: _branch(n, sorted(outs.get(n, []))) for n in spec.branching},
                on_error=dict(spec.on_error),
                for_each={n: {"over": over, "sequential": seq} for n, over, seq in spec.for_each},
                max_visits=dict(spec.max_visits))


def _body(node: str, fails: str | None, lister: bool, writes: bool,
          driver_of: Callable[[], Driver]) -> Callable[[Any, Any], Any]:
    def body(ctx: Any, data: dict[str, Any]) -> Any:
        driver_of().die_if_told(ctx.attempt == 1)
        seen = {k: v for k, v in data.items() if k != "state"}
        digest = _digest(node, seen)
        if fails == "once" and ctx.attempt == 1:
            raise RuntimeError(f"{node}: first attempt fails")
        if fails == "sometimes" and digest % 2 == 0:
            raise ValueError(f"{node} fails for {digest % 1000}")
        result: Any = ([digest % (k + 7) for k in range(digest % 4)] if lister
                       else {"node": node, "d": digest % 1000})
        return with_state(result, {node: digest % 1000}) if writes else result
    return body


def _branch(node: str, outs: list[str]) -> Callable[[Any], list[str]]:
    """Each edge out is taken by the digest of the result: a forward one three times in
    four, a loop's (to an earlier node or itself) one time in two."""
    def choose(result: Any) -> list[str]:
        return [b for b in outs
                if _digest(node, b, result) % (2 if int(b[1:]) <= int(node[1:]) else 4) != 0]
    return choose


def record(driver: Driver, run_id: str) -> dict[str, Any]:
    """What must not depend on the order: the run's end and every step's (a message naming
    the run has its id replaced: each order is a run of its own)."""
    run = driver.engine.get_run(run_id)

    def error_of(error: dict[str, Any] | None) -> Any:
        if error is None:
            return None
        return error.get("type"), str(error.get("message")).replace(run_id, "<run>")

    steps = {s.step_name: (s.status, s.result, error_of(s.error),
                           {k: v for k, v in s.data.items() if k != "state"})
             for s in driver.engine.get_steps(run_id)}
    return {"run": (run.status, run.output, error_of(run.error), run.state), "steps": steps}


@dataclass
class _Bench:
    """One app per drawn graph, with a driver per run."""

    spec: GraphSpec
    shuffle: random.Random | None = None
    driver: Driver | None = None

    def __post_init__(self) -> None:
        self.pikku = PikkuCelery(Celery("property-graphs", broker="memory://"),
                                 worker_reaper=False)
        try:
            declare(self.pikku, self.spec, self.current, self.shuffle)
        except InvalidInputError as exc:  # e.g. a for_each over an edge that closes a loop
            note(f"refused when declared: {exc}")
            self.close()
            reject()

    def current(self) -> Driver:
        assert self.driver is not None
        return self.driver

    def close(self) -> None:
        """Let the app go: a ``PikkuCelery`` connects its worker hooks to Celery's signals
        with strong references, so each example's app (its steps, driver and store with it)
        would otherwise live to the end of the session (about 0.5 MB an example)."""
        routing = self.pikku.routing
        signals.celeryd_init.disconnect(routing._on_celeryd_init)
        signals.worker_init.disconnect(routing._on_worker_init)
        signals.worker_ready.disconnect(routing._on_worker_ready)

    def run(self, choose: Choose, duplicates: int, crashes: int) -> dict[str, Any]:
        self.driver = Driver(self.pikku, duplicates=duplicates, crashes=crashes)
        try:
            run_id = self.driver.run("drawn", {"seed": 1}, choose)
            recorded = record(self.driver, run_id)
        finally:
            self.driver.close()
        assert recorded["run"][0] in ("completed", "failed"), (recorded, self.driver.delivered)
        unsettled = {n: s[0] for n, s in recorded["steps"].items()
                     if s[0] not in ("succeeded", "failed")}
        assert not unsettled, (unsettled, self.driver.delivered)
        return recorded


@contextlib.contextmanager
def _bench(spec: GraphSpec, shuffle: random.Random | None = None) -> Iterator[_Bench]:
    bench = _Bench(spec, shuffle)
    try:
        yield bench
    finally:
        bench.close()


orders = st.tuples(st.randoms(use_true_random=False), st.integers(0, 4), st.integers(0, 2))


@pytest.mark.timeout(900)  # a failure is shrunk, which can take minutes: let it finish
@settings(PROFILE)
@given(spec=graph_specs(), tried=st.lists(orders, min_size=1, max_size=2),
       shuffle=st.randoms(use_true_random=False))
def test_a_graph_run_records_the_same_in_every_delivery_order(
        spec: GraphSpec, tried: list[tuple[random.Random, int, int]],
        shuffle: random.Random) -> None:
    """The first-in, first-out run of the graph as drawn is the reference; the same graph
    declared in another order (nodes and edges shuffled) and every drawn delivery order must
    record exactly what it did."""
    with _bench(spec) as bench:
        expected = bench.run(stream([]), 0, 0)
        note(f"first-in, first-out: {expected['run']}")
        _events(expected)
        with _bench(spec, shuffle) as other:
            assert other.run(stream([]), 0, 0) == expected, "declared in another order"
        for rnd, duplicates, crashes in tried:
            got = bench.run(rnd.randrange, duplicates, crashes)
            deaths = sum(d.startswith("died:") for d in bench.current().delivered)
            event(f"worker deaths: {deaths}")
            assert got["run"] == expected["run"]
            assert got["steps"] == expected["steps"]


def _events(recorded: dict[str, Any]) -> None:
    """What the drawn cases exercised (``--hypothesis-show-statistics`` counts them)."""
    names = recorded["steps"]
    event(f"run {recorded['run'][0]}")
    visits = [int(n.split("#")[1].split("[")[0]) for n in names if "#" in n]
    event(f"loop visits: {max(visits or [1])}")
    event("for_each ran" if any("[" in n for n in names) else "no for_each item")
    event("error route ran" if any(n.startswith("h") for n in names) else "no error route")
    event("a step failed for good" if any(s[0] == "failed" for s in names.values())
          else "no step failed")


# Shrunk failing cases, kept as examples (each failed on the pass before issue 21's rounds).
SHRUNK = {
    # A loop n1 -> n3 -> n1 around a self-loop n2 -> n2, n3 routed to h0 on failure: the old
    # pass failed the run at once when one loop's visit went over max_visits while the other
    # loop's steps were in flight, so the run completed first-in, first-out and failed in
    # other orders. In rounds: n2 and n3 both loop in the first round, n1's loop (the outer
    # one) restarts n2's; in the second, n3#2 fails to h0 and n2#2 loops again, over its
    # max_visits of 2: the run fails, in every order.
    "max_visits_beside_a_second_loop": GraphSpec(
        nodes=("n0", "n1", "n2", "n3", "n4", "n5"),
        edges=(("h0", "n4"), ("n0", "n1"), ("n0", "n2"), ("n1", "n2"), ("n1", "n3"),
               ("n1", "n4"), ("n2", "n2"), ("n2", "n5"), ("n3", "n1")),
        branching=("n2", "n3"), max_visits=tuple((f"n{i}", 2) for i in range(6)),
        for_each=(), listers=(), on_error=(("n3", "h0"),), fails=(("n3", "sometimes"),),
        handlers=("h0",)),
}


@pytest.mark.parametrize("name", sorted(SHRUNK))
def test_a_shrunk_case_records_the_same_in_every_delivery_order(name: str) -> None:
    with _bench(SHRUNK[name]) as bench:
        expected = bench.run(stream([]), 0, 0)
        orders = [bench.run(random.Random(seed).randrange, 2, 1) for seed in range(30)]
    assert expected["run"][:3] == ("failed", None, (
        "WorkflowRunFailedError", "graph 'drawn': node 'n2' would run a 3th time, over its "
        "max_visits of 2 (a loop that does not end?)"))
    assert set(expected["steps"]) == {"n0", "n1", "n2", "n3", "n4", "n1#2", "n2#2", "n3#2",
                                      "h0", "n4#2"}
    for seed, got in enumerate(orders):
        assert got == expected, f"order {seed}"
