"""The JSON API's contract: an OpenAPI 3.1 document, written once here.

Served at ``<prefix>/api/openapi.json`` by both adapters (``_api.ROUTES``'s ``openapi``
route, action ``read``: whoever may list runs may read it, and an anonymous caller gets
401 as on every other route; the document itself is not secret, it is the same for every
deployment and published in the docs site, ``docs/guide/web-api-openapi.json``, which
``python -m pikku_celery.contrib._openapi`` writes). ``tests/unit/test_openapi.py``
checks it against the routes Flask and Django serve, and schemathesis fuzzes both apps
with it (``tests/integration/test_openapi_fuzz.py``).

Paths are relative to the API's mount point: ``servers`` is ``../api``, which a client
resolves against where it read the document (``/pikku/api/openapi.json`` -> ``/pikku/api``),
whatever ``PIKKU_URL_PREFIX`` or Django's ``include`` mounted it under.

Authentication is the deployment's own (``PIKKU_AUTHORIZE``: a session cookie, a token...),
so the document declares no security scheme: every operation answers 401 to a caller
``authorize`` refuses who is not signed in, 403 to one it refuses who is. Every POST
takes ``application/json`` only (415 otherwise) and passes the cross-site checks (Django:
its CSRF token in ``X-CSRFToken``; Flask: no cross-site ``Sec-Fetch-Site`` or ``Origin``
unless trusted): 403 when refused.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

from pikku_celery.contrib._events_api import MAX_LIMIT as MAX_EVENT_LIMIT
from pikku_celery.model.records import CATCH_UPS, RUN_STATUSES, STEP_STATUSES

VERSION = "1"
JSON = "application/json"
MAX_LIMIT = 200  # of a page of runs (_api reads both from here)
MAX_STEP_LIMIT = 500  # of a page of steps or attempts

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: Schema) -> Schema:
    return {"oneOf": [schema, {"type": "null"}]}


_STR = {"type": "string"}
_TIME = {"type": "string", "format": "date-time"}
_ANY: Schema = {}  # any JSON value

SCHEMAS: dict[str, Schema] = {
    "Error": {
        "type": "object", "required": ["error", "message"],
        "description": "Every refusal and failure: the error's type and what to do about it "
                       "(a 500 says only that the error is in the server's log).",
        "properties": {"error": _STR, "message": _STR}},
    "ErrorInfo": {
        "type": "object", "required": ["type", "message"],
        "description": "A run's, step's or attempt's error: its ``traceback`` only with "
                       "``PIKKU_SHOW_TRACEBACKS``.",
        "properties": {"type": _STR, "message": _STR, "traceback": _STR}},
    "Lineage": {
        "type": "object", "required": ["op", "at"],
        "properties": {"op": {"type": "string", "enum": ["retry", "fork"]}, "at": _TIME,
                       "by": _nullable(_STR), "from_step": _nullable(_STR),
                       "run_id": _nullable(_STR), "keep_decisions": {"type": "boolean"}}},
    "Run": {
        "type": "object",
        "required": ["run_id", "workflow", "status", "input", "output", "error",
                     "created_at", "updated_at", "schedule", "scheduled_for"],
        "properties": {
            "run_id": _STR, "workflow": _STR,
            "status": {"type": "string", "enum": list(RUN_STATUSES)},
            "input": _ANY, "output": _ANY, "error": _nullable(_ref("ErrorInfo")),
            "created_at": _TIME, "updated_at": _TIME, "version": _nullable(_STR),
            "parent_run_id": _nullable(_STR), "parent_step_name": _nullable(_STR),
            "cancel_reason": _nullable(_STR), "state": {"type": "object"},
            "state_version": {"type": "integer", "minimum": 0},
            "state_writers": {"type": "array", "items": _STR},
            "schedule": _nullable(_STR), "scheduled_for": _nullable(_TIME),
            "slot": _nullable(_STR), "forked_from": _nullable(_STR),
            "lineage": {"type": "array", "items": _ref("Lineage")},
            "trace": _nullable({"type": "object", "additionalProperties": _STR}),
            "reopen_owed": {"type": "boolean", "description": (
                "A retry made the run live and its failed steps are being reopened: "
                "the run's next pass finishes it.")}}},
    "SentEvent": {
        "type": "object", "description": "An event as kept (``pikku.send_event``).",
        "required": ["run_id", "name", "seq", "sent_at", "key", "event_id", "size"],
        "properties": {
            "run_id": _STR, "name": _STR, "seq": {"type": "integer", "minimum": 1},
            "sent_at": _TIME, "key": _nullable(_STR), "event_id": _STR,
            "size": _nullable({"type": "integer", "minimum": 0}), "payload": _ANY}},
    "Step": {
        "type": "object",
        "required": ["run_id", "step_name", "status", "attempt", "max_attempts", "error",
                     "created_at", "updated_at"],
        "properties": {
            "run_id": _STR, "step_name": _STR,
            "status": {"type": "string", "enum": list(STEP_STATUSES)},
            "attempt": {"type": "integer"}, "max_attempts": {"type": "integer"},
            "function": _nullable(_STR), "data": _ANY, "result": _ANY,
            "error": _nullable(_ref("ErrorInfo")), "lease_expires_at": _nullable(_TIME),
            "created_at": _TIME, "updated_at": _TIME, "invocation_id": _STR,
            "due_at": _nullable(_TIME), "child_run_id": _nullable(_STR),
            "retry_delay_ms": {"type": "integer"}, "on_error": _nullable(_STR),
            "task_id": _nullable(_STR), "forked_from": _nullable(_STR),
            "errors_retried": {"type": "boolean"}, "progress": _ANY,
            "progress_at": _nullable(_TIME)}},
    "Attempt": {
        "type": "object", "required": ["run_id", "step_name", "attempt", "status", "error"],
        "properties": {
            "run_id": _STR, "step_name": _STR, "attempt": {"type": "integer"},
            "status": _STR, "error": _nullable(_ref("ErrorInfo")),
            "started_at": _nullable(_TIME), "ended_at": _nullable(_TIME),
            "worker": _nullable(_STR), "task_id": _nullable(_STR),
            "max_attempts": _nullable({"type": "integer"})}},
    "Schedule": {
        "type": "object",
        "required": ["name", "workflow", "cron", "every", "tz", "catch_up", "paused",
                     "next_at", "last_at", "last_run_id", "timing"],
        "properties": {
            "name": _STR, "workflow": _STR, "cron": _nullable(_STR),
            "every": _nullable({"type": "number"}), "tz": _STR, "data": _ANY,
            "catch_up": {"type": "string", "enum": list(CATCH_UPS)},
            "paused": {"type": "boolean"}, "next_at": _TIME, "last_at": _nullable(_TIME),
            "last_run_id": _nullable(_STR), "created_at": _TIME, "updated_at": _TIME,
            "declared": {"type": "boolean"},
            "timing": {"type": "string", "description": "``cron ...`` or ``every ...``"}}},
}
SCHEMAS["Event"] = {
    "description": "An event as listed: no ``payload`` (its ``size``), the wait that took it "
                   "(``taken_by``, ``taken_by_step``; ``null``: not taken yet).",
    "allOf": [_ref("SentEvent"), {
        "type": "object", "required": ["taken_by", "taken_by_step"],
        "properties": {"taken_by": _nullable(_STR), "taken_by_step": _nullable(_STR)}}]}
SCHEMAS["Queued"] = {
    "description": "Why a queued run waits: its concurrency key, the limit, the queued runs "
                   "before it, the runs holding the slots that the caller may read, and "
                   "how many others hold one.",
    "type": "object", "required": ["key", "limit", "ahead", "holders", "other_holders"],
    "properties": {"key": _ANY, "limit": _nullable({"type": "integer"}),
                   "ahead": {"type": "integer"}, "holders": {"type": "array", "items": _STR},
                   "other_holders": {"type": "integer"}}}
SCHEMAS["RunDetail"] = {"allOf": [_ref("Run"), {
    "type": "object", "required": ["events", "events_next", "forks", "queued"],
    "properties": {"events": {"type": "array", "items": _ref("Event")},
                   "events_next": _nullable({"type": "integer"}),
                   "forks": {"type": "array", "items": _STR},
                   "queued": _nullable(_ref("Queued"))}}]}
SCHEMAS["EventWithPayload"] = {"allOf": [_ref("Event"), {
    "type": "object", "required": ["payload"], "properties": {"payload": _ANY}}]}
SCHEMAS["StepSummary"] = {
    "description": "A step as paged: without its ``data`` and ``result``.",
    "allOf": [_ref("Step")]}
SCHEMAS["AttemptSummary"] = {
    "description": "An attempt as paged: without its ``result``.", "allOf": [_ref("Attempt")]}


# --- parameters ---------------------------------------------------------------------------


def _path(name: str, description: str, example: Any, schema: Schema | None = None) -> Schema:
    return {"name": name, "in": "path", "required": True, "description": description,
            "schema": schema or {"type": "string", "minLength": 1, "pattern": "^[^/]+$"},
            "example": example}


def _query(name: str, description: str, schema: Schema) -> Schema:
    """An optional query parameter; sent empty (``?limit=``, a form's empty field), it is
    taken as absent."""
    return {"name": name, "in": "query", "required": False, "allowEmptyValue": True,
            "description": description + " (empty: as if absent)", "schema": schema}


RUN_ID = _path("run_id", "the run's id", "order-1042")
STEP_NAME = _path("step_name", "the step's name", "charge")
GATE = _path("name", "the approval gate's name", "manager")
EVENT_NAME = _path("name", "the event's name", "paid")
SCHEDULE = _path("name", "the schedule's name", "nightly")
WORKFLOW = _path("workflow", "the workflow's name", "orders")
SEQ = _path("seq", "the event's seq", 1, {"type": "integer", "minimum": 1,
                                             "maximum": 2**53})


def _limit(maximum: int, default: int) -> Schema:
    return _query("limit", f"at most this many (default {default})",
                  {"type": "integer", "minimum": 1, "maximum": maximum})


STEP_PAGE = [_limit(MAX_STEP_LIMIT, 100),
             _query("after", "the ``next`` of the page before", {"type": "string"})]


# --- responses ----------------------------------------------------------------------------


def _json(schema: Schema) -> Schema:
    return {"content": {JSON: {"schema": schema}}}


def _error(description: str) -> Schema:
    return {"description": description, **_json(_ref("Error"))}


def _object(required: list[str], **properties: Schema) -> Schema:
    return {"type": "object", "required": required, "properties": properties}


RESPONSES = {
    "NotSignedIn": _error("not signed in: ``PIKKU_AUTHORIZE`` refused an anonymous caller"),
    "Forbidden": {
        "description": "``PIKKU_AUTHORIZE`` refused the caller, or a POST was cross-site "
                       "(Django's CSRF check answers with its own HTML page)",
        "content": {JSON: {"schema": _ref("Error")}, "text/html": {"schema": _STR}}},
    "ServerError": _error("the server's error, in its log; never its detail"),
    "TooLarge": _error("the body is over ``PIKKU_MAX_BODY_BYTES``"),
    "NotJson": _error("the body is not ``application/json``"),
}


def _shared(name: str) -> Schema:
    return {"$ref": f"#/components/responses/{name}"}


REFUSALS = {"401": _shared("NotSignedIn"), "403": _shared("Forbidden"),
            "500": _shared("ServerError")}
POST_REFUSALS = {
    "400": _error("the body is not JSON, not of this route's fields, or too deep"),
    "413": _shared("TooLarge"), "415": _shared("NotJson")}


def _operation(op_id: str, summary: str, ok: tuple[str, Schema], *, parameters: list[Schema],
               body: Schema | None = None, errors: dict[str, str] | None = None,
               action: str = "read") -> Schema:
    responses = {ok[0]: {"description": "done", **_json(ok[1])}, **REFUSALS}
    if body is not None:
        responses.update(POST_REFUSALS)
    responses.update({code: _error(why) for code, why in (errors or {}).items()})
    for applies, why in ((RUN_ID in parameters, BAD_RUN_ID), (True, REPEATED)):
        if applies:
            before = responses["400"]["description"] + "; or " if "400" in responses else ""
            responses["400"] = _error(before + why)
    operation: Schema = {"operationId": op_id, "summary": summary,
                         "description": f"``authorize`` is asked about ``{action}``.",
                         "parameters": parameters,
                         "responses": dict(sorted(responses.items()))}
    if body is not None:
        operation["requestBody"] = {"required": True, **_json(body)}
    return operation


def _fields(**properties: Schema) -> Schema:
    """A body of these fields, none required; ``null`` (or no body at all, still sent as
    ``application/json``) is taken as ``{}``."""
    return {"oneOf": [{"type": "object", "additionalProperties": False,
                       "properties": properties}, {"type": "null"}]}


def _required(required: list[str], **properties: Schema) -> Schema:
    return {"type": "object", "additionalProperties": False, "properties": properties,
            "required": required}


#: Flask reads the first of a repeated query parameter, Django the last: neither is taken.
REPEATED = "a query parameter given more than once"
#: A run id the store refuses to look up (``model.validate``), whichever route names it.
BAD_RUN_ID = "the run id cannot be one (a leading '$', NUL, or surrounding spaces)"
UNKNOWN_RUN = {"404": "no such run, or one the caller's run filter hides"}
READ_ERRORS = {"400": "a query parameter out of range", **UNKNOWN_RUN}
PATHS: dict[str, dict[str, Schema]] = {
    "/openapi.json": {"get": _operation(
        "openapi", "This document", ("200", {"type": "object"}), parameters=[])},
    "/runs": {"get": _operation(
        "runs", "A page of the runs the caller may read, newest first",
        ("200", _object(["runs", "next"], runs={"type": "array", "items": _ref("Run")},
                        next=_nullable(_STR))),
        parameters=[_limit(MAX_LIMIT, 50),
                    _query("workflow", "only this workflow's runs", _STR),
                    _query("status", "only runs in this status",
                           {"type": "string", "enum": list(RUN_STATUSES)}),
                    _query("before", "the ``next`` of the page before (a run id)", _STR)],
        errors={"400": "a query parameter out of range",
                "404": "``before`` names no run the caller may read"})},
    "/runs/{run_id}": {"get": _operation(
        "run", "A run, with the first page of its events and its forks",
        ("200", _ref("RunDetail")), parameters=[RUN_ID], errors=UNKNOWN_RUN)},
    "/runs/{run_id}/steps": {"get": _operation(
        "steps", "A page of the run's steps, in creation order, without their values",
        ("200", _object(["steps", "next"], steps={"type": "array",
                                                  "items": _ref("StepSummary")},
                        next=_nullable(_STR))),
        parameters=[RUN_ID, *STEP_PAGE], errors=READ_ERRORS)},
    "/runs/{run_id}/steps/{step_name}": {"get": _operation(
        "step", "One step, with its data and result", ("200", _ref("Step")),
        parameters=[RUN_ID, STEP_NAME], errors={"404": "no such run or step"})},
    "/runs/{run_id}/history": {"get": _operation(
        "history", "A page of the run's attempts, oldest first, without their results",
        ("200", _object(["attempts", "next"], attempts={"type": "array",
                                                        "items": _ref("AttemptSummary")},
                        next=_nullable(_STR))),
        parameters=[RUN_ID, *STEP_PAGE], errors=READ_ERRORS)},
    "/runs/{run_id}/events": {"get": _operation(
        "events", "A page of the run's events in the order sent, without their payloads",
        ("200", _object(["events", "next"], events={"type": "array",
                                                    "items": _ref("Event")},
                        next=_nullable({"type": "integer"}))),
        parameters=[RUN_ID, _limit(MAX_EVENT_LIMIT, 100),
                    _query("after", "the ``next`` of the page before (a seq)",
                           {"type": "integer", "minimum": 0, "maximum": 2**53})],
        errors=READ_ERRORS)},
    "/runs/{run_id}/events/{seq}/payload": {"get": _operation(
        "event", "One event, with its payload", ("200", _ref("EventWithPayload")),
        parameters=[RUN_ID, SEQ],
        errors={"400": "not a seq", "404": "no such run or event"})},
    "/runs/{run_id}/cancel": {"post": _operation(
        "cancel", "Cancel the run", ("200", _object(["cancelled"],
                                                    cancelled={"type": "boolean"})),
        parameters=[RUN_ID], body=_fields(reason=_nullable(_STR)), errors=UNKNOWN_RUN,
        action="cancel")},
    "/runs/{run_id}/resume": {"post": _operation(
        "resume", "Open the run's ``wf.suspend`` gates",
        ("200", _object(["resumed"], resumed={"type": "boolean"})),
        parameters=[RUN_ID], body=_fields(),
        errors={**UNKNOWN_RUN, "409": "the run waits only for an approval or an event"},
        action="resume")},
    "/runs/{run_id}/retry": {"post": _operation(
        "retry", "Run a failed or cancelled run again",
        ("200", _object(["retried"], retried={"type": "boolean"})),
        parameters=[RUN_ID], body=_fields(),
        errors={**UNKNOWN_RUN, "409": "the run is neither failed nor cancelled"},
        action="retry")},
    "/runs/{run_id}/fork": {"post": _operation(
        "fork", "A new run from the run's steps up to ``from_step``",
        ("202", _object(["run_id"], run_id=_STR)), parameters=[RUN_ID],
        body=_required(["from_step"], from_step=_STR, run_id=_nullable(_STR),
                       keep_decisions={"type": "boolean"}),
        errors={**UNKNOWN_RUN, "409": "the new run id is another run's"}, action="fork")},
    "/runs/{run_id}/approvals/{name}": {"post": _operation(
        "approve", "Decide an approval gate, as the caller",
        ("200", _object(["approved", "step"], approved={"type": "boolean"},
                        step=_ref("Step"))),
        parameters=[RUN_ID, GATE],
        body=_required(["decision"], decision=_ANY, by=_nullable(_STR)),
        errors={**UNKNOWN_RUN, "409": "the run does not wait on this gate, or the "
                "decision or its approver does not fit it"}, action="approve")},
    "/runs/{run_id}/events/{name}": {"post": _operation(
        "send_event", "Send an event to the run",
        ("200", _object(["sent", "event"], sent={"type": "boolean"},
                        event=_ref("SentEvent"))),
        parameters=[RUN_ID, EVENT_NAME], body=_fields(payload=_ANY, key=_nullable(_STR)),
        errors={**UNKNOWN_RUN, "409": "the run has ended, or kept as many events as it may",
                "413": "the payload is over the run's limit on an event's size",
                "503": "the store kept failing (``may_be_kept`` says whether the event may "
                       "be in the run)"}, action="send_event")},
    "/workflows/{workflow}/runs": {"post": _operation(
        "start", "Start a run of the workflow",
        ("202", _object(["run_id"], run_id=_STR)), parameters=[WORKFLOW],
        body=_fields(input=_ANY, run_id=_nullable(_STR)),
        errors={"400": "the input does not fit the workflow", "404": "no such workflow",
                "409": "the run id is taken by another run"}, action="start")},
    "/schedules": {"get": _operation(
        "schedules", "The schedules whose runs the caller may read, by name",
        ("200", _object(["schedules"], schedules={"type": "array",
                                                  "items": _ref("Schedule")})),
        parameters=[])},
}
for _name, _key, _code, _verb in (("pause", "paused", "200", "Pause"),
                                  ("resume", "resumed", "200", "Resume"),
                                  ("trigger", "run_id", "202", "Start a run of")):
    _ok = (_object([_key, "schedule"], **{_key: {"type": "boolean"}},
                   schedule=_ref("Schedule")) if _key != "run_id"
           else _object(["run_id"], run_id=_STR))
    PATHS[f"/schedules/{{name}}/{_name}"] = {"post": _operation(
        f"{_name}_schedule", f"{_verb} the schedule", (_code, _ok), parameters=[SCHEDULE],
        body=_fields(), errors={"404": "no such schedule, or one the caller's run filter "
                                       "hides"}, action=f"{_name}_schedule")}

DESCRIPTION = """\
The JSON API of pikku-celery's Flask and Django adapters (docs: guide/web-api).

Paths are relative to the API's mount point (``/pikku/api`` by default): ``servers`` is
``../api``, resolved against where this document was read (``<prefix>/api/openapi.json``).

Authentication is the deployment's own (``PIKKU_AUTHORIZE``: a session cookie, a token...),
so no security scheme is declared: every operation, this document's included, answers 401
to a caller ``authorize`` refuses who is not signed in, 403 to one it refuses who is.
Every POST takes an ``application/json`` body only (415 otherwise; ``{}`` for a route that
takes nothing) and passes the cross-site checks (Django: the ``csrftoken`` cookie's value
in ``X-CSRFToken``; Flask: no cross-site ``Sec-Fetch-Site`` or ``Origin`` unless
``PIKKU_TRUSTED_ORIGINS`` names it): 403 when refused."""

DOCUMENT: Schema = {
    "openapi": "3.1.0",
    "info": {"title": "pikku-celery JSON API", "version": VERSION,
             "description": DESCRIPTION},
    "servers": [{"url": "../api", "description": "where this document was read from"}],
    "paths": PATHS,
    "components": {"schemas": SCHEMAS, "responses": RESPONSES},
}


def document() -> Schema:
    """The OpenAPI document (a copy: callers may change it)."""
    return copy.deepcopy(DOCUMENT)


def dumps() -> str:
    """The document as published in the docs site."""
    return json.dumps(DOCUMENT, indent=2) + "\n"


if __name__ == "__main__":  # python -m pikku_celery.contrib._openapi > docs/guide/...json
    sys.stdout.write(dumps())
