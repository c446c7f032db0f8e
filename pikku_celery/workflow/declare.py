"""What the declarations of ``PikkuCelery`` and ``shared_workflow`` build, outside the
class: a workflow function with its definition attached, and a graph's workflow."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

from pikku_celery.model.errors import InvalidInputError
from pikku_celery.workflow._graph_rounds import run_graph
from pikku_celery.workflow.definitions import (
    StepDefinition,
    WorkflowDefinition,
    make_workflow,
)
from pikku_celery.workflow.graph import build_graph
from pikku_celery.workflow.replay import WorkflowContext
from pikku_celery.workflow.typed import P, R, Workflow


def attach_workflow(fn: Callable[P, R], definition: WorkflowDefinition) -> Workflow[P, R]:
    """``fn`` itself, its definition attached as ``fn.pikku_workflow``."""
    fn.pikku_workflow = definition  # type: ignore[attr-defined]
    return cast("Workflow[P, R]", fn)


def graph_definition(name: str, nodes: Mapping[str, Any], edges: Sequence[tuple[str, str]],
                     branch: Mapping[str, Callable[[Any], Iterable[str]]] | None,
                     on_error: Mapping[str, str] | None, for_each: Mapping[str, Any] | None,
                     max_visits: Mapping[str, int] | None) -> WorkflowDefinition:
    """The workflow of a graph (``PikkuCelery.graph``): every node must be a pikku step."""
    spec = build_graph(name, nodes, edges, branch, on_error, for_each, max_visits)
    for node, step in spec.nodes.items():
        if not isinstance(getattr(step, "pikku_step", None), StepDefinition):
            raise InvalidInputError(f"graph {name!r}: node {node!r} is not a pikku step")

    def graph_workflow(wf: WorkflowContext, data: Any) -> dict[str, Any]:
        return run_graph(spec, wf, data)

    return make_workflow(graph_workflow, name, source=spec.describe())
