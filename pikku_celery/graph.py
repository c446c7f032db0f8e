"""Graph workflows: a declared DAG of steps, planned by replay under the run lease.

Every pass starts each node whose predecessors have all settled (a join fires once, when the
last of them is done), records results, and pauses while any node is in flight. A node's
data is ``{"input": <run input>, "from": {<predecessor>: <its result>}}``. An optional
``branch`` function per node picks which of its successors run, from its result; a node no
predecessor picked is skipped, and so is everything only it would have started. The run's
output maps each sink node that ran to its result. A node whose worker died is dispatched
again once its lease lapses, exactly as any step (replay and the reaper do it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pikku_celery.errors import InvalidInputError
from pikku_celery.replay import StepCall, WorkflowContext
from pikku_celery.validate import check_name


@dataclass(frozen=True)
class Graph:
    name: str
    nodes: Mapping[str, Any]  # node name -> pikku step
    successors: Mapping[str, tuple[str, ...]]
    predecessors: Mapping[str, tuple[str, ...]]
    order: tuple[str, ...]  # topological
    branch: Mapping[str, Callable[[Any], Iterable[str]]]
    on_error: Mapping[str, str] = field(default_factory=dict)  # node -> its error handler

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
                + (f"; on_error {sorted(self.on_error.items())}" if self.on_error else ""))


def build_graph(name: str, nodes: Mapping[str, Any], edges: Sequence[tuple[str, str]],
                branch: Mapping[str, Callable[[Any], Iterable[str]]] | None = None,
                on_error: Mapping[str, str] | None = None) -> Graph:
    """Validate and freeze a graph; a bad graph is refused here, before any run starts."""
    if not nodes:
        raise InvalidInputError(f"graph {name!r} has no nodes")
    for node in nodes:
        check_name(f"graph {name!r} node name", node)
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
    return Graph(name, dict(nodes), {k: tuple(v) for k, v in successors.items()},
                 {k: tuple(v) for k, v in predecessors.items()},
                 _topological(name, successors, predecessors), dict(branch or {}),
                 dict(on_error or {}))


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
    waiting = {n: len(p) for n, p in predecessors.items()}
    ready = [n for n, count in waiting.items() if count == 0]
    order: list[str] = []
    while ready:
        node = ready.pop(0)
        order.append(node)
        for succ in successors[node]:
            waiting[succ] -= 1
            if waiting[succ] == 0:
                ready.append(succ)
    if len(order) != len(successors):
        cyclic = sorted(n for n, count in waiting.items() if count > 0)
        raise InvalidInputError(f"graph {name!r} has a cycle through {cyclic}")
    return tuple(order)


def run_graph(graph: Graph, wf: WorkflowContext, data: Any) -> dict[str, Any]:
    """One replay pass over the graph (the workflow function of a graph workflow)."""
    results: dict[str, Any] = {}
    skipped: set[str] = set()  # settled without a result: not chosen, or failed and handled
    handled: dict[str, StepCall] = {}  # failed for good, with an error route
    inputs: dict[str, Any] = {}
    calls: dict[str, StepCall] = {}
    handled_by = graph.handled_by
    progress = True
    while progress:
        progress = False
        for node in graph.order:
            if node in calls or node in skipped or not _settled(graph, node, results, skipped):
                continue
            preds = graph.predecessors[node]
            source = handled_by.get(node)
            if source is not None:  # an error handler: starts only on its node's failure
                if source in handled:
                    inputs[node] = {"error": handled[source].error, "input": inputs[source]}
                elif source in results or source in skipped:
                    skipped.add(node)
                    progress = True
                    continue
                else:
                    continue
            elif preds and not any(node in _chosen(graph, p, results) for p in preds
                                   if p in results):
                skipped.add(node)
                progress = True
                continue
            else:
                inputs[node] = {"input": data,
                                "from": {p: results[p] for p in preds if p in results}}
            progress = True
            calls[node] = wf.call(node, graph.nodes[node], inputs[node])
            if calls[node].outcome == "done":
                results[node] = calls[node].result
            elif calls[node].outcome == "failed" and node in graph.on_error:
                handled[node] = calls[node]
                skipped.add(node)  # its successors do not run; its handler does
    # pauses while nodes are in flight; raises the failure of a node with no error route
    wf.gather(*(c for n, c in calls.items() if n not in handled))
    return {n: results[n] for n in graph.order if not graph.successors[n] and n in results}


def _settled(graph: Graph, node: str, results: dict[str, Any], skipped: set[str]) -> bool:
    return all(p in results or p in skipped for p in graph.predecessors[node])


def _chosen(graph: Graph, node: str, results: dict[str, Any]) -> set[str]:
    chooser = graph.branch.get(node)
    if chooser is None:
        return set(graph.successors[node])
    chosen = set(chooser(results[node]))
    unknown = chosen - set(graph.successors[node])
    if unknown:
        raise InvalidInputError(f"graph {graph.name!r}: branch of {node!r} chose "
                                f"{sorted(unknown)}, which are not its successors")
    return chosen
