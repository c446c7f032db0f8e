"""Graph workflows: a declared graph of steps, planned by replay under the run lease.

Every pass starts each node whose predecessors have all settled (a join fires once, when the
last of them is done), records results, and pauses while any node is in flight. A node's
data is ``{"input": <run input>, "from": {<predecessor>: <its result>}, "state": <run
state>}``; a node writes the run state by returning ``with_state(result, {...})``. An optional
``branch`` function per node picks which of its successors run, from its result; a node no
predecessor picked is skipped, and so is everything only it would have started. The run's
output maps each sink node that ran to its result. A node whose worker died is dispatched
again once its lease lapses, exactly as any step (replay and the reaper do it). Error
routes, per-item fan-out and loops (back-edges, each visit its own step ``node#N``) are
described in docs/guide/workflows.md ("Graph workflows"). This module declares and checks a
graph; the pass that plays it, round by round, is ``pikku_celery.workflow._graph_rounds``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.validate import check_name

DEFAULT_MAX_VISITS = 10  # how many times one node may run in a loop before the run fails

__all__ = ["DEFAULT_MAX_VISITS", "Graph", "build_graph"]


@dataclass(frozen=True)
class Graph:
    name: str
    nodes: Mapping[str, Any]  # node name -> pikku step
    successors: Mapping[str, tuple[str, ...]]
    predecessors: Mapping[str, tuple[str, ...]]
    order: tuple[str, ...]  # topological
    branch: Mapping[str, Callable[[Any], Iterable[str]]]
    on_error: Mapping[str, str] = field(default_factory=dict)  # node -> its error handler
    for_each: Mapping[str, str] = field(default_factory=dict)  # node -> predecessor listed
    sequential: frozenset[str] = frozenset()  # for_each nodes run one item at a time
    back_edges: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # loops
    max_visits: Mapping[str, int] = field(default_factory=dict)  # else DEFAULT_MAX_VISITS

    @property
    def handled_by(self) -> dict[str, str]:
        """Handler node -> the node whose failure starts it."""
        return {handler: node for node, handler in self.on_error.items()}

    def describe(self) -> str:
        """A stable text of the graph's shape: its version hash is taken from this."""
        edges = sorted((a, b) for a, succ in self.successors.items() for b in succ)
        steps = {n: getattr(getattr(s, "pikku_step", None), "name", repr(s))
                 for n, s in sorted(self.nodes.items())}
        return (f"graph {self.name}: nodes {steps}; edges {edges}; branch {sorted(self.branch)}"
                + (f"; on_error {sorted(self.on_error.items())}" if self.on_error else "")
                + (f"; for_each {sorted(self.for_each.items())} sequential "
                   f"{sorted(self.sequential)}" if self.for_each else "")
                + (f"; back_edges {sorted(self.back_edges.items())} max_visits "
                   f"{sorted(self.max_visits.items())}" if self.back_edges else ""))

    def limit(self, node: str) -> int:
        return self.max_visits.get(node, DEFAULT_MAX_VISITS)


def build_graph(name: str, nodes: Mapping[str, Any], edges: Sequence[tuple[str, str]],
                branch: Mapping[str, Callable[[Any], Iterable[str]]] | None = None,
                on_error: Mapping[str, str] | None = None,
                for_each: Mapping[str, Any] | None = None,
                max_visits: Mapping[str, int] | None = None) -> Graph:
    """Validate and freeze a graph; a bad graph is refused here, before any run starts."""
    if not nodes:
        raise InvalidInputError(f"graph {name!r} has no nodes")
    for node in nodes:
        check_name(f"graph {name!r} node name", node)
        if "#" in node or "[" in node:
            raise InvalidInputError(f"graph {name!r}: node name {node!r} may not contain "
                                    "'#' or '[' (they name a node's loop visits and items)")
    successors: dict[str, list[str]] = {n: [] for n in nodes}
    predecessors: dict[str, list[str]] = {n: [] for n in nodes}
    for edge in edges:
        if len(edge) != 2 or edge[0] not in nodes or edge[1] not in nodes:
            raise InvalidInputError(f"graph {name!r}: edge {edge!r} names an unknown node")
        successors[edge[0]].append(edge[1])
        predecessors[edge[1]].append(edge[0])
    for node in (branch or {}):
        if node not in nodes:
            raise InvalidInputError(f"graph {name!r}: branch on unknown node {node!r}")
    _check_on_error(name, dict(on_error or {}), nodes, predecessors)
    _check_loops(name, successors, set(branch or {}))
    handlers = set((on_error or {}).values())
    roots = [n for n in nodes if set(predecessors[n]) <= {n} and n not in handlers]
    if not roots:
        raise InvalidInputError(f"graph {name!r} has no entry node: every node has an incoming "
                                "edge or is an error handler, so no run could start")
    back = _back_edges(successors, roots, handlers)
    for a, b in back:
        successors[a].remove(b)
        predecessors[b].remove(a)
    back_edges: dict[str, tuple[str, ...]] = {}
    for a, b in back:
        back_edges[a] = (*back_edges.get(a, ()), b)
    visits = _check_max_visits(name, dict(max_visits or {}), nodes)
    over, sequential = _check_for_each(name, dict(for_each or {}), predecessors)
    return Graph(name, dict(nodes), {k: tuple(v) for k, v in successors.items()},
                 {k: tuple(v) for k, v in predecessors.items()},
                 _topological(name, successors, predecessors), dict(branch or {}),
                 dict(on_error or {}), over, sequential, back_edges, visits)


def _check_max_visits(name: str, visits: dict[str, Any], nodes: Mapping[str, Any]
                      ) -> dict[str, int]:
    for node, limit in visits.items():
        if node not in nodes or not isinstance(limit, int) or isinstance(limit, bool) \
                or limit < 1:
            raise InvalidInputError(f"graph {name!r}: max_visits {node!r}: {limit!r} must map "
                                    "a node to a positive integer")
    return visits


def _back_edges(successors: dict[str, list[str]], roots: list[str], handlers: set[str]
                ) -> list[tuple[str, str]]:
    """Edges to a node still on the depth-first path (from the roots, then from the error
    handlers, which only a failure starts): removing them leaves a DAG; each fires a new
    visit of an earlier node. The search takes nodes and edges by name, not in the order
    they were declared: in a cycle with two ways in, which edge closes the loop must not
    depend on how the graph was written down (where a cycle has one way in, every order
    finds the same back-edges)."""
    state: dict[str, int] = {}  # 1 on the path, 2 finished
    back: list[tuple[str, str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        for succ in sorted(successors[node]):
            if state.get(succ) == 1:
                back.append((node, succ))
            elif succ not in state:
                visit(succ)
        state[node] = 2

    for node in sorted(roots) + sorted(handlers) + sorted(successors):
        if node not in state:
            visit(node)
    return back


def _check_loops(name: str, successors: dict[str, list[str]], branching: set[str]) -> None:
    """Every cycle (strongly connected part) needs a node with a ``branch`` function, the
    only way a run can leave it; otherwise it is refused here rather than at max_visits."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in successors[node]:
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            part: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            looped = len(part) > 1 or node in successors[node]
            if looped and not branching & set(part):
                raise InvalidInputError(
                    f"graph {name!r} has a cycle through {sorted(part)} with no exit: none "
                    "of its nodes has a branch function that can leave it")

    for node in successors:
        if node not in index:
            connect(node)


def _check_for_each(name: str, for_each: dict[str, Any], predecessors: dict[str, list[str]]
                    ) -> tuple[dict[str, str], frozenset[str]]:
    """``{node: pred}`` or ``{node: {"over": pred, "sequential": True}}``: ``pred`` must be
    one of the node's predecessors (its list is what the node runs over)."""
    over: dict[str, str] = {}
    sequential: set[str] = set()
    for node, spec in for_each.items():
        if node not in predecessors:
            raise InvalidInputError(f"graph {name!r}: for_each on unknown node {node!r}")
        if isinstance(spec, Mapping):
            unknown = set(spec) - {"over", "sequential"}
            if unknown or "over" not in spec or not isinstance(spec.get("sequential", False),
                                                               bool):
                raise InvalidInputError(
                    f"graph {name!r}: for_each of {node!r} must be a predecessor's name or "
                    f"{{'over': <predecessor>, 'sequential': <bool>}}, got {spec!r}")
            pred, is_sequential = spec["over"], bool(spec.get("sequential", False))
        else:
            pred, is_sequential = spec, False
        if not isinstance(pred, str) or pred not in predecessors[node]:
            raise InvalidInputError(
                f"graph {name!r}: for_each of {node!r} names {pred!r}, which is not one of "
                f"its predecessors {sorted(predecessors[node])}")
        over[node] = pred
        if is_sequential:
            sequential.add(node)
    return over, frozenset(sequential)


def _check_on_error(name: str, on_error: dict[str, str], nodes: Mapping[str, Any],
                    predecessors: dict[str, list[str]]) -> None:
    """A handler is a node that only its node's failure starts: so it is a known node, not
    the failing node itself, has no incoming edge (that would start it otherwise) and
    handles one node (one error to receive)."""
    seen: set[str] = set()
    for node, handler in on_error.items():
        if node not in nodes:
            raise InvalidInputError(f"graph {name!r}: on_error on unknown node {node!r}")
        if not isinstance(handler, str) or handler not in nodes:
            raise InvalidInputError(
                f"graph {name!r}: on_error handler {handler!r} of {node!r} is not a node")
        if handler == node:
            raise InvalidInputError(f"graph {name!r}: node {node!r} cannot handle its own error")
        if predecessors[handler]:
            raise InvalidInputError(
                f"graph {name!r}: on_error handler {handler!r} has incoming edges "
                f"{sorted(predecessors[handler])}; only {node!r}'s failure may start it")
        if handler in seen:
            raise InvalidInputError(
                f"graph {name!r}: on_error handler {handler!r} handles more than one node")
        if handler in on_error:
            raise InvalidInputError(
                f"graph {name!r}: on_error handler {handler!r} has an error route itself")
        seen.add(handler)


def _topological(name: str, successors: dict[str, list[str]],
                 predecessors: dict[str, list[str]]) -> tuple[str, ...]:
    """The graph's order: a topological order of the forward edges, ties taken by name (so
    it does not depend on declaration order; a pass reports the first failure of a round in
    this order)."""
    waiting = {n: len(p) for n, p in predecessors.items()}
    ready = [n for n, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        node = heapq.heappop(ready)
        order.append(node)
        for succ in successors[node]:
            waiting[succ] -= 1
            if waiting[succ] == 0:
                heapq.heappush(ready, succ)
    if len(order) != len(successors):
        cyclic = sorted(n for n, count in waiting.items() if count > 0)
        raise InvalidInputError(f"graph {name!r} has a cycle through {cyclic}")
    return tuple(order)
