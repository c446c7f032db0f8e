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
described in the README's graph section.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pikku_celery.errors import InvalidInputError, WorkflowRunFailedError
from pikku_celery.replay import StepCall, WorkflowContext
from pikku_celery.validate import check_name, check_state_write

DEFAULT_MAX_VISITS = 10  # how many times one node may run in a loop before the run fails


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
    """Edges to a node still on the depth-first path (from the roots, in declaration
    order, then from the error handlers, which only a failure starts): removing them leaves
    a DAG; each fires a new visit of an earlier node."""
    state: dict[str, int] = {}  # 1 on the path, 2 finished
    back: list[tuple[str, str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        for succ in successors[node]:
            if state.get(succ) == 1:
                back.append((node, succ))
            elif succ not in state:
                visit(succ)
        state[node] = 2

    for node in roots + sorted(handlers) + list(successors):
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


@dataclass
class _Pass:
    """What one replay pass of a graph knows so far."""

    results: dict[str, Any] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)  # not chosen, or failed and handled
    handled: dict[str, StepCall] = field(default_factory=dict)  # failed, with an error route
    inputs: dict[str, Any] = field(default_factory=dict)
    calls: dict[str, list[StepCall]] = field(default_factory=dict)  # the current visits'
    earlier: list[StepCall] = field(default_factory=list)  # of visits a loop replaced
    visit: dict[str, int] = field(default_factory=dict)  # a node's current visit (from 1)
    fired: dict[str, dict[str, Any]] = field(default_factory=dict)  # the back-edge result


def run_graph(graph: Graph, wf: WorkflowContext, data: Any) -> dict[str, Any]:
    """One replay pass over the graph (the workflow function of a graph workflow).

    Nodes whose steps are recorded are replayed first, to a fixpoint: a back-edge they fire
    replaces the visits after its target before anything new is started, so no node of a
    replaced visit is dispatched. New steps are started only when nothing recorded can move
    the run further; what a pass does depends on what is recorded, not on the order in
    which steps finished."""
    p = _Pass()
    allow_new = False
    while True:
        progress = False
        for node in graph.order:
            if node in p.calls or node in p.skipped or not _settled(graph, node, p):
                continue
            start = _node_data(graph, node, data, p)
            if start is _WAIT:
                continue
            if start is _SKIP:
                p.skipped.add(node)
                progress = True
                continue
            over = graph.for_each.get(node)
            items = None if over is None else p.results.get(over, _NO_LIST)
            count = p.visit.get(node, 1)
            if not allow_new and _would_dispatch(graph, wf, node, count, items):
                continue
            progress = True
            p.inputs[node] = start
            p.calls[node] = _start(graph, wf, node, count, start, items)
            _took(graph, wf, node, items, p)
        if progress:
            allow_new = False
        elif allow_new:
            break
        else:
            allow_new = True
    # pauses while nodes are in flight; raises the failure of a node with no error route
    wf.gather(*p.earlier, *(c for n, cs in p.calls.items() if n not in p.handled for c in cs))
    return {n: p.results[n] for n in graph.order if not graph.successors[n] and n in p.results}


def _took(graph: Graph, wf: WorkflowContext, node: str, items: Any, p: _Pass) -> None:
    """A node's visit was started: take its state writes, its failure (to its error route)
    or its result, and fire the back-edges it chose."""
    node_calls = p.calls[node]
    for call in node_calls:
        _write_state(wf, call)
    failed = next((c for c in node_calls if c.outcome == "failed"), None)
    if failed is not None and node in graph.on_error:
        p.handled[node] = failed
        p.skipped.add(node)  # its successors do not run; its handler does
        return
    if not all(c.outcome == "done" for c in node_calls) or (
            items is not None and len(node_calls) != len(items)):
        return
    p.results[node] = ([_unwrapped(c.result) for c in node_calls] if items is not None
                       else _unwrapped(node_calls[0].result))
    back = [t for t in graph.back_edges.get(node, ())
            if t in _chosen(graph, node, p.results)
            and not _fired_by_another(graph, wf, node, t, p)]
    for target in back:
        _loop_back(graph, target, {node: p.results[node]}, p)


def _loop_back(graph: Graph, target: str, source: dict[str, Any], p: _Pass) -> None:
    """A back-edge: the target and what follows it start over as their next visits (the
    replaced visits' calls are still waited for)."""
    for n in _reachable(graph, target):
        if n in p.calls:
            if n not in p.handled:
                p.earlier.extend(p.calls[n])
            del p.calls[n]
            p.visit[n] = p.visit.get(n, 1) + 1
        for table in (p.results, p.inputs, p.handled, p.fired):
            table.pop(n, None)
        p.skipped.discard(n)
    p.fired[target] = source  # what the back-edge brings


def _visit_name(node: str, count: int) -> str:
    """The step of a node's visit ``count``: ``node``, then ``node#2``, ``node#3``..."""
    return node if count == 1 else f"{node}#{count}"


def _step_names(graph: Graph, node: str, count: int, items: Any) -> list[str] | None:
    """The steps of a node's visit ``count``; ``None`` when they cannot be named yet (a
    for_each over a value that is not a list: starting it fails the run)."""
    base = _visit_name(node, count)
    if node not in graph.for_each:
        return [base]
    if not isinstance(items, list):
        return None
    return [f"{base}[{index}]" for index in range(len(items))]


def _would_dispatch(graph: Graph, wf: WorkflowContext, node: str, count: int,
                    items: Any) -> bool:
    """Would starting this visit record a new step (or fail the run), rather than replay
    recorded ones?"""
    names = _step_names(graph, node, count, items)
    return (names is None or count > graph.limit(node)
            or any(wf._recorded(name) is None for name in names))


def _fired_by_another(graph: Graph, wf: WorkflowContext, source: str, target: str,
                      p: _Pass) -> bool:
    """Was the target's next visit already started by another back-edge? Its recorded
    data says which source fired it (``from``): the first firing is durable, so every
    later pass follows it, whichever sources have finished since."""
    first = _visit_name(target, p.visit.get(target, 1) + (1 if target in p.calls else 0))
    recorded = wf._recorded(f"{first}[0]" if target in graph.for_each else first)
    came = recorded.data.get("from") if recorded is not None and isinstance(
        recorded.data, dict) else None
    return isinstance(came, dict) and source not in came


_WAIT = object()
_NO_LIST = object()  # a for_each node's list predecessor has no result
_SKIP = object()


def _node_data(graph: Graph, node: str, data: Any, p: _Pass) -> Any:
    """What a settled node starts with this pass: its data, or _SKIP, or _WAIT."""
    results, skipped, handled, fired = p.results, p.skipped, p.handled, p.fired
    preds = graph.predecessors[node]
    source = graph.handled_by.get(node)
    over = graph.for_each.get(node)
    if source is not None:  # an error handler: starts only on its node's failure
        if source in handled:
            return {"error": handled[source].error, "input": p.inputs[source]}
        return _SKIP if source in results or source in skipped else _WAIT
    if node not in fired and (
            (preds and not any(node in _chosen(graph, pred, results) for pred in preds
                               if pred in results))
            or (over is not None and over not in results)):
        return _SKIP
    return {"input": data, "from": {**{pred: results[pred] for pred in preds
                                       if pred in results}, **fired.get(node, {})}}


def _start(graph: Graph, wf: WorkflowContext, node: str, count: int, data: Any,
           items: Any) -> list[StepCall]:
    """Start (or find) the node's current visit: ``node#count`` past the first, one step
    per item for a for_each node; past ``max_visits`` the run fails instead."""
    if count > graph.limit(node):
        raise WorkflowRunFailedError(
            f"graph {graph.name!r}: node {node!r} would run a {count}th time, over "
            f"its max_visits of {graph.limit(node)} (a loop that does not end?)")
    step_name = _visit_name(node, count)
    if items is _NO_LIST:
        raise InvalidInputError(
            f"graph {graph.name!r}: a loop started for_each node {node!r} again, but "
            f"{graph.for_each[node]!r}, whose list it runs over, did not run in this visit")
    if node not in graph.for_each:
        return [wf.call(step_name, graph.nodes[node], {**data, "state": wf.state})]
    return _fan_out(graph, wf, node, step_name, items, data)


def _reachable(graph: Graph, start: str) -> list[str]:
    """``start`` and every node after it on forward edges, with the error handlers of those
    nodes and what follows them (a new visit of a node that fails again needs its handler
    again)."""
    seen = [start]
    for node in seen:
        after = list(graph.successors[node])
        if node in graph.on_error:
            after.append(graph.on_error[node])
        seen.extend(s for s in after if s not in seen)
    return seen


def _fan_out(graph: Graph, wf: WorkflowContext, node: str, step_name: str, items: Any,
             base: dict[str, Any]) -> list[StepCall]:
    """Steps ``node[0]``, ``node[1]``, ... one per item; all at once, or, sequentially, the
    next only once the one before it is done (so a pass stops at the first not done)."""
    if not isinstance(items, list):
        raise InvalidInputError(
            f"graph {graph.name!r}: for_each node {node!r} needs a list from "
            f"{graph.for_each[node]!r}, got {type(items).__name__}")
    made: list[StepCall] = []
    sequential = node in graph.sequential
    state = wf.state
    for index, item in enumerate(items):
        call = wf.call(f"{step_name}[{index}]", graph.nodes[node],
                       {**base, "state": state, "item": item, "index": index})
        made.append(call)
        if sequential:
            if call.outcome != "done":
                break
            if _write_state(wf, call):  # the next item sees what this one wrote
                state = wf.state
    return made


def with_state(result: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """What a graph node returns to also write ``state`` into the run state.

    The node's successors receive ``result``; the pass that first sees the node done merges
    ``state`` into the run state map (under the run lease, once, one versioned write), and
    every node started after that finds the map in its data's ``"state"``. Keys are 1 to 64
    letters, digits or underscores; the whole map stays under 64 KiB. A superseded attempt's
    write is fenced out with its result: only the attempt that settled the node writes."""
    check_state_write("a graph node", state, {})
    return {_STATE_MARK: dict(state), "result": result}


_STATE_MARK = "__pikku_state__"


def _split(value: Any) -> tuple[Any, Mapping[str, Any] | None]:
    """A node's recorded result: its value for successors, and its state write if any."""
    if type(value) is dict and len(value) == 2 and _STATE_MARK in value and "result" in value:
        return value["result"], value[_STATE_MARK]
    return value, None


def _unwrapped(value: Any) -> Any:
    return _split(value)[0]


def _write_state(wf: WorkflowContext, call: StepCall) -> bool:
    """Merge a done node's state write, named by its step (replays change nothing);
    ``True`` if it had one."""
    if call.outcome != "done":
        return False
    writes = _split(call.result)[1]
    if writes is None:
        return False
    wf.set_state(call.name, writes)
    return True


def _settled(graph: Graph, node: str, p: _Pass) -> bool:
    return all(pred in p.results or pred in p.skipped for pred in graph.predecessors[node])


def _chosen(graph: Graph, node: str, results: dict[str, Any]) -> set[str]:
    chooser = graph.branch.get(node)
    if chooser is None:  # every edge out fires, a back-edge included
        return set(graph.successors[node]) | set(graph.back_edges.get(node, ()))
    picked = chooser(results[node])
    if isinstance(picked, str) or not isinstance(picked, list | tuple | set | frozenset) or (
            not all(isinstance(n, str) for n in picked)):
        raise InvalidInputError(
            f"graph {graph.name!r}: branch of {node!r} must return a list of node names, "
            f"got {picked!r:.200}")
    chosen = set(picked)
    unknown = chosen - set(graph.successors[node]) - set(graph.back_edges.get(node, ()))
    if unknown:
        raise InvalidInputError(f"graph {graph.name!r}: branch of {node!r} chose "
                                f"{sorted(unknown)}, which are not its successors")
    return chosen
