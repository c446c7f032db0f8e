"""The JSON API over a ``PikkuCelery``, free of any web framework.

The Django and Flask adapters translate requests and responses; everything a request goes
through is decided here, once, in this order:

1. the caller is authorized for the route's action (``ACTIONS``) by the deployment's rules
   (``_access``): 401 for an anonymous caller, 403 for one without the right; the check
   is told the gate of an approval, the event sent, the schedule acted on
   (``_access.named``) and, after the body is read, a start's input and run id; what
   the caller may read narrows every read (``_access.Caller.match``), every listed run is
   checked on its own, and a start must create a run the caller may read (``start``);
2. a POST body must be ``application/json`` (415 otherwise: a cross-site form can only send
   ``text/plain``, form or multipart bodies), at most ``max_body_bytes`` (413), and nested
   no deeper than MongoDB stores (400);
3. the handler calls the app's public methods; errors map to statuses (``_requests``, which
   also reads the bodies and checks where a request comes from): unknown run or
   workflow 404, bad input (pikku's ``InvalidInputError`` only) 400, a run id taken by
   another run, a refused approval or an event sent to a run that has ended 409, anything
   else 500 with no detail: any other
   ``ValueError``, a ``PikkuConfigurationError`` (the engine is built at its first use,
   which can be a request) and every unexpected error are logged, never served (a
   driver's message or a traceback can quote a connection string).

An approval is recorded as given by the caller the adapter identified (Django: the
signed-in user; Flask: ``PIKKU_IDENTIFY``), never by whoever the body's ``by`` names: a
``by`` that is not the caller is refused (403), and so is any ``by`` when the adapter cannot
tell who the caller is (no ``by``: no approver, which only a gate without approvers takes).

Schedules (``GET api/schedules``; ``POST api/schedules/<name>/pause``, ``/resume``,
``/trigger``, the actions ``pause_schedule``, ``resume_schedule``, ``trigger_schedule``,
asked with ``run_id`` ``None``; an unknown schedule is a 404) are served by
``_schedules_api``. A run's JSON carries ``schedule`` and ``scheduled_for`` (``null`` for
a run no schedule started).

An event (``POST api/runs/<run_id>/events/<name>``, body ``{"payload": ..., "key": ...}``,
both optional) is its own action, ``send_event``: 413 for a payload over the run's limit
on an event's size, 409 for a run that has kept as many events as it may
(``WorkflowEventLimitError``). A run's events are read with ``read``, paged and without
their payloads (``GET api/runs/<run_id>/events?after=``, and the first page in the run's
own JSON), each with the wait that took it (``taken_by``) or ``null``; one event's payload
has its own route (``GET api/runs/<run_id>/events/<seq>/payload``): ``_events_api``.

The routes' contract is an OpenAPI 3.1 document (``_openapi``, written once there and
checked against ``ROUTES`` by the tests), served at ``GET api/openapi.json`` to whoever may
``read`` (asked with ``run_id`` ``None``, as a listing is).

Served records carry errors as ``type`` and ``message`` only; their ``traceback`` (and
those nested in step data, such as a compensation's input) is served only with
``show_tracebacks``, to an authorized caller.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib import _events_api as events_api
from pikku_celery.contrib import _openapi as openapi
from pikku_celery.contrib import _schedules_api as schedules
from pikku_celery.contrib._access import (
    ACTIONS,
    APPROVE,
    CANCEL,
    FORK,
    PAUSE_SCHEDULE,
    READ,
    RESUME,
    RESUME_SCHEDULE,
    RETRY,
    SEND_EVENT,
    START,
    TRIGGER_SCHEDULE,
    ApiError,
    Caller,
    forbidden,
    named,
    not_authenticated,
)
from pikku_celery.contrib._json import present, to_json
from pikku_celery.contrib._readable import (
    MAX_SEARCHED,
    SEARCH_BATCH,
    RunSearch,
    check_startable,
    hidden_run,
    readable_count,
    readable_forks,
    readable_page,
    readable_queued,
    readable_run,
    readable_search,
)
from pikku_celery.contrib._requests import (
    DEFAULT_MAX_BODY_BYTES,
    JSON_TYPE,
    ApiOptions,
    Response,
    content_length,
    cross_origin_refusal,
    handle,
    internal_error,
    parse_body,
    read_json_body,
    single_values,
)
from pikku_celery.engine.forks import kept_approvals
from pikku_celery.model.errors import (
    InvalidInputError,
    WorkflowRunConflictError,
)
from pikku_celery.model.records import StepAttempt, StepState, WorkflowRun
from pikku_celery.operate.timeline import Timeline, build

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

# Kept here for the adapters and the dashboard (the actions are ``_access``'s, what a
# caller may read ``_readable``'s, the JSON of read models ``_json``'s, a request's body
# and failures ``_requests``').
__all__ = [
    "ACTIONS",
    "APPROVE",
    "CANCEL",
    "DEFAULT_MAX_BODY_BYTES",
    "FORK",
    "JSON_TYPE",
    "MAX_SEARCHED",
    "READ",
    "RESUME",
    "RETRY",
    "SEARCH_BATCH",
    "SEND_EVENT",
    "START",
    "ApiError",
    "ApiOptions",
    "Response",
    "RunSearch",
    "content_length",
    "cross_origin_refusal",
    "forbidden",
    "handle",
    "internal_error",
    "not_authenticated",
    "parse_body",
    "present",
    "read_json_body",
    "readable_count",
    "readable_page",
    "readable_run",
    "readable_search",
    "to_json",
]
DEFAULT_LIMIT = 50
MAX_LIMIT = openapi.MAX_LIMIT
#: ``/steps`` and ``/history`` pages carry no values (``/steps/<step_name>`` serves them).
DEFAULT_STEP_LIMIT = 100
MAX_STEP_LIMIT = openapi.MAX_STEP_LIMIT


@dataclass(frozen=True)
class Served:
    """What one request is served with, made by an adapter: the app, the API's options,
    the caller, and the origins trusted to POST from another site (for frameworks
    without a CSRF check of their own)."""

    pikku: PikkuCelery
    options: ApiOptions
    caller: Caller
    trusted_origins: Collection[str] = ()


# --- the routes --------------------------------------------------------------------------


UNKNOWN_CALLER = (
    "the server cannot tell who you are, so it cannot record an approval in anyone's name "
    "(the body says 'by': {by!r}). Send the decision without 'by' (only a gate without "
    "approvers takes it), or have the server identify its callers: in Flask, set "
    "PIKKU_IDENTIFY to a callable (request) -> the caller's name; in Django, sign in (the "
    "approval is recorded as given by the signed-in user); `pikku dashboard`: serve it "
    "behind a proxy that signs users in, with --identity-header naming the header it sets")


class RunsApi:
    """The handlers; each returns ``(status, payload)``. ``caller`` is the request's caller
    (``_access.Caller``): its run filter narrows every read, and an approval is recorded
    as given by its name (the adapter's: Django's signed-in user, Flask's
    ``PIKKU_IDENTIFY``), never by whoever the body names."""

    def __init__(self, pikku: PikkuCelery, options: ApiOptions, caller: Caller) -> None:
        self.pikku = pikku
        self.options = options
        self.caller = caller

    def _present(self, record: Any) -> Any:
        """``record`` as served, its values through the ``redact_value`` hook (``_json``)."""
        return present(record, show_tracebacks=self.options.show_tracebacks,
                       redact=self.pikku.settings.redact_value)

    def list_runs(self, query: Mapping[str, str]) -> Response:
        limit = bounded_int(query.get("limit"), "limit", DEFAULT_LIMIT, MAX_LIMIT)
        # An empty parameter is an absent one, as for limit and before (a form's empty
        # field; the OpenAPI document's allowEmptyValue).
        runs, more = readable_page(self.pikku, self.caller,
                                   workflow=query.get("workflow") or None,
                                   status=query.get("status") or None, limit=limit,
                                   before=query.get("before") or None)
        return 200, {"runs": [self._present(r) for r in runs], "next": more}

    def get_run(self, run_id: str) -> Response:
        """The run, with the first page of its events (``events``, without payloads, and
        ``events_next``: as ``_events_api.get_events`` serves them) and the runs forked
        from it that the caller may read (``forks``: their ids, oldest first; a fork
        names its source in ``forked_from`` and its ``lineage``)."""
        run = readable_run(self.pikku, self.caller, run_id)
        served = self._present(run)
        events, more = events_api.page(self.pikku, run)
        served["events"] = events_api.listed(events,
                                             show_tracebacks=self.options.show_tracebacks)
        served["events_next"] = more
        served["forks"] = [f.run_id for f in readable_forks(self.pikku, self.caller, run_id)]
        served["queued"] = readable_queued(self.pikku, self.caller, run,
                                           self.pikku.settings.redact_value)
        return 200, served

    def _timeline(self, run: WorkflowRun) -> Timeline:
        """The run's timeline without its attempts and events (what gates need)."""
        return build(run, self.pikku.get_steps(run.run_id), [], datetime.now(UTC))

    def get_steps(self, run_id: str, query: Mapping[str, str]) -> Response:
        """A page of the run's steps in creation order, without their data and result
        (``get_step`` serves them): ``?limit=`` (1 to 500, default 100) and ``?after=<the
        last step name of the page before>``."""
        readable_run(self.pikku, self.caller, run_id)
        page, more = _page(self.pikku.get_steps(run_id), query, key=lambda s: s.step_name)
        return 200, {"steps": [self._summary(s) for s in page], "next": more}

    def get_step(self, run_id: str, step_name: str) -> Response:
        """One step, with its data and result."""
        readable_run(self.pikku, self.caller, run_id)
        for step in self.pikku.get_steps(run_id):
            if step.step_name == step_name:
                return 200, self._present(step)
        raise ApiError(404, "WorkflowStepNotFoundError",
                       f"run {run_id!r} has no step {step_name!r}")

    def get_history(self, run_id: str, query: Mapping[str, str]) -> Response:
        """A page of the attempts, oldest first, without their results (the step's route
        serves its result): ``?limit=`` and ``?after=<the page before's next>``."""
        readable_run(self.pikku, self.caller, run_id)
        attempts = self.pikku.get_history(run_id)
        page, more = _page(attempts, query, key=lambda a: f"{a.step_name}#{a.attempt}")
        return 200, {"attempts": [self._summary(a) for a in page], "next": more}

    def _summary(self, record: StepState | StepAttempt) -> Any:
        served = present(record, show_tracebacks=self.options.show_tracebacks)
        for name in VALUE_FIELDS:  # not shown: not redacted
            served.pop(name, None)
        return served

    def start(self, workflow: str, body: Any) -> Response:
        """``pikku.start``, refused in this order, each refusal the same whatever else the
        body holds: ``authorize`` told the body's ``run_id`` and, when it takes it, the
        ``input`` (403); a run the caller's run filter would not keep as theirs (403,
        ``check_startable``); a ``run_id`` taken by a run the caller may not read, or by
        another workflow's or input's run (409, one message for all: nothing of the run
        that has it, not even whether the input was its input)."""
        fields = _fields(body, allowed=("input", "run_id"),
                         what="'input' (and optionally 'run_id')")
        run_id, data = fields.get("run_id"), fields.get("input")
        if run_id is not None and not isinstance(run_id, str):
            raise InvalidInputError(f"'run_id' must be a string, got {run_id!r}")
        if run_id is not None or self.caller.takes("input"):
            # Route.serve asked ("start", None) before the body was read, or nothing of a
            # rule told the input: now with what the body names.
            self.caller.check(START, run_id, input=data)
        check_startable(self.caller, data)
        taken = ApiError(409, "WorkflowRunConflictError", RUN_ID_TAKEN.format(run_id=run_id))
        if run_id is not None and hidden_run(self.pikku, self.caller, run_id):
            # Before the idempotent match, which would answer 202 for its very input.
            raise taken
        try:
            started = self.pikku.start(workflow, data, run_id=run_id)
        except WorkflowRunConflictError:
            # Not which workflow owns it: a caller allowed to start may not read that run.
            raise taken from None
        return 202, {"run_id": started}

    def cancel(self, run_id: str, body: Any) -> Response:
        reason = _fields(body, allowed=("reason",), what="an optional 'reason'").get("reason")
        readable_run(self.pikku, self.caller, run_id)
        return 200, {"cancelled": self.pikku.cancel(run_id, reason)}

    def resume(self, run_id: str, body: Any) -> Response:
        """Open the run's ``wf.suspend`` gates. A run waiting only at an approval is
        refused (409, naming the approval): resume would wake it to suspend again at its
        gate, and ``{"resumed": true}`` would be a lie (as in ``pikku resume`` and the
        dashboard)."""
        _fields(body, allowed=(), what="nothing")
        timeline = self._timeline(readable_run(self.pikku, self.caller, run_id))
        gate = timeline.approval_only
        if gate is not None:
            raise ApiError(409, "WorkflowWaitsForApproval",
                           f"run {run_id!r} waits for approval {gate.name!r}, which resume "
                           "does not open: decide it with POST "
                           f"api/runs/{run_id}/approvals/{gate.name}")
        wait = timeline.event_wait_only
        if wait is not None:
            raise ApiError(409, "WorkflowWaitsForEvent",
                           f"run {run_id!r} waits for event {wait.name!r}, which resume "
                           f"does not send: send it with POST api/runs/{run_id}/events/"
                           f"{wait.name}")
        return 200, {"resumed": self.pikku.resume(run_id)}

    def retry(self, run_id: str, body: Any) -> Response:
        """``pikku.retry``, recorded in the run's lineage as by the caller the adapter
        identified (``None`` when it cannot tell); 409 for a run neither failed nor
        cancelled."""
        _fields(body, allowed=(), what="nothing")
        run = readable_run(self.pikku, self.caller, run_id)
        if not self.pikku.retry(run_id, by=self.caller.name()):
            raise ApiError(409, "WorkflowRunNotRetryable",
                           f"run {run_id!r} is {run.status}, not failed or cancelled: "
                           "nothing to retry")
        return 200, {"retried": True}

    def fork(self, run_id: str, body: Any) -> Response:
        """``pikku.fork``, authorized as ``fork`` on the run forked from; with
        ``keep_decisions``, also as ``approve`` of that run for each approval the fork
        copies (told the gate; once without one when it copies none): a caller who may
        fork but not approve cannot have a decision made for another run re-used in
        theirs. Recorded as by the caller the adapter identified. 409 when the new id is
        another run's (a fork never writes into a run it did not create)."""
        what = "a 'from_step', an optional 'run_id' and an optional 'keep_decisions'"
        fields = _fields(body, allowed=("from_step", "run_id", "keep_decisions"), what=what)
        from_step, keep = fields.get("from_step"), fields.get("keep_decisions", False)
        if not isinstance(from_step, str):
            raise InvalidInputError(f"the body must be a JSON object with {what}")
        if not isinstance(keep, bool):
            raise InvalidInputError(f"'keep_decisions' must be true or false, got {keep!r}")
        readable_run(self.pikku, self.caller, run_id)
        if keep:
            gates: list[str | None] = [*kept_approvals(run_id, self.pikku.get_steps(run_id),
                                                       from_step)]
            for gate in gates or [None]:
                self.caller.check(APPROVE, run_id, gate)
        try:
            return 202, {"run_id": self.pikku.fork(run_id, from_step=from_step,
                                                   new_run_id=fields.get("run_id"),
                                                   keep_decisions=keep,
                                                   by=self.caller.name())}
        except WorkflowRunConflictError:
            raise ApiError(409, "WorkflowRunConflictError",
                           f"run id {fields.get('run_id')!r} is taken by another run (not "
                           "this fork of this run)") from None

    def approve(self, run_id: str, name: str, body: Any) -> Response:
        what = "a 'decision' and an optional 'by'"
        fields = _fields(body, allowed=("decision", "by"), what=what)
        if "decision" not in fields:
            raise InvalidInputError(f"the body must be a JSON object with {what}")
        by = fields.get("by")
        if by is not None and not isinstance(by, str):
            raise InvalidInputError(f"'by' must be a string, got {by!r}")
        caller = self.caller.name()
        if caller is not None:
            if by is not None and by != caller:
                raise ApiError(403, "Forbidden", f"you are {caller!r}: you cannot "
                                                 f"approve as {by!r}")
            by = caller
        elif by is not None:
            # Whoever PIKKU_AUTHORIZE lets approve could otherwise name any approver.
            raise ApiError(403, "Forbidden", UNKNOWN_CALLER.format(by=by))
        readable_run(self.pikku, self.caller, run_id)
        step = self.pikku.approve(run_id, name, fields["decision"], by=by)
        return 200, {"approved": True, "step": self._present(step)}

    def send_event(self, run_id: str, name: str, body: Any) -> Response:
        """``pikku.send_event``: the body's ``payload`` (default ``null``) under the
        optional idempotency ``key``; 409 for a run that has ended, 503 when the store
        kept failing (``may_be_kept`` says whether the event may be in the run)."""
        what = "an optional 'payload' and an optional 'key'"
        fields = _fields(body, allowed=("payload", "key"), what=what)
        key = fields.get("key")
        if key is not None and not isinstance(key, str):
            raise InvalidInputError(f"'key' must be a string, got {key!r}")
        readable_run(self.pikku, self.caller, run_id)
        event = self.pikku.send_event(run_id, name, fields.get("payload"), key=key)
        return 200, {"sent": True, "event": self._present(event)}


#: The one refusal of a start under a taken run id, whoever's run has it.
RUN_ID_TAKEN = ("run id {run_id!r} is taken by another run (of another workflow, with "
                "another input, or one you may not read): start it under another id")
VALUE_FIELDS = ("data", "result")


def bounded_int(raw: str | None, name: str, default: int, maximum: int) -> int:
    """A query parameter from 1 to ``maximum`` (``default`` when absent)."""
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidInputError(f"{name} must be an integer, got {raw!r}") from None
    if not 1 <= value <= maximum:
        raise InvalidInputError(f"{name} must be from 1 to {maximum}, got {value}")
    return value


def _page(records: list[Any], query: Mapping[str, str], *, key: Callable[[Any], str]
          ) -> tuple[list[Any], str | None]:
    limit = bounded_int(query.get("limit"), "limit", DEFAULT_STEP_LIMIT, MAX_STEP_LIMIT)
    after = query.get("after")
    start = 0
    if after:
        keys = [key(r) for r in records]
        if after not in keys:
            raise InvalidInputError(f"after={after!r} is not an entry of this run")
        start = keys.index(after) + 1
    page = records[start:start + limit]
    more = key(page[-1]) if page and start + limit < len(records) else None
    return page, more


def _fields(body: Any, *, allowed: tuple[str, ...], what: str) -> Mapping[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, Mapping):
        raise InvalidInputError(f"the body must be a JSON object with {what}")
    if unknown := sorted(set(body) - set(allowed)):
        raise InvalidInputError(f"unknown field(s) {unknown} in the body; it takes {what}")
    return body


@dataclass(frozen=True)
class Route:
    """One endpoint: ``path`` (relative to the mount point) uses ``<name>`` parameters,
    which Django's ``path`` and Flask's rules both read as strings without a slash."""

    name: str
    method: str
    path: str
    action: str
    call: Callable[[RunsApi, Mapping[str, str], Mapping[str, str], Any], Response]

    def serve(self, api: RunsApi, params: Mapping[str, str], query: Mapping[str, str],
              read_body: Callable[[], Any]) -> Response:
        """Authorize the caller for the route's action (told the gate, event or schedule
        the path names: ``_access.named``), read the body (POST) and run the handler;
        every failure becomes a response."""
        def call() -> Response:
            # An authorize told a start's input is asked once, after the body is read.
            if not (self.action == START and api.caller.takes("input")):
                api.caller.check(self.action, params.get("run_id"),
                                 **named(self.action, params.get("name")))
            once = single_values(query)  # a repeated parameter: 400 (not first or last)
            body = read_body() if self.method == "POST" else None
            return self.call(api, params, once, body)
        return handle(call)


ROUTES = (
    # The contract of every route here (``_openapi``), to whoever may list runs.
    Route("openapi", "GET", "api/openapi.json", READ,
          lambda api, p, q, b: (200, openapi.document())),
    Route("runs", "GET", "api/runs", READ, lambda api, p, q, b: api.list_runs(q)),
    Route("run", "GET", "api/runs/<run_id>", READ, lambda api, p, q, b: api.get_run(p["run_id"])),
    Route("steps", "GET", "api/runs/<run_id>/steps", READ,
          lambda api, p, q, b: api.get_steps(p["run_id"], q)),
    Route("step", "GET", "api/runs/<run_id>/steps/<step_name>", READ,
          lambda api, p, q, b: api.get_step(p["run_id"], p["step_name"])),
    Route("history", "GET", "api/runs/<run_id>/history", READ,
          lambda api, p, q, b: api.get_history(p["run_id"], q)),
    Route("events", "GET", "api/runs/<run_id>/events", READ,
          lambda api, p, q, b: events_api.get_events(
              api.pikku, api.caller, p["run_id"], q,
              show_tracebacks=api.options.show_tracebacks)),
    Route("event", "GET", "api/runs/<run_id>/events/<seq>/payload", READ,
          lambda api, p, q, b: events_api.get_event(
              api.pikku, api.caller, p["run_id"], p["seq"],
              show_tracebacks=api.options.show_tracebacks)),
    Route("cancel", "POST", "api/runs/<run_id>/cancel", CANCEL,
          lambda api, p, q, b: api.cancel(p["run_id"], b)),
    Route("resume", "POST", "api/runs/<run_id>/resume", RESUME,
          lambda api, p, q, b: api.resume(p["run_id"], b)),
    Route("retry", "POST", "api/runs/<run_id>/retry", RETRY,
          lambda api, p, q, b: api.retry(p["run_id"], b)),
    Route("fork", "POST", "api/runs/<run_id>/fork", FORK,
          lambda api, p, q, b: api.fork(p["run_id"], b)),
    Route("approve", "POST", "api/runs/<run_id>/approvals/<name>", APPROVE,
          lambda api, p, q, b: api.approve(p["run_id"], p["name"], b)),
    Route("send_event", "POST", "api/runs/<run_id>/events/<name>", SEND_EVENT,
          lambda api, p, q, b: api.send_event(p["run_id"], p["name"], b)),
    Route("start", "POST", "api/workflows/<workflow>/runs", START,
          lambda api, p, q, b: api.start(p["workflow"], b)),
    # Schedules (``_schedules_api``): each action is asked with run_id None.
    Route("schedules", "GET", "api/schedules", READ,
          lambda api, p, q, b: schedules.list_schedules(api.pikku, api.caller)),
    Route("pause_schedule", "POST", "api/schedules/<name>/pause", PAUSE_SCHEDULE,
          lambda api, p, q, b: schedules.pause(api.pikku, api.caller, p["name"], b)),
    Route("resume_schedule", "POST", "api/schedules/<name>/resume", RESUME_SCHEDULE,
          lambda api, p, q, b: schedules.resume(api.pikku, api.caller, p["name"], b)),
    Route("trigger_schedule", "POST", "api/schedules/<name>/trigger", TRIGGER_SCHEDULE,
          lambda api, p, q, b: schedules.trigger(api.pikku, api.caller, p["name"], b)),
)
