"""The geometry of a graph workflow's drawing on its run page (inline SVG, drawn by
``templates/graph.html``).

A graph workflow (``pikku.graph(...)``) records each visit of a node as a step of its own:
``node`` for the first, ``node#2``, ``node#3``... for a loop's later visits, and ``node[i]``
(``node#2[i]``) for each item of a ``for_each`` node (``pikku_celery.workflow._graph_rounds``). This
module lays the declared graph out left to right in layers (a node one layer after its
furthest predecessor, an error handler one after the node it handles), draws its edges
(forward edges, ``on_error`` routes dashed, loops' back-edges as arcs under the nodes),
and puts in each node one chip per recorded visit (or item), classed by the step's status,
the node itself by its latest visit's (``not-run`` when none).

The graph is the one registered in this process under the run's workflow name, found
behind the workflow function ``pikku.graph`` made (it keeps its ``Graph`` in its closure);
the run page says so when the run was recorded by another version than the registered
one. Nothing here is escaped: the template does that (node and step names are user data).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pikku_celery.model.records import STEP_FAILED, STEP_RUNNING, STEP_SUCCEEDED, StepState
from pikku_celery.workflow.graph import Graph

NODE_W = 168
NODE_H = 56
COL_GAP = 64
ROW_GAP = 28
PAD = 16
CHIP_W = 17
CHIP_H = 13
CHIP_GAP = 3
MAX_CHIPS = 8  # per node; more are counted (+N)
ARC_DEPTH = 22  # how far below its nodes a loop's arc dips, per layer it spans
NOT_RUN = "not-run"
_VISIT = re.compile(r"(?P<node>[^#\[]+)(?:#(?P<visit>[0-9]+))?(?:\[(?P<item>[0-9]+)\])?")


@dataclass(frozen=True)
class Chip:
    x: float
    y: float
    step: str  # the step's stored name: node, node#2, node[0], node#2[1]
    label: str  # #1, #2, [0], #2[1]
    status: str


@dataclass(frozen=True)
class Node:
    name: str
    x: float
    y: float
    status: str  # the latest visit's, else ``not-run``
    visits: int  # visits recorded (a for_each node's items counted once per visit)
    chips: list[Chip]
    more: int  # chips not drawn
    note: str  # ``for each item of X``, ``on error of X``, ``up to N visits``


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    kind: str  # edge, error, loop
    path: str  # an SVG path


@dataclass(frozen=True)
class GraphDrawing:
    width: int
    height: int
    nodes: list[Node]
    edges: list[Edge]
    node_w: int = NODE_W
    node_h: int = NODE_H
    chip_w: int = CHIP_W
    chip_h: int = CHIP_H


def graph_of(pikku: Any, workflow: str) -> tuple[Graph, str] | None:
    """The ``Graph`` registered under ``workflow`` in this process and the workflow's
    version, or ``None`` (not registered here, or not a graph workflow)."""
    definition = pikku.registry.workflows.get(workflow)
    if definition is None:
        return None
    for cell in getattr(definition.fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, Graph):
            return value, str(definition.version)
    return None


def split_visit(step_name: str) -> tuple[str, int, int | None] | None:
    """``node#2[1]`` -> ``("node", 2, 1)``; ``None`` for a name no visit has."""
    found = _VISIT.fullmatch(step_name)
    if found is None:
        return None
    item = found.group("item")
    return (found.group("node"), int(found.group("visit") or 1),
            None if item is None else int(item))


def draw(graph: Graph, steps: Iterable[StepState]) -> GraphDrawing:
    """Lay ``graph`` out and put the run's recorded ``steps`` in its nodes."""
    layers = _layers(graph)
    columns: dict[int, list[str]] = {}
    for node in graph.order:
        columns.setdefault(layers[node], []).append(node)
    rank = {n: i for i, n in enumerate(graph.order)}
    place: dict[str, tuple[float, float]] = {}
    for layer in sorted(columns):
        column = columns[layer]
        # Next to what leads to them: by their predecessors' mean row, then graph order.
        column.sort(key=lambda n: (_mean_row(graph, n, place), rank[n]))
        for row, node in enumerate(column):
            place[node] = (PAD + layer * (NODE_W + COL_GAP), PAD + row * (NODE_H + ROW_GAP))
    visits = _visits(graph, steps)
    nodes = [_node(graph, name, place[name], visits.get(name, [])) for name in graph.order]
    edges = _edges(graph, place, layers)
    deepest = max((ARC_DEPTH * (1 + abs(layers[a] - layers[b]))
                   for a, targets in graph.back_edges.items() for b in targets), default=0)
    width = PAD * 2 + (max(layers.values()) + 1) * (NODE_W + COL_GAP) - COL_GAP
    height = (PAD * 2 + max(len(c) for c in columns.values()) * (NODE_H + ROW_GAP) - ROW_GAP
              + deepest)
    return GraphDrawing(width, height, nodes, edges)


def _layers(graph: Graph) -> dict[str, int]:
    """A node's layer: one after its furthest predecessor (on forward edges), an error
    handler one after the node it handles; entry nodes are layer 0."""
    handled = graph.handled_by
    layer = dict.fromkeys(graph.order, 0)
    for _ in range(len(graph.order) + 1):  # relax until stable: handlers can chain
        changed = False
        for node in graph.order:
            wanted = max([layer[p] + 1 for p in graph.predecessors[node]]
                         + ([layer[handled[node]] + 1] if node in handled else [0]))
            if wanted != layer[node]:
                layer[node], changed = wanted, True
        if not changed:
            break
    return layer


def _mean_row(graph: Graph, node: str, place: dict[str, tuple[float, float]]) -> float:
    before = [place[p][1] for p in graph.predecessors[node] if p in place]
    source = graph.handled_by.get(node)
    if source is not None and source in place:
        before.append(place[source][1])
    return sum(before) / len(before) if before else 0.0


def _visits(graph: Graph, steps: Iterable[StepState]
            ) -> dict[str, list[tuple[int, int | None, StepState]]]:
    found: dict[str, list[tuple[int, int | None, StepState]]] = {}
    for step in steps:
        split = split_visit(step.step_name)
        if split is None or split[0] not in graph.nodes:
            continue  # an approval, a compensation, a step of the workflow's own
        node, visit, item = split
        found.setdefault(node, []).append((visit, item, step))
    for entries in found.values():
        entries.sort(key=lambda e: (e[0], -1 if e[1] is None else e[1]))
    return found


def _node(graph: Graph, name: str, at: tuple[float, float],
          entries: list[tuple[int, int | None, StepState]]) -> Node:
    x, y = at
    chips = []
    for i, (visit, item, step) in enumerate(entries[:MAX_CHIPS]):
        label = (f"#{visit}" if item is None
                 else (f"[{item}]" if visit == 1 else f"#{visit}[{item}]"))
        chips.append(Chip(x + 8 + i * (CHIP_W + CHIP_GAP), y + NODE_H - CHIP_H - 7,
                          step.step_name, label, _status(step)))
    latest = max((visit for visit, _, _ in entries), default=0)
    status = _merged([_status(s) for visit, _, s in entries if visit == latest])
    notes = []
    if name in graph.for_each:
        notes.append(f"for each of {graph.for_each[name]}")
    if name in graph.handled_by:
        notes.append(f"on error of {graph.handled_by[name]}")
    return Node(name, x, y, status, latest, chips, max(len(entries) - MAX_CHIPS, 0),
                ", ".join(notes))


def _status(step: StepState) -> str:
    if step.status == STEP_FAILED and step.due_at is not None:
        return "retrying"  # a retry is due: not failed for good
    return step.status


def _merged(statuses: list[str]) -> str:
    """A visit's status from its steps' (one, or a for_each node's items)."""
    if not statuses:
        return NOT_RUN
    if STEP_FAILED in statuses:
        return STEP_FAILED
    if all(s == STEP_SUCCEEDED for s in statuses):
        return STEP_SUCCEEDED
    if STEP_RUNNING in statuses:
        return STEP_RUNNING
    return next(s for s in statuses if s != STEP_SUCCEEDED)


def _edges(graph: Graph, place: dict[str, tuple[float, float]], layers: dict[str, int]
           ) -> list[Edge]:
    edges = []
    for source in graph.order:
        for target in graph.successors[source]:
            edges.append(Edge(source, target, "edge", _forward(place[source], place[target])))
        handler = graph.on_error.get(source)
        if handler is not None:
            edges.append(Edge(source, handler, "error",
                              _forward(place[source], place[handler])))
        for target in graph.back_edges.get(source, ()):
            depth = ARC_DEPTH * (1 + abs(layers[source] - layers[target]))
            edges.append(Edge(source, target, "loop",
                              _arc(place[source], place[target], depth)))
    return edges


def _forward(a: tuple[float, float], b: tuple[float, float]) -> str:
    x1, y1 = a[0] + NODE_W, a[1] + NODE_H / 2
    x2, y2 = b[0], b[1] + NODE_H / 2
    bend = max((x2 - x1) / 2, 20)
    return (f"M {x1:.1f} {y1:.1f} C {x1 + bend:.1f} {y1:.1f}, {x2 - bend:.1f} {y2:.1f}, "
            f"{x2 - 2:.1f} {y2:.1f}")


def _arc(a: tuple[float, float], b: tuple[float, float], depth: float) -> str:
    """A back-edge: from under its source, dipping below the nodes, up into its target."""
    x1, y1 = a[0] + NODE_W * 0.65, a[1] + NODE_H
    x2, y2 = b[0] + NODE_W * 0.35, b[1] + NODE_H
    low = max(y1, y2) + depth
    return (f"M {x1:.1f} {y1:.1f} C {x1:.1f} {low:.1f}, {x2:.1f} {low:.1f}, "
            f"{x2:.1f} {y2 + 2:.1f}")
