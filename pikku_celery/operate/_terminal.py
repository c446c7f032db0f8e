"""How the ``pikku`` commands draw runs in a terminal (rich): the runs table, a run's
header and its per-attempt timeline, and the progress line of ``watch``.

Values are user data: every cell is a ``rich.text.Text`` (never markup), so a run input
holding ``[bold]`` or an escape sequence prints as written.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from pikku_celery.model.records import (
    LINEAGE_FORK,
    QueuedReason,
    WorkflowRun,
    WorkflowSchedule,
)
from pikku_celery.operate._text import error_line, format_duration, format_time
from pikku_celery.operate.schedule_views import NOT_DECLARED, PAUSED, state_text, timing_text
from pikku_celery.operate.timeline import (
    SELF_NAMED,
    AttemptView,
    EventWaitView,
    GateView,
    SentEvent,
    StepView,
    Timeline,
    approve_command,
    send_command,
)

STATUS_STYLE = {"completed": "green", "succeeded": "green", "failed": "red",
                "lease-expired": "red", "cancelled": "yellow", "superseded": "magenta",
                "running": "cyan", "suspended": "blue", "pending": "dim",
                "queued": "bright_black", "paused": "yellow", "active": "green",
                "scheduled": "blue", "waiting": "blue", "decided": "green",
                "expired": "yellow", "expiry-passed": "yellow", "received": "green",
                "timed-out": "yellow", "not taken yet": "blue", "published": "green"}
MAX_VALUE_CHARS = 2000
SUPERSEDED_MARK = "superseded ⟲"
#: The width of a console that is not a terminal (a pipe, a file): wide enough that no
#: column is ever cut, so ``pikku runs | grep`` sees whole ids, times and errors.
PIPE_WIDTH = 1_000_000
#: An error's one line in ``runs``: cut on a terminal, whole in a pipe.
TERMINAL_ERROR_CHARS = 120
PIPE_ERROR_CHARS = 100_000


def console(*, stderr: bool = False) -> Console:
    """A console on the current stdout (click's test runner swaps it). When the output is
    not a terminal it is as wide as its widest line: nothing is cut or folded."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if is_terminal(stream) else PIPE_WIDTH
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def status_text(status: str) -> Text:
    return Text(status, style=STATUS_STYLE.get(status, ""))


def value_text(value: Any) -> str:
    """A value as compact JSON, cut at ``MAX_VALUE_CHARS``."""
    shown = json.dumps(value, default=str, ensure_ascii=False)
    return shown if len(shown) <= MAX_VALUE_CHARS else shown[:MAX_VALUE_CHARS] + "…"


def runs_table(runs: list[WorkflowRun], *, whole: bool = False,
               queued: Mapping[str, QueuedReason] | None = None) -> Table:
    """One line per run; ``whole``: every value in full (the output is not a terminal);
    ``queued``: why the queued runs wait, by run id (a column when there are any)."""
    limit = PIPE_ERROR_CHARS if whole else TERMINAL_ERROR_CHARS
    table = Table(box=None, pad_edge=False, header_style="bold")
    # Ids are never cut: the error column gives way.
    table.add_column("run id", no_wrap=True, min_width=max(len(r.run_id) for r in runs))
    for name in ("workflow", "status", "created (UTC)", "updated (UTC)"):
        table.add_column(name, no_wrap=True)
    # Only when a run of the page was started by a schedule: its name and tick.
    scheduled = any(r.schedule is not None for r in runs)
    if scheduled:
        table.add_column("schedule", no_wrap=True)
        table.add_column("scheduled for (UTC)", no_wrap=True)
    if queued:
        table.add_column("waits for", overflow="fold")
    table.add_column("error", no_wrap=True, overflow="ellipsis")  # one line per run
    for run in runs:
        cells: list[Text | str] = [
            Text(run.run_id), Text(run.workflow), status_text(run.status),
            format_time(run.created_at), format_time(run.updated_at)]
        if scheduled:
            cells += [Text(run.schedule or "-"), format_time(run.scheduled_for)]
        if queued:
            why = queued.get(run.run_id)
            cells.append(Text("-" if why is None else why.describe().removeprefix(
                "waits for ")))
        table.add_row(*cells, Text(error_line(run.error, limit=limit)))
    return table


def schedules_table(schedules: list[WorkflowSchedule]) -> Table:
    """One line per schedule: name, workflow, timing, time zone, catch-up, state (paused
    or active; ``not declared`` when this code no longer declares it), the next tick (none
    while paused: resuming picks the first tick after the resume), the latest tick and
    the run it started. Never cut (names and run ids are what is grepped)."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("schedule", "workflow", "timing", "tz", "catch up", "state",
                 "next tick (UTC)", "last tick (UTC)", "last run"):
        table.add_column(name, no_wrap=True)
    for found in schedules:
        state = Text(state_text(found), style=STATUS_STYLE.get(
            PAUSED if found.paused else "active", ""))
        if not found.declared:
            state.stylize("dim", len(state) - len(NOT_DECLARED))
        table.add_row(Text(found.name), Text(found.workflow), Text(timing_text(found)),
                      Text(found.tz), Text(found.catch_up), state,
                      "-" if found.paused else format_time(found.next_at),
                      format_time(found.last_at), Text(found.last_run_id or "-"))
    return table


def lineage_rows(run: WorkflowRun, forks: Sequence[WorkflowRun] = ()
                 ) -> list[tuple[str, Text | str]]:
    """Where the run came from and what was done to it: the fork that made it (its
    source, step, who and when), each retry (who and when), and the runs forked from it."""
    rows: list[tuple[str, Text | str]] = []
    for entry in run.lineage:
        who = f" by {entry.by}" if entry.by else ""
        when = entry.at.strftime("%Y-%m-%d %H:%M:%S")
        if entry.op == LINEAGE_FORK:
            kept = ", decisions kept" if entry.keep_decisions else ""
            rows.append(("forked from", Text(f"{entry.run_id} at step {entry.from_step!r} "
                                             f"({when}{who}{kept})")))
        else:
            rows.append(("retried", Text(f"{when}{who}")))
    if run.forked_from is not None and not any(e.op == LINEAGE_FORK for e in run.lineage):
        rows.append(("forked from", Text(run.forked_from)))
    if forks:
        rows.append(("forks", Text(", ".join(f.run_id for f in forks))))
    return rows


def run_header(timeline: Timeline, *, tracebacks: bool = False,
               forks: Sequence[WorkflowRun] = ()) -> Table:
    run = timeline.run
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    rows: list[tuple[str, Text | str]] = [
        ("run", Text(run.run_id)),
        ("workflow", Text(f"{run.workflow}" + (f" (version {run.version})"
                                               if run.version else ""))),
        ("status", status_text(run.status)),
        ("created", format_time(run.created_at)),
        ("ended" if run.is_terminal else "updated", format_time(run.updated_at)),
        ("took" if run.is_terminal else "so far",
         format_duration(timeline.end - timeline.start)),
    ]
    if run.parent_run_id:
        rows.append(("parent", Text(f"{run.parent_run_id} (step {run.parent_step_name})")))
    if run.schedule is not None:
        rows.append(("schedule", Text(run.schedule)))
        rows.append(("scheduled for", format_time(run.scheduled_for)))
    if run.cancel_reason:
        rows.append(("cancel reason", Text(run.cancel_reason)))
    if timeline.queued is not None:
        rows.append(("queued", Text(timeline.queued.describe(), style="yellow")))
    rows.extend(lineage_rows(run, forks))
    rows.append(("input", Text(value_text(run.input))))
    if run.state_version:
        rows.append((f"state (v{run.state_version})", Text(value_text(dict(run.state)))))
    if run.status == "completed":
        rows.append(("output", Text(value_text(run.output))))
    if run.error:
        rows.append(("error", Text(error_line(run.error, limit=1000), style="red")))
        if tracebacks and run.error.get("traceback"):
            rows.append(("traceback", Text(str(run.error["traceback"]).rstrip())))
    for label, value in rows:
        grid.add_row(label, value)
    return grid


def attempts_table(timeline: Timeline, *, tracebacks: bool = False) -> Table:
    """One row per attempt of every step (a step with none yet: one row, its status)."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("step", "attempt", "status", "worker", "started (UTC)", "took"):
        table.add_column(name, no_wrap=True)
    table.add_column("error", overflow="fold")
    for step in timeline.steps:
        label = Text(step.label)
        if step.kind != "step" and step.kind not in SELF_NAMED:
            label.append(f" ({step.kind})", style="dim")
        if not step.attempts:
            table.add_row(label, "-", status_text(_step_status(step)), "", "", "", "")
        for attempt in step.attempts:
            # The total the attempt ran under: a retry raises the step's, not its past.
            total = attempt.max_attempts or step.state.max_attempts
            table.add_row(label, f"{attempt.attempt}/{total}",
                          _outcome(attempt), Text(attempt.worker or "-"),
                          format_time(attempt.started_at),
                          format_duration(attempt.duration),
                          _error(attempt, tracebacks))
    return table


def _step_status(step: StepView) -> str:
    if step.gate is not None:
        return step.gate.status
    if step.event_wait is not None:
        return step.event_wait.status
    return step.state.status


def gates_table(timeline: Timeline) -> Table | None:
    """The run's approval gates (``wf.approval``): name (as ``approve`` takes it), status,
    approvers, expiry, schema, and the decision once made; ``None`` when it has none."""
    gates = timeline.gates
    if not gates:
        return None
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left",
                  title="approvals", title_style="bold")
    for name in ("approval", "status", "approvers", "expires (UTC)"):
        table.add_column(name, no_wrap=True)
    table.add_column("schema", overflow="fold")
    table.add_column("decision", overflow="fold")
    for gate in gates:
        table.add_row(Text(gate.name), status_text(gate.status),
                      Text(", ".join(gate.approvers) if gate.approvers is not None
                           else "anyone"),
                      format_time(gate.expires_at) if gate.expires_at else "never",
                      Text("any" if gate.schema is None else value_text(gate.schema)),
                      _decision(gate))
    return table


def event_waits_table(timeline: Timeline) -> Table | None:
    """The run's event waits (``wf.wait_for_event``) and what it published
    (``wf.set_event``): each wait's event, status, timeout and the event it took (its seq
    and payload); each publish's key and value. ``None`` when it has neither."""
    waits, published = timeline.event_waits, timeline.published
    if not waits and not published:
        return None
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left",
                  title="event waits and publishes", title_style="bold")
    for name in ("step", "status", "times out (UTC)", "seq"):
        table.add_column(name, no_wrap=True)
    table.add_column("payload / value", overflow="fold")
    for wait in waits:
        table.add_row(Text(wait.label), status_text(wait.status),
                      format_time(wait.expires_at) if wait.expires_at else "never",
                      "-" if wait.seq is None else str(wait.seq), _taken(wait))
    for value in published:
        table.add_row(Text(value.label), status_text("published"), "", "",
                      Text(value_text(value.value)))
    return table


def _taken(wait: EventWaitView) -> Text:
    if wait.status == "received":
        return Text(value_text(wait.payload))
    return Text("-")


def events_table(events: list[SentEvent], *, whole: bool = False) -> Table:
    """The events sent to a run, in the order sent: seq, name, when, key, the wait that
    took it (or ``not taken yet``) and its payload; ``whole``: the payload in full (the
    output is not a terminal)."""
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left",
                  title="events", title_style="bold")
    for name in ("seq", "event", "sent (UTC)", "key", "taken by"):
        table.add_column(name, no_wrap=True)
    table.add_column("payload", no_wrap=whole, overflow="fold")
    for sent in events:
        event = sent.event
        payload = json.dumps(event.payload, default=str, ensure_ascii=False) if whole \
            else value_text(event.payload)
        table.add_row(str(event.seq), Text(event.name), format_time(event.sent_at),
                      Text(event.key or "-"),
                      Text(sent.taken_by) if sent.taken_by else status_text("not taken yet"),
                      Text(payload))
    return table


def send_hint(run_id: str, wait: EventWaitView) -> Text:
    """How to send the event the run waits for."""
    return Text(f"{wait.describe()}: send it with `{send_command(run_id, wait)}`")


def compensations_table(timeline: Timeline) -> Table | None:
    """The run's compensations (``wf.do(..., on_error=...)``): the step that failed, the
    compensation step that ran for it (``<step>:on_error``), its status and its result
    (or error); ``None`` when it has none."""
    found = timeline.compensations
    if not found:
        return None
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left",
                  title="compensations", title_style="bold")
    for name in ("failed step", "compensation", "status"):
        table.add_column(name, no_wrap=True)
    table.add_column("result", overflow="fold")
    for comp in found:
        if comp.status == "succeeded":
            outcome = Text(value_text(comp.result))
        elif comp.error:
            outcome = Text(error_line(comp.error, limit=1000), style="red")
        else:
            outcome = Text("-")
        table.add_row(Text(comp.for_step), Text(comp.function or comp.step.step_name),
                      status_text(comp.status), outcome)
    return table


def _decision(gate: GateView) -> Text:
    if gate.status != "decided":
        return Text("-")
    text = Text(value_text(gate.decision))
    if gate.decided_by:
        text.append(f" by {gate.decided_by}", style="dim")
    return text


def decided_line(run_id: str, name: str, decision: Any, gate_data: Any) -> str:
    """What ``pikku approve`` prints once the decision is recorded: ``rejected`` for a
    decision that says no (``decided_verb``), else ``approved``; ``gate_data`` is the
    settled gate's ``data`` (its schema)."""
    data = gate_data if isinstance(gate_data, dict) else {}
    text = data.get("schema_json")  # "schema": a gate an earlier version recorded
    try:
        schema = json.loads(text) if isinstance(text, str) else data.get("schema")
    except ValueError:
        schema = None
    return (f"{decided_verb(decision, schema)} {name!r} of run {run_id}: "
            f"{json.dumps(decision, sort_keys=True)}")


def decided_verb(decision: Any, schema: Any = None) -> str:
    """``rejected`` for a decision that says no: ``false``, ``{"approved": false}``, or
    an object whose only boolean property in the gate's ``schema`` is ``false`` (the
    dashboard's Reject button); ``approved`` for any other decision."""
    if decision is False:
        return "rejected"
    if isinstance(decision, dict):
        said = ["approved"]
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if isinstance(properties, dict):
            booleans = [k for k, v in properties.items()
                        if isinstance(v, dict) and v.get("type") == "boolean"]
            said += booleans if len(booleans) == 1 else []
        if any(decision.get(key) is False for key in said):
            return "rejected"
    return "approved"


def approve_hint(run_id: str, gate: GateView) -> Text:
    """How to decide the gate the run waits on."""
    return Text(f"waiting for approval {gate.name!r}: decide it with "
                f"`{approve_command(run_id, gate)}`")


def _outcome(attempt: AttemptView) -> Text:
    if attempt.superseded:
        return Text(SUPERSEDED_MARK, style="bold magenta")
    return status_text(attempt.outcome)


def _error(attempt: AttemptView, tracebacks: bool) -> Text:
    text = Text(error_line(attempt.error))
    if tracebacks and attempt.error and attempt.error.get("traceback"):
        text.append("\n" + str(attempt.error["traceback"]).rstrip(), style="dim")
    return text


def progress_line(timeline: Timeline) -> Text:
    run = timeline.run
    line = Text("run ")
    line.append(run.run_id)
    line.append(" ")
    line.append_text(status_text(run.status))
    line.append(f": {timeline.progress()}, {format_duration(timeline.end - timeline.start)}")
    return line


def step_progress_table(timeline: Timeline) -> Table | None:
    """What each running step's attempt said of its progress (``ctx.progress``)."""
    moving = [s for s in timeline.steps
              if s.state.status == "running" and s.state.progress is not None]
    if not moving:
        return None
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("running step", "attempt", "progress", "said at (UTC)"):
        table.add_column(name, overflow="fold")
    for step in moving:
        table.add_row(Text(step.label), str(step.state.attempt),
                      Text(value_text(step.state.progress)),
                      format_time(step.state.progress_at))
    return table


def live_view(timeline: Timeline) -> RenderableType:
    moving = step_progress_table(timeline)
    return Group(*([] if moving is None else [moving]), attempts_table(timeline),
                 progress_line(timeline))
