"""The dashboard's pages, free of any web framework (the adapters in ``flask.py`` and
``django.py`` authorize, read the request and send what this returns).

Everything shown passes through Jinja2 with autoescaping on: run inputs, outputs, errors
and step names are user data. Errors are shown as the JSON API serves them (type and
message; tracebacks only with ``PIKKU_SHOW_TRACEBACKS``), and values through the
``redact_value`` hook (the ``shown`` filter; the pages' ``redact``). Each page costs a
bounded number of index-served reads: the runs page one page of runs (``limit`` at most
200) and one count per status that stops at ``COUNT_LIMIT``; a run page the run, its steps
and its history, of which it shows ``STEPS_PER_PAGE`` steps (``?steps_after=<step name>``
pages on), so it stays small with thousands of steps.

What a caller may read is the JSON API's rule (``contrib._api.readable_page`` and
``readable_run``): the runs page and its counts are queried with the caller's run filter,
and a run it refuses is left out or unknown. A button's outcome comes back as a fixed
``?notice=`` code (``NOTICES``): the page never shows text taken from its address.

The runs page also narrows by creation time (``?created_after=``, ``?created_before=``:
part of the store query) and by run id prefix (``?run_id=``: the store has no such
filter, so the runs read are filtered, at most ``_api.MAX_SEARCHED`` for one page; see
``_api.readable_search``). A run page draws a graph workflow's graph (``graph_view``)
and offers each step's input and result on demand: a ``<details>`` whose script reads
the JSON API's ``api/runs/<run_id>/steps/<step_name>`` when it is opened, so a page with
hundreds of steps carries none of their values.

Approval gates (``wf.approval``) are shown as gates: name, approvers, expiry, schema, and
the decision once made. A gate the run waits on gets a decision form (``decide``) made
from its schema (``_decision``: a boolean as Approve / Reject buttons, an enum as a
choice, strings and numbers as fields; JSON typed in a textarea for what a form cannot
show), the decision checked against the gate's schema and approvers by ``pikku.approve``
(the JSON API's path), recorded as given by the caller the adapter identifies, authorized
as the ``approve`` action told the gate, and CSRF-checked like the buttons; a refused
decision re-renders the page with the refusal and the decision as typed (409). A run
waiting at an approval is not offered Resume, which does not open an approval.

The events sent to the run are listed with the wait that took each (or "not taken yet"),
paged and with their payloads read on demand (``_events``), and a live run gets a Send
event form (``_events``: action ``send_event``), whose refusal re-renders the page with
the reason and what was typed (400 bad input, 409 an ended run).
A run waiting at an event wait only is not offered Resume either.

A run a schedule started shows the schedule (linked to the Schedules page,
``_schedules``) and its tick (``scheduled_for``), on its page and in the runs list.

A failed or cancelled run gets a Retry button (``pikku.retry``, action ``retry``), and a
run with recorded steps a Fork form (``pikku.fork``, action ``fork`` on the run forked
from): a step of the run to fork from and an optional new run id (``check_run_id``). A
fork goes to the new run's page; an unknown step, a bad or taken id come back as notices.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, PackageLoader, StrictUndefined, pass_context

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib._access import (
    APPROVE,
    CANCEL,
    FORK,
    READ,
    RESUME,
    RETRY,
    SEND_EVENT,
    Caller,
)
from pikku_celery.contrib._api import ApiError, ApiOptions, parse_body
from pikku_celery.contrib._json import present
from pikku_celery.contrib._json import shown as shown_value
from pikku_celery.contrib._readable import (
    MAX_SEARCHED,
    RunSearch,
    readable_count,
    readable_forks,
    readable_page,
    readable_queued,
    readable_run,
    readable_search,
)
from pikku_celery.dashboard._decision import (
    Refusal,
    form_of,
    gate_form,
    read,
    schema_of,
)
from pikku_celery.dashboard._decision import typed as typed_fields
from pikku_celery.dashboard._events import (
    EventRefusal,
    TypedEvent,
    event_form,
    events_page,
    refusal_status,
)
from pikku_celery.dashboard._http import (
    MAX_FORM_BYTES,
    PageError,
    check_form,
    security_headers,
)
from pikku_celery.dashboard.chart import chart
from pikku_celery.dashboard.graph_view import draw, graph_of
from pikku_celery.engine.forks import kept_approvals
from pikku_celery.model.errors import (
    InvalidInputError,
    PikkuConfigurationError,
    WorkflowApprovalError,
    WorkflowEventError,
    WorkflowEventNotSentError,
    WorkflowNotFoundError,
    WorkflowRunConflictError,
    WorkflowRunNotFoundError,
)
from pikku_celery.model.records import RUN_CANCELLED, RUN_FAILED, RUN_STATUSES, RUN_SUSPENDED
from pikku_celery.model.validate import check_name, check_run_id
from pikku_celery.operate._text import error_line, format_duration, format_time
from pikku_celery.operate.timeline import Timeline, build

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

log = logging.getLogger("pikku_celery.contrib")

DEFAULT_LIMIT = 50
MAX_LIMIT = 200
COUNT_LIMIT = 10_000
MAX_SHOWN_CHARS = 64 * 1024  # of one value: the API serves the whole of it
MAX_REASON_CHARS = 500
REFRESH_S = 5
STEPS_PER_PAGE = 100
ACTIONS = (CANCEL, RESUME, RETRY, FORK)
RETRYABLE = (RUN_FAILED, RUN_CANCELLED)
#: Steps whose input and result the run page offers on demand (from the JSON API's
#: ``api/runs/<run_id>/steps/<step_name>``): a step's body, or a child run's.
VALUE_KINDS = ("step", "child")
#: ``?notice=<code>`` after a button: the page shows the text of a known code, nothing else.
NOTICES = {
    "cancelled": "run cancelled",
    "resumed": "run resumed",
    "not-cancelled": "nothing to cancel: the run has already ended",
    "not-resumed": "nothing to resume: the run is not suspended",
    "not-resumed-approval": "nothing to resume: the run waits for an approval, which "
                            "resume does not open; decide it below",
    "not-resumed-event": "nothing to resume: the run waits for an event, which resume "
                         "does not send; send it below",
    "event-sent": "event sent",
    "decided": "decision recorded",
    "retried": "run retried: it runs again from where it stopped",
    "not-retried": "nothing to retry: only a failed or cancelled run can be retried",
    "forked": "run forked: this is the new run",
    "fork-unknown-step": "not forked: the run recorded no such step; pick one of its steps",
    "fork-bad-run-id": "not forked: a new run id is 1 to 200 ASCII letters, digits and "
                       "- _ . : + = ~ @ (not @ first), or empty for a generated one",
    "fork-run-id-taken": "not forked: that run id is taken by another run (not this fork "
                         "of this run)",
    "fork-keep-refused": "not forked: keeping the run's decisions needs the right to approve "
                         "each approval it copies; fork without keeping them to ask again",
    "triggered": "run started: its schedule was triggered (the schedule's ticks go on)",
}
DONE = {CANCEL: ("cancelled", "not-cancelled"), RESUME: ("resumed", "not-resumed"),
        RETRY: ("retried", "not-retried")}


@dataclass(frozen=True)
class Page:
    status: int
    html: str = ""
    redirect: str | None = None


@dataclass(frozen=True)
class View:
    """What an adapter knows of the request: where the dashboard is mounted (``base``,
    ending in ``/``), the query string, the caller (what they may do and read), the CSRF
    form field (``None``: no forms), the CSP nonce of the page's script, and the origins
    trusted to POST from another site."""

    base: str
    query: Mapping[str, str]
    caller: Caller
    csrf: tuple[str, str] | None
    nonce: str
    trusted_origins: Collection[str] = ()

    def can(self, action: str, run_id: str | None, gate: str | None = None,
            **about: Any) -> bool:
        return self.caller.can(action, run_id, gate, **about)


def pretty(value: Any) -> str:
    shown = json.dumps(value, indent=2, ensure_ascii=False, default=str, sort_keys=True)
    if len(shown) > MAX_SHOWN_CHARS:
        return shown[:MAX_SHOWN_CHARS] + "\n… (cut: the JSON API serves the whole value)"
    return shown


def segment(value: str) -> str:
    """``value`` as one path segment of a URL: a run id can hold ``#``, ``?``, ``%`` or
    ``/``, which would end the path or change its meaning if put there as it is."""
    return quote(value, safe="")


def _environment() -> Environment:
    env = Environment(loader=PackageLoader("pikku_celery.dashboard", "templates"),
                      autoescape=True, undefined=StrictUndefined, trim_blocks=True,
                      lstrip_blocks=True)
    env.filters.update(duration=format_duration, time=format_time, pretty=pretty,
                       error=lambda error, limit=300: error_line(error, limit=limit),
                       segment=segment, shown=pass_context(
                           lambda page, value, where: shown_value(value, where, page["redact"])))
    return env


ENV = _environment()


class Dashboard:
    def __init__(self, pikku: PikkuCelery, options: ApiOptions) -> None:
        self.pikku = pikku
        self.options = options

    # --- pages ------------------------------------------------------------------------

    def runs_page(self, view: View) -> Page:
        return self._page(view.base, lambda: self._runs(view))

    def run_page(self, view: View, run_id: str) -> Page:
        return self._page(view.base, lambda: self._run(view, run_id))

    def act(self, view: View, run_id: str, action: str, form: Mapping[str, str]) -> Page:
        """A button's POST (authorized and CSRF-checked by the adapter): do it, then send
        the browser back to the run page."""
        def act() -> Page:
            check_name("run id", run_id)
            readable_run(self.pikku, view.caller, run_id)
            if action == FORK:
                return self._fork(view, run_id, form)
            if action == CANCEL:
                reason = (form.get("reason") or "").strip()[:MAX_REASON_CHARS] or None
                done = self.pikku.cancel(run_id, reason or "cancelled from the dashboard")
            elif action == RETRY:
                # False for a run neither failed nor cancelled; by: the run's lineage.
                done = self.pikku.retry(run_id, by=view.caller.name())
            elif (waits := _only_gate_waits(self._timeline(run_id))) is not None:
                return _back(view, run_id, waits)  # it would wake for nothing
            else:
                done = self.pikku.resume(run_id)
            return _back(view, run_id, DONE[action][0 if done else 1])
        return self._page(view.base, act)

    def _fork(self, view: View, run_id: str, form: Mapping[str, str]) -> Page:
        """The Fork form: ``pikku.fork`` from a step the run recorded, under the new run
        id typed (``None``: one is generated), then the new run's page. "Keep decisions"
        (copy the approvals and event waits) needs ``approve`` of each approval copied,
        as in the JSON API; the caller is the fork's ``by``."""
        step = form.get("from_step") or ""
        keep = form.get("keep_decisions") == "on"
        new_run_id = (form.get("run_id") or "").strip() or None
        if new_run_id is not None:
            try:
                check_run_id(new_run_id)
            except InvalidInputError:
                return _back(view, run_id, "fork-bad-run-id")
        steps = self.pikku.get_steps(run_id)
        if step not in {s.step_name for s in steps}:
            return _back(view, run_id, "fork-unknown-step")
        gates: list[str | None] = [*kept_approvals(run_id, steps, step)] if keep else []
        if keep and not all(view.can(APPROVE, run_id, gate) for gate in gates or [None]):
            return _back(view, run_id, "fork-keep-refused")
        try:
            forked = self.pikku.fork(run_id, from_step=step, new_run_id=new_run_id,
                                     keep_decisions=keep, by=view.caller.name())
        except WorkflowRunConflictError:
            return _back(view, run_id, "fork-run-id-taken")
        return _back(view, forked, "forked")

    def decide(self, view: View, run_id: str, gate: str, form: Mapping[str, str]) -> Page:
        """A decision form's POST (authorized for ``approve`` on ``gate`` and CSRF-checked
        by the adapter): ``pikku.approve`` with the caller as the approver; a refusal
        (schema, approvers, no longer waiting) or a decision that is not JSON re-renders
        the run page with the reason."""
        def decide() -> Page:
            check_name("run id", run_id)
            check_name("approval name", gate)
            readable_run(self.pikku, view.caller, run_id)
            typed = (form.get("decision") or "").strip()
            fields: dict[str, str] = {}
            try:
                if "decision" in form:  # typed as JSON
                    decision = parse_body(typed)
                    if not typed:
                        raise InvalidInputError("no decision was given: type one, as JSON")
                else:  # the fields of the gate's schema
                    shape = form_of(schema_of(self._timeline(run_id).gates, run_id, gate))
                    fields = typed_fields(shape, form)
                    decision = read(shape, form)
                self.pikku.approve(run_id, gate, decision, by=view.caller.name())
            except (ApiError, InvalidInputError, WorkflowApprovalError) as exc:
                message = exc.message if isinstance(exc, ApiError) else str(exc)
                status = 409 if isinstance(exc, WorkflowApprovalError) else 400
                return self._run(view, run_id, Refusal(gate, message, typed, fields), status)
            return _back(view, run_id, "decided")
        return self._page(view.base, decide)

    def send_event(self, view: View, run_id: str, form: Mapping[str, str]) -> Page:
        """The Send event form's POST (authorized for ``send_event`` and CSRF-checked by
        the adapter, which asks without the event: its name is typed in the form), then
        authorized again told the event typed; ``pikku.send_event``; a refusal (that
        name, a payload that is not JSON, a bad name or key, a run that has ended, a
        store that kept failing) re-renders the run page with the reason."""
        def send() -> Page:
            check_name("run id", run_id)
            readable_run(self.pikku, view.caller, run_id)
            typed = TypedEvent.of(form)
            try:
                view.caller.check(SEND_EVENT, run_id, event=typed.name)
                self.pikku.send_event(run_id, typed.name, typed.value(),
                                      key=typed.key or None)
            except (ApiError, InvalidInputError, WorkflowEventError,
                    WorkflowEventNotSentError) as exc:
                # Not sent: the store kept failing, and the reason says whether the event
                # may have been kept (a key makes sending it again safe).
                status = exc.status if isinstance(exc, ApiError) else refusal_status(exc)
                message = exc.message if isinstance(exc, ApiError) else str(exc)
                return self._run(view, run_id, status=status,
                                 event_refusal=EventRefusal(message, typed))
            return _back(view, run_id, "event-sent")
        return self._page(view.base, send)

    def refusal(self, caller: Caller, action: str, run_id: str | None, home: str,
                login_url: Callable[[], str] | None = None,
                about: Mapping[str, str] | None = None) -> Page | None:
        """The page refusing ``caller`` the ``action`` (told ``about``: the gate of an
        approval, the schedule acted on; ``_access.named``), or ``None`` when they may."""
        try:
            caller.check(action, run_id, **(about or {}))
        except ApiError as exc:
            login = login_url() if exc.status == 401 and login_url is not None else None
            return self.refused(exc.status, exc.message, home, login)
        return None

    def refused(self, status: int, message: str, home: str,
                login_url: str | None = None) -> Page:
        title = "Log in" if status == 401 else "Not allowed"
        return Page(status, ENV.get_template("refused.html").render(
            title=title, message=message, login_url=login_url, status=status, home=home))

    # --- what the pages show ----------------------------------------------------------

    def _runs(self, view: View) -> Page:
        query = view.query
        workflow = query.get("workflow") or None
        status = query.get("status") or None
        if workflow is not None:
            check_name("workflow name", workflow)
        if status is not None and status not in RUN_STATUSES:
            raise InvalidInputError(f"unknown run status {status!r}")
        limit = _limit(query.get("limit"))
        before = query.get("before") or None
        search, typed = _search(query)
        gave_up = False
        if search.narrows:
            runs, more, gave_up = readable_search(
                self.pikku, view.caller, search, workflow=workflow, status=status,
                limit=limit, before=before)
        else:
            runs, more = readable_page(self.pikku, view.caller, workflow=workflow,
                                       status=status, limit=limit, before=before)
        counts = {s: readable_count(self.pikku, view.caller, s, workflow=workflow,
                                    limit=COUNT_LIMIT) for s in RUN_STATUSES}
        exact = None
        if search.prefix is not None and search.prefix not in {r.run_id for r in runs}:
            exact = self._exact(view, search.prefix)

        def link(**changes: str | None) -> str:
            params = {"workflow": workflow, "status": status, "limit": (
                str(limit) if limit != DEFAULT_LIMIT else None), **typed, **changes}
            kept = {k: v for k, v in params.items() if v}
            return view.base + ("?" + urlencode(kept) if kept else "")

        return Page(200, ENV.get_template("runs.html").render(
            view=view, home=view.base, records=runs,
            runs=[present(r, show_tracebacks=False) for r in runs],
            counts=counts, count_limit=COUNT_LIMIT, workflow=workflow, status=status,
            workflows=sorted(self.pikku.registry.workflows), statuses=RUN_STATUSES,
            older=link(before=more) if more else None,
            newest=link() if before else None, link=link, refresh_s=REFRESH_S,
            now=datetime.now(UTC), typed=typed, searched=search.narrows, gave_up=gave_up,
            max_searched=MAX_SEARCHED, exact=exact))

    def _exact(self, view: View, run_id: str) -> str | None:
        """The run whose id is the searched text, when the caller may read it (a whole id
        finds its run however old it is)."""
        try:
            check_name("run id", run_id)
            if not view.can(READ, run_id):
                return None
            return readable_run(self.pikku, view.caller, run_id).run_id
        except (WorkflowRunNotFoundError, InvalidInputError):
            return None

    def _timeline(self, run_id: str) -> Timeline:
        return build(self.pikku.get_run(run_id), self.pikku.get_steps(run_id), [],
                     datetime.now(UTC))

    def _run(self, view: View, run_id: str, refusal: Refusal | None = None,
             status: int = 200, event_refusal: EventRefusal | None = None) -> Page:
        check_name("run id", run_id)
        run = readable_run(self.pikku, view.caller, run_id)
        sent = events_page(self.pikku, run_id, view.query.get("events_after"),
                           f"{view.base}runs/{segment(run_id)}")
        whole = build(run, self.pikku.get_steps(run_id), self.pikku.get_history(run_id),
                      datetime.now(UTC), events=sent.events)
        timeline, later = _steps_page(whole, view.query.get("steps_after") or None)
        shown = self.options.show_tracebacks
        labels = {s.state.step_name: s.label for s in timeline.steps}
        attempts = [(a, labels.get(a.step_name, a.step_name),
                     present({"error": a.error}, show_tracebacks=shown)["error"])
                    for a in timeline.attempts]
        live = not run.is_terminal
        found = graph_of(self.pikku, run.workflow)
        graph = None if found is None else draw(found[0], [s.state for s in whole.steps])
        values = [(s.label, s.state.status,
                   f"{view.base}api/runs/{segment(run_id)}/steps/{segment(s.state.step_name)}")
                  for s in timeline.steps if s.kind in VALUE_KINDS]
        return Page(status, ENV.get_template("run.html").render(
            graph=graph, graph_version=None if found is None else found[1],
            values=values, compensations=whole.compensations,
            view=view, home=view.base, run=run, timeline=timeline,
            served=present(run, show_tracebacks=shown),
            redact=self.pikku.settings.redact_value,
            chart=chart(timeline), attempts=attempts,
            gates=[gate_form(view, run_id, g, refusal) for g in whole.gates],
            refusal=refusal, event_waits=whole.event_waits, published=whole.published,
            events=whole.events, events_later=sent.later, events_first=sent.first,
            event_form=event_form(whole, forms=view.csrf is not None,
                                  allowed=view.can(SEND_EVENT, run_id),
                                  refusal=event_refusal),
            children=[s.state for s in timeline.steps if s.state.child_run_id],
            can_cancel=live and view.csrf is not None and view.can(CANCEL, run_id),
            can_resume=(run.status == RUN_SUSPENDED and view.csrf is not None
                        and _only_gate_waits(whole) is None and view.can(RESUME, run_id)),
            can_retry=(run.status in RETRYABLE and view.csrf is not None
                       and view.can(RETRY, run_id)),
            fork_steps=([(s.state.step_name, s.label) for s in whole.steps]
                        if view.csrf is not None and view.can(FORK, run_id) else []),
            forks=readable_forks(self.pikku, view.caller, run_id),
            queued=readable_queued(self.pikku, view.caller, run,
                                   self.pikku.settings.redact_value),
            notice=NOTICES.get(view.query.get("notice") or ""), live=live,
            refresh_s=REFRESH_S, progress=whole.progress(), steps_total=len(whole.steps),
            later=later and (f"{view.base}runs/{segment(run_id)}?"
                             + urlencode({"steps_after": later})),
            first=(f"{view.base}runs/{segment(run_id)}"
                   if view.query.get("steps_after") else None)))

    def guarded(self, home: str, make: Callable[[], Page]) -> Page:
        """``make()``, its failure an error page (for the pages of other modules)."""
        return self._page(home, make)

    def _page(self, home: str, make: Callable[[], Page]) -> Page:
        """Run a page and map its failure to an error page, as the API maps statuses."""
        try:
            return make()
        except PageError as exc:
            return self.error(exc.status, exc.title, exc.message, home)
        except (WorkflowRunNotFoundError, WorkflowNotFoundError) as exc:
            return self.error(404, "Not found", str(exc), home)
        except InvalidInputError as exc:
            # Only pikku's own: another ValueError (a driver refusing a configured URL) is
            # the server's, and its message can quote a password: a 500 below.
            return self.error(400, "Bad request", str(exc), home)
        except PikkuConfigurationError as exc:
            log.error("pikku dashboard: pikku is misconfigured: %s", exc)
            return self.error(500, "Server error",
                              "the server could not answer; the error is in its log", home)
        except Exception:
            # Never the message: a driver's error can quote a URL with its password.
            log.exception("pikku dashboard: unexpected error")
            return self.error(500, "Server error",
                              "the server could not answer; the error is in its log", home)

    def error(self, status: int, title: str, message: str, home: str) -> Page:
        return Page(status, ENV.get_template("error.html").render(
            title=title, message=message, status=status, home=home))


def _back(view: View, run_id: str, notice: str) -> Page:
    """Back to the run page, with a notice code."""
    return Page(303, redirect=f"{view.base}runs/{segment(run_id)}?"
                + urlencode({"notice": notice}))


def _only_gate_waits(timeline: Timeline) -> str | None:
    """The notice refusing resume when the run waits for an approval or an event and for
    no ``wf.suspend``: resume would change nothing (it opens suspensions; the run would
    wake and suspend again at its gate); ``None`` when resume may open something."""
    if timeline.approval_only is not None:
        return "not-resumed-approval"
    if timeline.event_wait_only is not None:
        return "not-resumed-event"
    return None


def _steps_page(timeline: Timeline, after: str | None) -> tuple[Timeline, str | None]:
    """``STEPS_PER_PAGE`` steps of the timeline (after the step named ``after``), and the
    name to page on from, if more follow."""
    names = [s.state.step_name for s in timeline.steps]
    start = 0
    if after is not None:
        if after not in names:
            raise InvalidInputError(f"steps_after={after!r} is not a step of this run")
        start = names.index(after) + 1
    steps = timeline.steps[start:start + STEPS_PER_PAGE]
    more = steps[-1].state.step_name if steps and start + STEPS_PER_PAGE < len(names) else None
    return Timeline(timeline.run, steps, timeline.start, timeline.end), more


#: The runs page's time range and run id search: ``?created_after=`` and
#: ``?created_before=`` (a time, UTC unless it names its offset, as the browser's
#: datetime-local field sends it: ``2026-05-04T09:12``) and ``?run_id=`` (a prefix).
SEARCH_FIELDS = ("created_after", "created_before", "run_id")


def _search(query: Mapping[str, str]) -> tuple[RunSearch, dict[str, str]]:
    """The runs page's search, and its fields as typed (kept in its links)."""
    typed = {k: (query.get(k) or "").strip() for k in SEARCH_FIELDS}
    typed = {k: v for k, v in typed.items() if v}
    prefix = typed.get("run_id")
    if prefix is not None and len(prefix) > 200:
        raise InvalidInputError("run_id: a run id prefix is at most 200 characters")
    return RunSearch(after_ms=_moment_ms(typed.get("created_after"), "created_after"),
                     before_ms=_moment_ms(typed.get("created_before"), "created_before"),
                     prefix=prefix), typed


def _moment_ms(raw: str | None, name: str) -> int | None:
    if raw is None:
        return None
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError:
        raise InvalidInputError(f"{name} must be a time such as 2026-05-04T09:12 (UTC), "
                                f"got {raw[:60]!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return round(moment.timestamp() * 1000)


def _limit(raw: str | None) -> int:
    if not raw:
        return DEFAULT_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        raise InvalidInputError(f"limit must be an integer, got {raw!r}") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidInputError(f"limit must be from 1 to {MAX_LIMIT}, got {limit}")
    return limit


__all__ = ["MAX_FORM_BYTES", "PageError", "check_form", "security_headers"]  # the adapters'
