"""The geometry of a run's timeline chart (drawn as inline SVG by ``templates/run.html``).

One row per step, left to right from the run's start to its end (or now). Each attempt is
a bar from its claim to its settle, classed by outcome (``succeeded``, ``failed``,
``superseded``, ``lease-expired``, ``cancelled``, ``running``); a superseded attempt ends
where the next attempt's claim fenced it out and carries a mark. Waits (``wf.sleep``, a
suspension, an approval gate, an event wait, a child run, the time before the first claim
and between attempts) are drawn as gaps: an outline or a dashed line, never a bar; a
``wf.set_event`` publish is a mark at the moment it was published. Nothing here is
escaped: the template does that (every label is user data).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pikku_celery.operate._text import error_line, format_duration, format_time
from pikku_celery.operate.timeline import SELF_NAMED, AttemptView, StepView, Timeline, Wait

WIDTH = 1000
LABEL_W = 200
RIGHT_PAD = 16
ROW_H = 30
BAR_H = 16
TOP = 28  # room for the axis labels
MIN_BAR_W = 3.0
TICKS = 5


@dataclass(frozen=True)
class Bar:
    x: float
    w: float
    attempt: int
    outcome: str
    title: str

    @property
    def superseded(self) -> bool:
        return self.outcome == "superseded"


@dataclass(frozen=True)
class Gap:
    x: float
    w: float
    kind: str  # sleep, suspension, approval, event, publish, child, queued, retry
    title: str

    @property
    def outlined(self) -> bool:
        """A wait that is the step itself (drawn as an outline); else a dashed line."""
        return self.kind in ("sleep", "suspension", "approval", "event", "publish", "child")


@dataclass(frozen=True)
class Row:
    step: str  # the stored name (``__approval:manager``)
    label: str  # the name shown (``manager``, ``event paid``)
    kind: str
    status: str
    y: float
    bars: list[Bar]
    gaps: list[Gap]
    child_run_id: str | None

    @property
    def tag(self) -> str | None:
        """The kind shown after the label, when the label does not name it already."""
        return None if self.kind == "step" or self.kind in SELF_NAMED else self.kind


@dataclass(frozen=True)
class Tick:
    x: float
    label: str


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    plot_x: int
    plot_w: int
    rows: list[Row]
    ticks: list[Tick]
    bar_h: int = BAR_H


def chart(timeline: Timeline) -> Chart:
    span_s = max((timeline.end - timeline.start).total_seconds(), 0.001)
    plot_w = WIDTH - LABEL_W - RIGHT_PAD

    def x_of(moment: datetime) -> float:
        offset = (moment - timeline.start).total_seconds() / span_s
        return round(LABEL_W + min(max(offset, 0.0), 1.0) * plot_w, 2)

    def width(start: datetime, end: datetime) -> float:
        return round(max(x_of(end) - x_of(start), 0.0), 2)

    rows = []
    for i, step in enumerate(timeline.steps):
        bars = [Bar(x_of(a.started_at), max(width(a.started_at, a.ended_at or timeline.end),
                                            MIN_BAR_W),
                    a.attempt, a.outcome, _bar_title(step.state.step_name, a))
                for a in step.attempts
                if a.started_at is not None and step.kind == "step"]
        gaps = [Gap(x_of(w.start), width(w.start, w.end), w.kind, _gap_title(step, w))
                for w in step.waits]
        status = (step.gate.status if step.gate is not None
                  else step.event_wait.status if step.event_wait is not None
                  else step.state.status)
        rows.append(Row(step.state.step_name, step.label, step.kind, status,
                        TOP + i * ROW_H, bars, gaps, step.state.child_run_id))
    span = timeline.end - timeline.start
    ticks = [Tick(LABEL_W + plot_w * k / (TICKS - 1),
                  "+" + format_duration(span * k / (TICKS - 1)))
             for k in range(TICKS)]
    return Chart(WIDTH, TOP + max(len(rows), 1) * ROW_H + 8, LABEL_W, plot_w, rows, ticks)


def _gap_title(step: StepView, wait: Wait) -> str:
    took = format_duration(wait.end - wait.start) + (" so far" if wait.open else "")
    if step.event_wait is not None:
        event = step.event_wait
        return (f"{event.describe()}: {took}" if wait.open
                else f"event {event.name!r} {event.status} after {took}")
    if wait.kind == "publish":
        return f"{step.label} at {format_time(wait.start)}"
    return f"{wait.kind}: {took}"


def _bar_title(step: str, attempt: AttemptView) -> str:
    parts = [f"{step} attempt {attempt.attempt}: {attempt.outcome}",
             f"started {format_time(attempt.started_at)}",
             f"took {format_duration(attempt.duration)}"]
    if attempt.worker:
        parts.append(f"worker {attempt.worker}")
    if attempt.error:
        parts.append(error_line(attempt.error, limit=200))
    return "\n".join(parts)
