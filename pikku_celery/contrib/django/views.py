"""The JSON API's Django views, one per ``_api.ROUTES`` entry.

Access follows Django's conventions: ``PIKKU_AUTHORIZE`` (a callable or the dotted path of
one, ``(request, action, run_id) -> bool``, told the gate of an approval, the event sent,
the schedule acted on and a start's input when it takes the ``gate``, ``event``,
``schedule`` or ``input`` keyword: ``contrib._access``) decides, and by default only
active staff users get in, as for the admin; ``PIKKU_RUN_FILTER`` (``(request) ->
{"input.<field>": value} | None``) narrows what a caller reads to their runs, as a store
query, and what they start to runs it keeps (see ``contrib._access``). A refused
anonymous caller gets 401, a refused user 403. Every POST goes through Django's CSRF
check (``csrf_protect``, with or without ``CsrfViewMiddleware``): send the ``csrftoken``
cookie's value in ``X-CSRFToken``; every GET sets that cookie.

Each route's action is ``_api.ROUTES``'s: ``read`` for the GET routes (a run's events,
``api/runs/<run_id>/events``, and ``api/schedules``, among them), ``send_event`` for
sending an event (``api/runs/<run_id>/events/<name>``), ``pause_schedule``,
``resume_schedule`` and ``trigger_schedule`` (asked with ``run_id`` ``None``) for
``api/schedules/<name>/pause|resume|trigger``, and so on.

An approval is recorded as given by the signed-in user: a body whose ``by`` names anyone
else is refused (403), and so is any ``by`` from an anonymous caller ``PIKKU_AUTHORIZE``
let in (the server cannot tell who they are; without ``by``, only a gate without approvers
takes their decision).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_protect, ensure_csrf_cookie
from django.views.decorators.http import require_http_methods

from pikku_celery.contrib import _access, _api
from pikku_celery.contrib.django import project_pikku

log = logging.getLogger("pikku_celery.contrib")


def staff_only(request: HttpRequest, action: str, run_id: str | None) -> bool:
    """The default ``PIKKU_AUTHORIZE``: active staff users, for every action."""
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_active and user.is_staff)


def options() -> _api.ApiOptions:
    return _api.ApiOptions(
        show_tracebacks=bool(getattr(settings, "PIKKU_SHOW_TRACEBACKS", False)),
        max_body_bytes=int(getattr(settings, "PIKKU_MAX_BODY_BYTES",
                                   _api.DEFAULT_MAX_BODY_BYTES)))


def rules() -> _access.Rules:
    """The settings' rules, read at every request (tests change settings)."""
    configured = getattr(settings, "PIKKU_AUTHORIZE", None)
    authorize = staff_only if configured is None else _access.import_authorize(
        configured, "PIKKU_AUTHORIZE")
    return _access.Rules(authorize=authorize, run_filter=_access.import_run_filter(
        getattr(settings, "PIKKU_RUN_FILTER", None), "PIKKU_RUN_FILTER"))


def caller(request: HttpRequest) -> _access.Caller:
    """The request's caller: refused anonymous callers get 401, others 403 (raising
    ``PermissionDenied`` in ``PIKKU_AUTHORIZE`` counts as refusing); an approval is
    recorded as given by the signed-in user."""
    found = rules()

    def check(action: str, run_id: str | None, about: Mapping[str, Any]) -> None:
        try:
            allowed = found.allowed(request, action, run_id, about)
        except PermissionDenied:
            allowed = False
        if allowed:
            return
        user = getattr(request, "user", None)
        if not getattr(user, "is_authenticated", False):
            raise _api.not_authenticated()
        raise _api.forbidden(action)

    def name() -> str | None:
        user: Any = getattr(request, "user", None)
        return user.get_username() if getattr(user, "is_authenticated", False) else None

    return _access.Caller(found, request, check, name=name)


def _read_body(request: HttpRequest, max_bytes: int) -> Any:
    length = _api.content_length(request.META.get("CONTENT_LENGTH"))
    return _api.read_json_body(request.content_type, length, request.read, max_bytes)


def make_view(route: _api.Route) -> Callable[..., JsonResponse]:
    def view(request: HttpRequest, **params: str) -> JsonResponse:
        def serve() -> _api.Response:
            api = _api.RunsApi(project_pikku(), options(), caller(request))
            return route.serve(api, params, request.GET,
                               lambda: _read_body(request, api.options.max_body_bytes))
        status, payload = _api.handle(serve)
        return JsonResponse(payload, status=status)

    view.__name__ = f"pikku_{route.name}"
    guarded = require_http_methods([route.method])(view)
    # csrf_protect checks a POST even without CsrfViewMiddleware; ensure_csrf_cookie hands
    # API clients the cookie whose value they send back.
    protect = csrf_protect if route.method == "POST" else ensure_csrf_cookie
    protected: Callable[..., JsonResponse] = protect(guarded)
    return protected


VIEWS = {route.name: make_view(route) for route in _api.ROUTES}
