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
    for_each: Mapping[str, str] = field(default_factory=dict)  # node -> predecessor listed
    sequential: frozenset[str] = frozenset()  # for_each nodes run one item at a time

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
                   f"{sorted(self.sequential)}" if self.for_each else ""))


def build_graph(name: str, nodes: Mapping[str, Any], edges: Sequence[tuple[str, str]],
                branch: Mapping[str, Callable[[Any], Iterable[str]]] | None = None,
                on_error: Mapping[str, str] | None = None,
                for_each: Mapping[str, Any] | None = None) -> Graph:
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
    over, sequential = _check_for_each(name, dict(for_each or {}), predecessors)
    return Graph(name, dict(nodes), {k: tuple(v) for k, v in successors.items()},
                 {k: tuple(v) for k, v in predecessors.items()},
                 _topological(name, successors, predecessors), dict(branch or {}),
                 dict(on_error or {}), over, sequential)


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
    calls: dict[str, list[StepCall]] = {}
    handled_by = graph.handled_by
    progress = True
    while progress:
        progress = False
        for node in graph.order:
            if node in calls or node in skipped or not _settled(graph, node, results, skipped):
                continue
            preds = graph.predecessors[node]
            source = handled_by.get(node)
            over = graph.for_each.get(node)
            if source is not None:  # an error handler: starts only on its node's failure
                if source in handled:
                    inputs[node] = {"error": handled[source].error, "input": inputs[source]}
                elif source in results or source in skipped:
                    skipped.add(node)
                    progress = True
                    continue
                else:
                    continue
            elif (preds and not any(node in _chosen(graph, p, results) for p in preds
                                    if p in results)) or (over is not None
                                                          and over not in results):
                skipped.add(node)
                progress = True
                continue
            else:
                inputs[node] = {"input": data,
                                "from": {p: results[p] for p in preds if p in results}}
            progress = True
            if over is None:
                calls[node] = [wf.call(node, graph.nodes[node], inputs[node])]
            else:
                calls[node] = _fan_out(graph, wf, node, results[over], inputs[node])
            node_calls = calls[node]
            failed = next((c for c in node_calls if c.outcome == "failed"), None)
            if failed is not None and node in graph.on_error:
                handled[node] = failed
                skipped.add(node)  # its successors do not run; its handler does
            elif all(c.outcome == "done" for c in node_calls) and (
                    over is None or len(node_calls) == len(results[over])):
                results[node] = ([c.result for c in node_calls] if over is not None
                                 else node_calls[0].result)
    # pauses while nodes are in flight; raises the failure of a node with no error route
    wf.gather(*(c for n, cs in calls.items() if n not in handled for c in cs))
    return {n: results[n] for n in graph.order if not graph.successors[n] and n in results}


def _fan_out(graph: Graph, wf: WorkflowContext, node: str, items: Any,
             base: dict[str, Any]) -> list[StepCall]:
    """Steps ``node[0]``, ``node[1]``, ... one per item; all at once, or, sequentially, the
    next only once the one before it is done (so a pass stops at the first not done)."""
    if not isinstance(items, list):
        raise InvalidInputError(
            f"graph {graph.name!r}: for_each node {node!r} needs a list from "
            f"{graph.for_each[node]!r}, got {type(items).__name__}")
    made: list[StepCall] = []
    for index, item in enumerate(items):
        call = wf.call(f"{node}[{index}]", graph.nodes[node],
                       {**base, "item": item, "index": index})
        made.append(call)
        if node in graph.sequential and call.outcome != "done":
            break
    return made


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
