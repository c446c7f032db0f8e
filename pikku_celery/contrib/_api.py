"""The JSON API over a ``PikkuCelery``, free of any web framework.

The Django and Flask adapters translate requests and responses; everything a request goes
through is decided here, once, in this order:

1. the caller is authorized for the route's action (``read``, ``start``, ``cancel``,
   ``resume``, ``approve``) by the adapter's ``authorize(request, action, run_id)``: 401 for an
   anonymous caller, 403 for one without the right;
2. a POST body must be ``application/json`` (415 otherwise: a cross-site form can only send
   ``text/plain``, form or multipart bodies), at most ``max_body_bytes`` (413), and nested
   no deeper than MongoDB stores (400);
3. the handler calls the app's public methods; errors map to statuses here: unknown run or
   workflow 404, bad input (pikku's ``InvalidInputError`` only) 400, a run id taken by
   another run or a refused approval 409, anything else 500 with no detail: any other
   ``ValueError``, a ``PikkuConfigurationError`` (the engine is built at its first use,
   which can be a request) and every unexpected error are logged, never served (a
   driver's message or a traceback can quote a connection string).

An approval is recorded as given by the caller the adapter identified (Django: the
signed-in user; Flask: ``PIKKU_IDENTIFY``), never by whoever the body's ``by`` names: a
``by`` that is not the caller is refused (403), and so is any ``by`` when the adapter cannot
tell who the caller is (an approval without ``by`` is recorded with no approver, which only
a gate without approvers takes).

Served records carry errors as ``type`` and ``message`` only; their ``traceback`` (and
those of error-shaped values nested in step data, such as a compensation's input) is
served only with ``show_tracebacks``. Every route requires an authorized caller, so a
traceback only ever reaches a caller allowed to ``read``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from pikku_celery.app import PikkuCelery
from pikku_celery.errors import (
    InvalidInputError,
    PikkuConfigurationError,
    WorkflowApprovalError,
    WorkflowNotFoundError,
    WorkflowRunConflictError,
    WorkflowRunNotFoundError,
)
from pikku_celery.validate import MAX_DOCUMENT_DEPTH

log = logging.getLogger("pikku_celery.contrib")

Response = tuple[int, Any]
#: ``authorize(request, action, run_id) -> bool``; ``run_id`` is ``None`` for ``runs`` and
#: ``start``.
Authorize = Callable[[Any, str, "str | None"], bool]
#: ``identify(request) -> str | None``: the caller's name, an approval's ``by``.
Identify = Callable[[Any], "str | None"]

READ, START, CANCEL, RESUME, APPROVE = "read", "start", "cancel", "resume", "approve"
ACTIONS = (READ, START, CANCEL, RESUME, APPROVE)
ALLOW_LOCAL = "allow-local"
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
DEFAULT_LIMIT = 50
MAX_LIMIT = 200
JSON_TYPE = "application/json"
_ERROR_FIELDS = ("type", "message")


@dataclass(frozen=True)
class ApiOptions:
    """What the adapters read from their settings (``PIKKU_SHOW_TRACEBACKS``,
    ``PIKKU_MAX_BODY_BYTES``)."""

    show_tracebacks: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class ApiError(Exception):
    """A refusal with its status, served as ``{"error": ..., "message": ...}``."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message

    def response(self) -> Response:
        return self.status, {"error": self.error, "message": self.message}


def not_authenticated() -> ApiError:
    return ApiError(401, "NotAuthenticated", "log in to use the pikku API")


def forbidden(action: str) -> ApiError:
    return ApiError(403, "PermissionDenied", f"not allowed to {action} runs")


def internal_error() -> Response:
    """The one answer to a failure that is the server's: no detail (it is in the log)."""
    return 500, {"error": "InternalError",
                 "message": "the server could not answer; the error is in its log"}


# --- serving records ---------------------------------------------------------------------


def to_json(record: Any) -> Any:
    """A read model as plain JSON (datetimes as ISO 8601 strings)."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {k: to_json(v) for k, v in dataclasses.asdict(record).items()}
    if isinstance(record, datetime):
        return record.isoformat()
    if isinstance(record, Mapping):
        return {k: to_json(v) for k, v in record.items()}
    if isinstance(record, list | tuple):
        return [to_json(v) for v in record]
    return record


def present(record: Any, *, show_tracebacks: bool) -> Any:
    """A run, step or attempt as served: its ``error`` as type and message only (plus the
    traceback when shown), and no traceback in error-shaped values nested anywhere else."""
    served = to_json(record)
    if isinstance(served, dict) and isinstance(served.get("error"), dict):
        error = served["error"]
        kept = _ERROR_FIELDS + (("traceback",) if show_tracebacks else ())
        served["error"] = {k: error[k] for k in kept if k in error}
    return served if show_tracebacks else _without_tracebacks(served)


def _without_tracebacks(value: Any) -> Any:
    # Iterative: a step's data may nest up to MongoDB's 100 levels.
    root: list[Any] = [value]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, key = stack.pop()
        item = parent[key]
        if isinstance(item, dict):
            if "traceback" in item and "type" in item and "message" in item:
                item = {k: v for k, v in item.items() if k != "traceback"}
                parent[key] = item
            stack.extend((item, k) for k in item)
        elif isinstance(item, list):
            stack.extend((item, i) for i in range(len(item)))
    return root[0]


# --- request bodies ----------------------------------------------------------------------


def parse_body(raw: bytes | str) -> Any:
    """A request body as JSON (``None`` when empty). Not JSON is a 400; a body nested deeper
    than Python's parser recurses (a few thousand levels) raises ``RecursionError``,
    refused here as bad input rather than answered with a 500; a shallower body that is
    still too deep to store is refused by the input checks like any other value."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except RecursionError:
        raise InvalidInputError(
            f"the request body is nested too deeply (MongoDB stores at most "
            f"{MAX_DOCUMENT_DEPTH} levels per document)") from None
    except ValueError as exc:
        raise ApiError(400, "InvalidJSON", f"the request body is not JSON: {exc}") from None


def read_json_body(content_type: str | None, content_length: int | None,
                   read_at_most: Callable[[int], bytes], max_bytes: int) -> Any:
    """The JSON body of a POST. ``content_type`` is the bare media type; ``read_at_most(n)``
    reads up to ``n`` bytes (a chunked body has no length to check first)."""
    if (content_type or "").strip().lower() != JSON_TYPE:
        raise ApiError(415, "UnsupportedMediaType",
                       f"send the request body as {JSON_TYPE} (got {content_type or 'none'})")
    if content_length is not None and content_length > max_bytes:
        raise _too_large(max_bytes)
    raw = read_at_most(max_bytes + 1)
    if len(raw) > max_bytes:
        raise _too_large(max_bytes)
    return parse_body(raw)


def content_length(header: str | None) -> int | None:
    """The ``Content-Length`` header as sent, as a number (``None``: none, or a chunked
    body); one that is not a number of bytes is the caller's mistake (400), never a 500."""
    if not header:
        return None
    text = header.strip()
    if not (text.isascii() and text.isdigit()):
        raise ApiError(400, "BadRequest", "the Content-Length header is not a number")
    return int(text)


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, "RequestTooLarge", f"the request body is over {max_bytes} bytes")


# --- who may call ------------------------------------------------------------------------


def cross_origin_refusal(header: Callable[[str], str | None], host: str,
                         trusted_origins: Collection[str] = ()) -> str | None:
    """Why a state-changing request comes from another site, or ``None``.

    For frameworks without CSRF protection of their own (Flask); ``header(name)`` reads a
    request header. Browsers say where a request comes from: ``Sec-Fetch-Site`` (every
    current browser) or, failing that, ``Origin``, compared with the ``Host`` the request
    was sent to. A request with neither is not a browser's cross-site request (a script,
    curl, an old browser's same-origin request)."""
    origin = header("Origin")
    if origin is not None and origin in trusted_origins:
        return None
    site = header("Sec-Fetch-Site")
    if site is not None:
        return None if site in ("same-origin", "none") else f"Sec-Fetch-Site: {site}"
    if origin is None:
        return None
    if urlsplit(origin).netloc.lower() != host.lower():
        return f"Origin {origin} is not {host}"
    return None


_LOCAL_NAMES = {"localhost", "127.0.0.1", "[::1]"}
_FORWARDED = ("Forwarded", "X-Forwarded-For", "X-Real-Ip")


def is_local_request(remote_addr: str | None, host: str,
                     header: Callable[[str], str | None]) -> bool:
    """``PIKKU_AUTHORIZE = "allow-local"``: a request from this machine, sent to a loopback
    name (a page from the internet that rebinds its name to 127.0.0.1 sends its own
    ``Host``), not relayed by a proxy on this machine (it adds a forwarding header)."""
    try:
        loopback = remote_addr is not None and ipaddress.ip_address(remote_addr).is_loopback
    except ValueError:
        return False
    hostname = host.lower().rsplit(":", 1)[0] if not host.endswith("]") else host.lower()
    return (loopback and hostname in _LOCAL_NAMES
            and not any(header(h) for h in _FORWARDED))


def import_authorize(value: Any, setting: str) -> Authorize | str:
    """``PIKKU_AUTHORIZE`` as a callable (or ``"allow-local"``): a callable, or the dotted
    path of one (``"myproj.auth.can_use_pikku"`` or ``"myproj.auth:can_use_pikku"``)."""
    if value == ALLOW_LOCAL:
        return ALLOW_LOCAL
    authorize: Authorize = _callable_setting(
        value, setting, f"a callable (request, action, run_id) -> bool, a dotted path to "
                        f"one, or {ALLOW_LOCAL!r}")
    return authorize


def import_identify(value: Any, setting: str) -> Identify:
    """``PIKKU_IDENTIFY`` as a callable: a callable, or the dotted path of one."""
    identify: Identify = _callable_setting(
        value, setting, "a callable (request) -> the caller's name (str) or None, or a "
                        "dotted path to one")
    return identify


def _callable_setting(value: Any, setting: str, expected: str) -> Any:
    """A setting that is a callable or the dotted path of one."""
    if isinstance(value, str):
        value = import_dotted(value, setting)
    if not callable(value):
        raise TypeError(f"{setting} must be {expected}; got {value!r}")
    return value


def caller_of(identify: Identify | None, request: Any, setting: str) -> str | None:
    """Who ``identify(request)`` says the caller is (``None``: it cannot tell). Anything
    but a non-empty ``str`` or ``None`` is the deployment's mistake (a 500, logged)."""
    if identify is None:
        return None
    caller = identify(request)
    if caller is None or (isinstance(caller, str) and caller):
        return caller
    raise PikkuConfigurationError(f"{setting} returned a value of type "
                                  f"{type(caller).__name__}: it must return the caller's "
                                  "name (a non-empty str), or None when it cannot tell")


def import_dotted(path: str, setting: str) -> Any:
    """``"pkg.module:attr"`` or ``"pkg.module.attr"``."""
    import importlib

    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"{setting} = {path!r} cannot be imported: {exc}") from exc
    if found is None:
        raise ImportError(f"{setting} = {path!r} is not a dotted path")
    return found


# --- the routes --------------------------------------------------------------------------


def handle(call: Callable[[], Response]) -> Response:
    """Run a handler and map its failure to a status, once for both frameworks."""
    try:
        return call()
    except ApiError as exc:
        return exc.response()
    except (WorkflowRunNotFoundError, WorkflowNotFoundError) as exc:
        return 404, {"error": type(exc).__name__, "message": str(exc)}
    except (WorkflowRunConflictError, WorkflowApprovalError) as exc:
        # An approval refused: the run does not wait on it, or the decision or its
        # approver does not fit the gate; nothing was recorded.
        return 409, {"error": type(exc).__name__, "message": str(exc)}
    except InvalidInputError as exc:
        # Only pikku's own: the message describes the caller's input. Any other ValueError
        # (a driver refusing a configured URL, a bad setting) is the server's, and its
        # message can quote a password.
        return 400, {"error": type(exc).__name__, "message": str(exc)}
    except PikkuConfigurationError as exc:
        # The deployment's mistake, not the caller's: named in the log (the message names
        # the setting and masks passwords), never served.
        log.error("pikku API: pikku is misconfigured: %s", exc)
        return internal_error()
    except Exception:
        # Never the message: a driver's error can quote a URL with its password.
        log.exception("pikku API: unexpected error")
        return internal_error()


UNKNOWN_CALLER = (
    "the server cannot tell who you are, so it cannot record an approval in anyone's name "
    "(the body says 'by': {by!r}). Send the decision without 'by' (only a gate without "
    "approvers takes it), or have the server identify its callers: in Flask, set "
    "PIKKU_IDENTIFY to a callable (request) -> the caller's name; in Django, sign in (the "
    "approval is recorded as given by the signed-in user)")


class RunsApi:
    """The handlers; each returns ``(status, payload)``."""

    def __init__(self, pikku: PikkuCelery, options: ApiOptions = ApiOptions(), *,
                 caller: str | None = None) -> None:
        self.pikku = pikku
        self.options = options
        # Who the adapter authenticated (Django: the user's username; Flask: what
        # PIKKU_IDENTIFY returns), or ``None``. An approval is recorded as given by them,
        # never by whoever the body names; without a caller, a body naming ``by`` is
        # refused (403) and an approval without it is recorded with no approver.
        self.caller = caller

    def _present(self, record: Any) -> Any:
        return present(record, show_tracebacks=self.options.show_tracebacks)

    def list_runs(self, query: Mapping[str, str]) -> Response:
        raw = query.get("limit", str(DEFAULT_LIMIT))
        try:
            limit = int(raw)
        except ValueError:
            raise InvalidInputError(f"limit must be an integer, got {raw!r}") from None
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidInputError(f"limit must be from 1 to {MAX_LIMIT}, got {limit}")
        before = query.get("before")
        runs = self.pikku.list_runs(
            workflow=query.get("workflow"), status=query.get("status"), limit=limit,
            created_before=self.pikku.get_run(before) if before else None)
        return 200, {"runs": [self._present(r) for r in runs],
                     "next": runs[-1].run_id if len(runs) == limit else None}

    def get_run(self, run_id: str) -> Response:
        return 200, self._present(self.pikku.get_run(run_id))

    def get_steps(self, run_id: str) -> Response:
        return 200, {"steps": [self._present(s) for s in self.pikku.get_steps(run_id)]}

    def get_history(self, run_id: str) -> Response:
        return 200, {"attempts": [self._present(a) for a in self.pikku.get_history(run_id)]}

    def start(self, workflow: str, body: Any) -> Response:
        fields = _fields(body, allowed=("input", "run_id"),
                         what="'input' (and optionally 'run_id')")
        try:
            run_id = self.pikku.start(workflow, fields.get("input"),
                                      run_id=fields.get("run_id"))
        except WorkflowRunConflictError:
            # Not which workflow owns it: a caller allowed to start may not read that run.
            raise ApiError(409, "WorkflowRunConflictError",
                           f"run id {fields.get('run_id')!r} is taken by a run of another "
                           "workflow or with another input") from None
        return 202, {"run_id": run_id}

    def cancel(self, run_id: str, body: Any) -> Response:
        reason = _fields(body, allowed=("reason",), what="an optional 'reason'").get("reason")
        return 200, {"cancelled": self.pikku.cancel(run_id, reason)}

    def resume(self, run_id: str, body: Any) -> Response:
        _fields(body, allowed=(), what="nothing")
        return 200, {"resumed": self.pikku.resume(run_id)}

    def approve(self, run_id: str, name: str, body: Any) -> Response:
        what = "a 'decision' and an optional 'by'"
        fields = _fields(body, allowed=("decision", "by"), what=what)
        if "decision" not in fields:
            raise InvalidInputError(f"the body must be a JSON object with {what}")
        by = fields.get("by")
        if by is not None and not isinstance(by, str):
            raise InvalidInputError(f"'by' must be a string, got {by!r}")
        if self.caller is not None:
            if by is not None and by != self.caller:
                raise ApiError(403, "Forbidden", f"you are {self.caller!r}: you cannot "
                                                 f"approve as {by!r}")
            by = self.caller
        elif by is not None:
            # Whoever PIKKU_AUTHORIZE lets approve could otherwise name any approver.
            raise ApiError(403, "Forbidden", UNKNOWN_CALLER.format(by=by))
        step = self.pikku.approve(run_id, name, fields["decision"], by=by)
        return 200, {"approved": True, "step": self._present(step)}


def _fields(body: Any, *, allowed: tuple[str, ...], what: str) -> Mapping[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, Mapping):
        raise InvalidInputError(f"the body must be a JSON object with {what}")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
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
        """Read the body (POST) and run the handler; every failure becomes a response."""
        def call() -> Response:
            body = read_body() if self.method == "POST" else None
            return self.call(api, params, query, body)
        return handle(call)


ROUTES = (
    Route("runs", "GET", "api/runs", READ, lambda api, p, q, b: api.list_runs(q)),
    Route("run", "GET", "api/runs/<run_id>", READ, lambda api, p, q, b: api.get_run(p["run_id"])),
    Route("steps", "GET", "api/runs/<run_id>/steps", READ,
          lambda api, p, q, b: api.get_steps(p["run_id"])),
    Route("history", "GET", "api/runs/<run_id>/history", READ,
          lambda api, p, q, b: api.get_history(p["run_id"])),
    Route("cancel", "POST", "api/runs/<run_id>/cancel", CANCEL,
          lambda api, p, q, b: api.cancel(p["run_id"], b)),
    Route("resume", "POST", "api/runs/<run_id>/resume", RESUME,
          lambda api, p, q, b: api.resume(p["run_id"], b)),
    Route("approve", "POST", "api/runs/<run_id>/approvals/<name>", APPROVE,
          lambda api, p, q, b: api.approve(p["run_id"], p["name"], b)),
    Route("start", "POST", "api/workflows/<workflow>/runs", START,
          lambda api, p, q, b: api.start(p["workflow"], b)),
)
