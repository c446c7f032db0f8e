"""One replay pass of a graph workflow, played as rounds.

A round runs the graph's nodes as a DAG (the back-edges left out): a node starts once every
predecessor has settled, and a join therefore waits for its inputs of the same round. A
node whose ``branch`` chooses a back-edge *fires* it; what comes after a firing node is
*cut* from the round (it runs in the next one). The round ends when nothing is in flight
and nothing more can start; then every back-edge that fired in it takes effect at once:
each target and everything after it is forgotten, and the next round starts the target
again as its next visit (``node#2``, ``node#3``...), with the firing sources' results in its
``"from"``. Everything a round does is decided by step results only, never by the order in
which steps finished: a pass replays the recorded steps round by round, so every pass, and
every delivery order, plans the same steps. Errors of the graph's own making (a node over
its ``max_visits``, a ``for_each`` without a list, a bad ``branch`` answer) wait for the
round to end like a failed step does, so they too record the same steps in every order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pikku_celery.model.errors import InvalidInputError, WorkflowRunFailedError
from pikku_celery.model.validate import check_state_write
from pikku_celery.workflow.replay import StepCall, WorkflowContext

if TYPE_CHECKING:
    from pikku_celery.workflow.graph import Graph


@dataclass
class _Rounds:
    """What one pass knows of the current round (and, in ``visits``, of the rounds before)."""

    results: dict[str, Any] = field(default_factory=dict)
    chosen: dict[str, set[str]] = field(default_factory=dict)  # what each result's branch picked
    skipped: set[str] = field(default_factory=set)  # not chosen, or failed and handled
    cut: set[str] = field(default_factory=set)  # after a back-edge that fired
    handled: dict[str, StepCall] = field(default_factory=dict)  # failed, with an error route
    failed: dict[str, BaseException | StepCall] = field(default_factory=dict)  # fails the run
    inputs: dict[str, Any] = field(default_factory=dict)
    calls: dict[str, list[StepCall]] = field(default_factory=dict)
    firing: set[str] = field(default_factory=set)  # nodes whose back-edges fired
    fired: dict[str, dict[str, Any]] = field(default_factory=dict)  # target -> sources' results
    came: dict[str, dict[str, Any]] = field(default_factory=dict)  # what restarted a target
    visits: dict[str, int] = field(default_factory=dict)  # visits started, every round

    def decided(self, node: str) -> bool:
        return (node in self.calls or node in self.skipped or node in self.cut
                or node in self.failed)


def run_graph(graph: Graph, wf: WorkflowContext, data: Any) -> dict[str, Any]:
    """One replay pass over the graph (the workflow function of a graph workflow): plays
    the recorded rounds again, starts what the current round can start, and pauses while
    any of its steps is in flight; the run fails, once the round has settled, if a node
    failed with no error route."""
    p = _Rounds()
    while True:
        _play_round(graph, wf, data, p)
        waiting = [c for calls in p.calls.values() for c in calls if c.outcome == "waiting"]
        wf.gather(*waiting)  # pauses while anything of this round is in flight
        _fail_on_first(graph, wf, p)
        if not p.fired:
            return {n: p.results[n] for n in graph.order
                    if not graph.successors[n] and n in p.results}
        _next_round(graph, p)


def _fail_on_first(graph: Graph, wf: WorkflowContext, p: _Rounds) -> None:
    """A settled round with a failure fails the run: the first failure in graph order
    (a failed step's error as ``wf.gather`` reports it, or the graph's own refusal)."""
    failures = [p.failed[node] for node in graph.order if node in p.failed]
    if not failures:
        return
    first = failures[0]
    if isinstance(first, StepCall):
        wf.gather(first)  # raises WorkflowRunFailedError naming the step and its error
        raise AssertionError(f"gather returned for failed step {first.name!r}")
    raise first


def _play_round(graph: Graph, wf: WorkflowContext, data: Any, p: _Rounds) -> None:
    """Decide every node the round can decide, to a fixpoint (each decision depends only
    on the node's predecessors' settled outcomes, so the order of looking does not matter)."""
    progress = True
    while progress:
        progress = False
        for node in graph.order:
            if not p.decided(node) and _decide(graph, wf, node, data, p):
                progress = True


def _decide(graph: Graph, wf: WorkflowContext, node: str, data: Any, p: _Rounds) -> bool:
    """Cut, skip or start ``node`` if its predecessors allow it yet; ``True`` if it did."""
    source = graph.handled_by.get(node)
    preds = graph.predecessors[node]
    if source is not None:  # an error handler: starts only on its node's failure
        if source in p.handled:
            _begin(graph, wf, node, {"error": p.handled[source].error,
                                     "input": p.inputs[source]}, p)
        elif source in p.cut:
            p.cut.add(node)
        elif source in p.results or source in p.skipped:
            p.skipped.add(node)
        else:
            return False
        return True
    if any(pred in p.cut or pred in p.firing for pred in preds):
        p.cut.add(node)  # after a firing back-edge: the next round runs it
        return True
    if not all(pred in p.results or pred in p.skipped for pred in preds):
        return False
    over = graph.for_each.get(node)
    if node not in p.came and (
            (preds and not any(node in p.chosen[pred] for pred in preds if pred in p.results))
            or (over is not None and over not in p.results)):
        p.skipped.add(node)
        return True
    _begin(graph, wf, node, {"input": data, "from": {
        **{pred: p.results[pred] for pred in preds if pred in p.results},
        **p.came.get(node, {})}}, p)
    return True


def _begin(graph: Graph, wf: WorkflowContext, node: str, start: dict[str, Any],
           p: _Rounds) -> None:
    """Start (or replay) the node's next visit, then take what it did."""
    count = p.visits.get(node, 0) + 1
    over = graph.for_each.get(node)
    items = None if over is None else p.results.get(over, _NO_LIST)
    refused = _refusal(graph, node, count, items)
    if refused is not None:
        p.failed[node] = refused
        return
    p.visits[node] = count
    p.inputs[node] = start
    name = _visit_name(node, count)
    if over is None:
        p.calls[node] = [wf.call(name, graph.nodes[node], {**start, "state": wf.state})]
    else:
        assert isinstance(items, list)  # _refusal refused anything else
        p.calls[node] = _fan_out(graph, wf, node, name, items, start)
    _took(graph, wf, node, p)


_NO_LIST = object()  # a for_each node's list predecessor has no result


def _refusal(graph: Graph, node: str, count: int, items: Any) -> BaseException | None:
    """Why the node's visit ``count`` cannot start (it fails the run), if it cannot."""
    if count > graph.limit(node):
        return WorkflowRunFailedError(
            f"graph {graph.name!r}: node {node!r} would run a {count}th time, over "
            f"its max_visits of {graph.limit(node)} (a loop that does not end?)")
    if items is _NO_LIST:
        return InvalidInputError(
            f"graph {graph.name!r}: a loop started for_each node {node!r} again, but "
            f"{graph.for_each[node]!r}, whose list it runs over, did not run in this visit")
    if node in graph.for_each and not isinstance(items, list):
        return InvalidInputError(
            f"graph {graph.name!r}: for_each node {node!r} needs a list from "
            f"{graph.for_each[node]!r}, got {type(items).__name__}")
    return None


def _took(graph: Graph, wf: WorkflowContext, node: str, p: _Rounds) -> None:
    """A node's visit was started: once none of its steps is in flight, take its state
    writes, its failure (the first failed item's, in item order) or its result, and note
    the back-edges it chose."""
    node_calls = p.calls[node]
    for call in node_calls:
        _write_state(wf, call)
    if any(c.outcome == "waiting" for c in node_calls):
        return
    failed = next((c for c in node_calls if c.outcome == "failed"), None)
    if failed is not None:
        if node in graph.on_error:
            p.handled[node] = failed
            p.skipped.add(node)  # its successors do not run; its handler does
        else:
            p.failed[node] = failed
        return
    result = ([_unwrapped(c.result) for c in node_calls] if node in graph.for_each
              else _unwrapped(node_calls[0].result))
    try:
        chosen = _chosen(graph, node, result)
    except Exception as exc:  # a branch's own error fails the run once the round settles
        p.failed[node] = exc
        return
    p.results[node], p.chosen[node] = result, chosen
    for target in graph.back_edges.get(node, ()):
        if target in chosen:
            p.fired.setdefault(target, {})[node] = result
            p.firing.add(node)


def _next_round(graph: Graph, p: _Rounds) -> None:
    """The back-edges that fired take effect together: every target and what follows it
    start over. A target after another fired target is restarted by that one's round like
    any node after it (an outer loop's new visit starts its inner loop afresh)."""
    forgotten: set[str] = set()
    reach = {target: _reachable(graph, target) for target in p.fired}
    for nodes in reach.values():
        forgotten.update(nodes)
    p.came = {t: sources for t, sources in p.fired.items()
              if not any(t in reach[u] for u in reach if u != t)}
    for node in forgotten:
        for table in (p.results, p.chosen, p.inputs, p.handled, p.calls):
            table.pop(node, None)
        for marks in (p.skipped, p.cut, p.firing):
            marks.discard(node)
    p.fired = {}


def _visit_name(node: str, count: int) -> str:
    """The step of a node's visit ``count``: ``node``, then ``node#2``, ``node#3``..."""
    return node if count == 1 else f"{node}#{count}"


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


def _fan_out(graph: Graph, wf: WorkflowContext, node: str, step_name: str, items: list[Any],
             base: dict[str, Any]) -> list[StepCall]:
    """Steps ``node[0]``, ``node[1]``, ... one per item; all at once, or, sequentially, the
    next only once the one before it is done (so a pass stops at the first not done)."""
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


def _chosen(graph: Graph, node: str, result: Any) -> set[str]:
    chooser = graph.branch.get(node)
    if chooser is None:  # every edge out fires, a back-edge included
        return set(graph.successors[node]) | set(graph.back_edges.get(node, ()))
    picked = chooser(result)
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
