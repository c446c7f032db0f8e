"""Who may do what over HTTP, free of any web framework: the rules a deployment sets and
the caller one request makes. The JSON API (``_api``), the dashboard's pages
(``pikku_celery.dashboard._pages``) and the three adapters (Django, Flask, the standalone
dashboard) all decide through here.

A deployment's rules (``Rules``) are:

- ``authorize(request, action, run_id)`` (``PIKKU_AUTHORIZE``): may this request do
  ``action`` (``ACTIONS``: ``read``, ``start``, ``cancel``, ``resume``, ``approve``,
  ``retry``, ``fork``, ``send_event``, ``pause_schedule``, ``resume_schedule``,
  ``trigger_schedule``) to run ``run_id`` (``None``: listing, a start without ``run_id``,
  and the schedule actions, which act on no run; reading the schedules is ``read`` with
  ``None``)? A callable that also takes one of ``TOLD``'s keywords (by name, or
  ``**kwargs``) is told it, so a rule can tell one gate, event, schedule or input from
  another: ``gate`` (``approve``: ``authorize(request, "approve", run_id,
  gate="manager")``), ``event`` (``send_event``: the event's name), ``schedule`` (the
  schedule actions: the schedule's name) and ``input`` (``start``: the input of the run
  it would create, asked once, after the body is read, with the body's ``run_id``). A
  3-argument callable is called as before.
- ``run_filter(request)`` (``PIKKU_RUN_FILTER``, optional): the runs this caller may read, as
  a store query: ``{"input.owner": request.user.username}`` keeps the runs whose input's
  ``owner`` is that name (``pikku_celery.store.base.check_run_match`` says what a filter may
  hold); ``None``: no narrowing. The listing, its ``before`` cursor and the dashboard's
  counts are queried with it, a run outside it reads as unknown (404) everywhere, and a
  start must create a run it keeps (``_readable.check_startable``).
- ``identify(request)`` (Flask's ``PIKKU_IDENTIFY``; Django: the signed-in user): the
  caller's name, recorded as an approval's ``by``.

A listing is decided twice: ``authorize(request, "read", None)`` lets the caller list at all,
and every run on the page is then checked with ``authorize(request, "read", run_id)``: a run
it refuses is left out of the page (so a per-run rule alone never serves another's run;
the filter is what keeps pages full and counts exact).

``"allow-local"`` (requests from this machine) is gone: loopback is not an identity (a
proxy, ``ssh -R`` or a port-forward on the same host looks local). ``import_authorize``
refuses it with what to use instead.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pikku_celery.model.errors import InvalidInputError, PikkuConfigurationError
from pikku_celery.store.base import check_run_match

#: The actions ``authorize`` is asked about; ``send_event``: send an event to a run
#: (``pikku.send_event``: the JSON API's ``api/runs/<run_id>/events/<name>`` and the
#: dashboard's Send event form).
READ, START, CANCEL, RESUME, APPROVE, RETRY, FORK, SEND_EVENT = (
    "read", "start", "cancel", "resume", "approve", "retry", "fork", "send_event")
#: A schedule's operations (``pikku.pause_schedule``, ``resume_schedule``,
#: ``trigger_schedule``: the JSON API's ``api/schedules/<name>/<pause|resume|trigger>`` and
#: the dashboard's Schedules page), asked with ``run_id`` ``None``: they act on no run
#: (a trigger starts one, as ``start`` does).
PAUSE_SCHEDULE, RESUME_SCHEDULE, TRIGGER_SCHEDULE = (
    "pause_schedule", "resume_schedule", "trigger_schedule")
SCHEDULE_ACTIONS = (PAUSE_SCHEDULE, RESUME_SCHEDULE, TRIGGER_SCHEDULE)
ACTIONS = (READ, START, CANCEL, RESUME, APPROVE, RETRY, FORK, SEND_EVENT, *SCHEDULE_ACTIONS)

#: The keywords ``authorize`` is told, each only when the callable takes it (by name or
#: ``**kwargs``) and only when known: ``gate`` (``approve``), ``event`` (``send_event``;
#: absent when the dashboard asks whether its Send event form is shown, before a name is
#: typed), ``schedule`` (``SCHEDULE_ACTIONS``) and ``input`` (``start``; given even when
#: it is ``None``, the input of a run started without one).
TOLD = ("gate", "event", "schedule", "input")
#: The keyword a route's ``<name>`` path parameter is told as, by action.
NAMED = {APPROVE: "gate", SEND_EVENT: "event",
         **dict.fromkeys(SCHEDULE_ACTIONS, "schedule")}

#: ``authorize(request, action, run_id[, gate=..., event=..., schedule=..., input=...])
#: -> bool``.
Authorize = Callable[..., bool]
#: ``identify(request) -> str | None``: the caller's name, an approval's ``by``.
Identify = Callable[[Any], "str | None"]
#: ``run_filter(request) -> {"input.<field>": value, ...} | None``.
RunFilter = Callable[[Any], "Mapping[str, Any] | None"]
#: An adapter's check of one action (the action, its run, what ``authorize`` is told):
#: returns, or raises ``_api.ApiError`` (401/403).
Check = Callable[[str, "str | None", "Mapping[str, Any]"], None]

REMOVED_ALLOW_LOCAL = "allow-local"
ALLOW_LOCAL_REMOVED = (
    "{setting} = 'allow-local' is no longer accepted: loopback is not an identity (nginx's "
    "proxy_pass to 127.0.0.1, ssh -R, kubectl port-forward and IDE port forwarding all look "
    "local). Set {setting} to a callable (request, action, run_id) -> bool that checks who "
    "is calling (your login), or serve the dashboard alone with `pikku dashboard`, which "
    "on 127.0.0.1 lets in only whoever opens the URL with the random token it prints")


class ApiError(Exception):
    """A refusal with its status, served as ``{"error": ..., "message": ...}``."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message

    def response(self) -> tuple[int, Any]:
        return self.status, {"error": self.error, "message": self.message}


def not_authenticated() -> ApiError:
    return ApiError(401, "NotAuthenticated", "log in to use the pikku API")


def forbidden(action: str) -> ApiError:
    what = "" if action in SCHEDULE_ACTIONS else " runs"
    return ApiError(403, "PermissionDenied", f"not allowed to {action}{what}")


@dataclass(frozen=True)
class Rules:
    """A deployment's access rules (see the module's docstring)."""

    authorize: Authorize
    run_filter: RunFilter | None = None
    identify: Identify | None = None

    def allowed(self, request: Any, action: str, run_id: str | None,
                about: Mapping[str, Any] | None = None) -> bool:
        """``authorize`` called as its signature takes it: told each keyword of ``about``
        (``TOLD``) it takes, so a 3-argument callable is called as it always was."""
        told = {k: v for k, v in (about or {}).items() if takes(self.authorize, k)}
        return bool(self.authorize(request, action, run_id, **told))


def takes(authorize: Authorize, keyword: str) -> bool:
    """Whether ``authorize`` takes ``keyword`` (named, or ``**kwargs``)."""
    try:
        parameters = inspect.signature(authorize).parameters.values()
    except (TypeError, ValueError):
        return False
    return any((p.name == keyword and p.kind is not p.POSITIONAL_ONLY)
               or p.kind is p.VAR_KEYWORD for p in parameters)


def named(action: str, name: str | None) -> dict[str, str]:
    """What ``authorize`` is told of a route's ``<name>`` for ``action`` (``NAMED``):
    the gate of an approval, the event sent, the schedule acted on; else nothing."""
    keyword = NAMED.get(action)
    return {} if keyword is None or name is None else {keyword: name}


class Caller:
    """One request's caller under the rules, as the JSON API and the pages ask about it.

    ``check(action, run_id, about)`` is the adapter's: it calls the rules with its
    request and what ``authorize`` is told (``TOLD``), and raises ``ApiError`` (401
    anonymous, 403 refused) or returns. ``match`` and ``name`` are read once per request,
    when first needed."""

    def __init__(self, rules: Rules, request: Any, check: Check, *,
                 name: Callable[[], str | None] | None = None) -> None:
        self._rules = rules
        self._request = request
        self._check = check
        self._name = name
        self._match: dict[str, Any] | None = None
        self._match_read = False

    def check(self, action: str, run_id: str | None = None, gate: str | None = None,
              **about: Any) -> None:
        """Refuse (``ApiError``) or pass ``action`` on ``run_id``; ``authorize`` is told
        ``gate`` (when not ``None``) and ``about`` (``event=``, ``schedule=``,
        ``input=``)."""
        if unknown := set(about) - set(TOLD):
            raise TypeError(f"authorize is never told {sorted(unknown)}")
        self._check(action, run_id, {**about, **({} if gate is None else {"gate": gate})})

    def can(self, action: str, run_id: str | None = None, gate: str | None = None,
            **about: Any) -> bool:
        """Whether ``check`` passes (for buttons and a page's rows: a refusal is no row)."""
        try:
            self.check(action, run_id, gate, **about)
        except ApiError:
            return False
        return True

    def takes(self, keyword: str) -> bool:
        """Whether the deployment's ``authorize`` is told ``keyword`` (``TOLD``)."""
        return takes(self._rules.authorize, keyword)

    def match(self) -> dict[str, Any] | None:
        """The run filter for this caller (checked), or ``None`` for every run."""
        if not self._match_read:
            run_filter = self._rules.run_filter
            found = None if run_filter is None else run_filter(self._request)
            if found is not None and not isinstance(found, Mapping):
                raise PikkuConfigurationError(
                    f"PIKKU_RUN_FILTER returned a {type(found).__name__}: it must return a "
                    "mapping such as {'input.owner': name}, or None for every run")
            self._match = None if found is None else _checked_filter(found)
            self._match_read = True
        return self._match

    def name(self) -> str | None:
        return None if self._name is None else self._name()


def _checked_filter(found: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return check_run_match(found)
    except InvalidInputError as exc:  # the deployment's mistake: a 500, logged
        raise PikkuConfigurationError(f"PIKKU_RUN_FILTER returned an unusable filter: "
                                      f"{exc}") from None


# --- settings -----------------------------------------------------------------------------


def import_authorize(value: Any, setting: str) -> Authorize:
    """``PIKKU_AUTHORIZE``: a callable, or the dotted path of one
    (``"myproj.auth.can_use_pikku"`` or ``"myproj.auth:can_use_pikku"``). The removed
    ``"allow-local"`` is a ``PikkuConfigurationError`` saying what to use instead."""
    if value == REMOVED_ALLOW_LOCAL:
        raise PikkuConfigurationError(ALLOW_LOCAL_REMOVED.format(setting=setting))
    authorize: Authorize = callable_setting(
        value, setting, "a callable (request, action, run_id) -> bool, or a dotted path to one")
    return authorize


def import_identify(value: Any, setting: str) -> Identify:
    """``PIKKU_IDENTIFY`` as a callable: a callable, or the dotted path of one."""
    identify: Identify = callable_setting(
        value, setting, "a callable (request) -> the caller's name (str) or None, or a "
                        "dotted path to one")
    return identify


def import_run_filter(value: Any, setting: str) -> RunFilter | None:
    """``PIKKU_RUN_FILTER``: ``None``, a callable ``(request) -> mapping | None``, or the
    dotted path of one."""
    if value is None:
        return None
    run_filter: RunFilter = callable_setting(
        value, setting, "a callable (request) -> {'input.<field>': value} or None, or a "
                        "dotted path to one")
    return run_filter


def callable_setting(value: Any, setting: str, expected: str) -> Any:
    """A setting that is a callable or the dotted path of one."""
    if isinstance(value, str):
        value = import_dotted(value, setting)
    if not callable(value):
        raise TypeError(f"{setting} must be {expected}; got {value!r}")
    return value


def caller_name(identify: Identify | None, request: Any, setting: str) -> str | None:
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
