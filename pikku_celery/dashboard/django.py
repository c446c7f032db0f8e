"""The dashboard in Django: pages beside the JSON API in
``pikku_celery.contrib.django.urls`` (``pikku/``: the runs page; ``pikku/runs/<run_id>``:
a run; ``pikku/schedules``: the schedules), behind the same ``PIKKU_AUTHORIZE`` (staff
users by default) with the action each needs (``read`` for a page,
``cancel``/``resume``/``retry``/``fork`` for a button or the fork form, ``approve`` told
the gate for a decision form, ``pikku/runs/<run_id>/approvals/<name>``, ``send_event`` for
the Send event form, ``pikku/runs/<run_id>/events``, then told the event typed;
``pause_schedule``, ``resume_schedule``, ``trigger_schedule`` with ``run_id`` ``None``,
told the schedule, for the Schedules page's forms,
``pikku/schedules/<name>/pause|resume|trigger``). The forms carry Django's CSRF
token and their views are ``csrf_protect``-ed (with or without ``CsrfViewMiddleware``,
which passes them by: they check the form's type and size, then CSRF, before anything
reads the form); every page sets the CSRF cookie (``ensure_csrf_cookie``).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.middleware.csrf import get_token
from django.shortcuts import resolve_url
from django.urls import path, reverse
from django.views.decorators.csrf import csrf_exempt, csrf_protect, ensure_csrf_cookie
from django.views.decorators.http import require_http_methods

from pikku_celery.contrib._access import named
from pikku_celery.contrib._api import APPROVE, SEND_EVENT
from pikku_celery.contrib.django import project_pikku
from pikku_celery.contrib.django.views import caller, options
from pikku_celery.dashboard._http import PageError, check_form, security_headers
from pikku_celery.dashboard._pages import ACTIONS, Dashboard, Page, View
from pikku_celery.dashboard._schedules import VERBS, act_on_schedule, schedules_page

CSRF_FIELD = "csrfmiddlewaretoken"  # what csrf_protect reads from a form


def _serve(request: HttpRequest, action: str, run_id: str | None,
           page: Callable[[Dashboard, View], Page],
           about: Mapping[str, str] | None = None) -> HttpResponse:
    """Authorize ``action`` (told ``about``: ``_access.named``), then serve ``page``."""
    board = Dashboard(project_pikku(), options())
    base = reverse("pikku:dashboard")
    nonce = secrets.token_urlsafe(16)
    who = caller(request)

    def login() -> str:
        return (str(resolve_url(settings.LOGIN_URL)) + "?"
                + urlencode({"next": request.get_full_path()}))

    refused = board.refusal(who, action, run_id, base, login, about)
    if refused is not None:
        return _respond(refused, nonce)
    view = View(base=base, query=request.GET, caller=who,
                csrf=(CSRF_FIELD, get_token(request)), nonce=nonce)
    try:
        return _respond(page(board, view), nonce)
    except PageError as exc:
        return _respond(board.error(exc.status, exc.title, exc.message, base), nonce)


def _respond(page: Page, nonce: str) -> HttpResponse:
    response: HttpResponse
    if page.redirect is not None:
        response = HttpResponseRedirect(page.redirect, status=303)
    else:
        response = HttpResponse(page.html, status=page.status,
                                content_type="text/html; charset=utf-8")
    for name, value in security_headers(nonce).items():
        response[name] = value
    return response


@require_http_methods(["GET"])
@ensure_csrf_cookie
def runs_view(request: HttpRequest) -> HttpResponse:
    return _serve(request, "read", None, lambda board, view: board.runs_page(view))


@require_http_methods(["GET"])
@ensure_csrf_cookie
def run_view(request: HttpRequest, run_id: str) -> HttpResponse:
    return _serve(request, "read", run_id, lambda board, view: board.run_page(view, run_id))


Act = Callable[[HttpRequest, Dashboard, View, dict[str, str]], Page]


def _form_view(action: str, act: Act) -> Callable[..., HttpResponse]:
    """A form's POST for ``action``: its type and size checked, then Django's CSRF check,
    then ``act(request, board, view, path parameters)``. Authorized for ``action`` on the
    path's run (``None`` for a schedule's form), told the gate of an approval or the
    schedule acted on (``_access.named``)."""
    def checked(request: HttpRequest, **params: str) -> HttpResponse:
        return _serve(request, action, params.get("run_id"),
                      lambda board, view: act(request, board, view, params),
                      named(action, params.get("name")))

    protected = csrf_protect(checked)

    def view(request: HttpRequest, **params: str) -> HttpResponse:
        # The size and type of the form before anything reads it (csrf_protect does); a
        # Content-Length that is not a number is a 400 here, not int()'s ValueError.
        try:
            check_form(request.content_type, request.META.get("CONTENT_LENGTH"))
        except PageError as exc:
            return HttpResponse(exc.message, status=exc.status, content_type="text/plain")
        response: HttpResponse = protected(request, **params)
        return response

    view.__name__ = f"pikku_dashboard_{action}"
    guarded: Any = require_http_methods(["POST"])(view)
    # CsrfViewMiddleware would read the form (request.POST) before this view checks its
    # type and size, and Django's own body reader raises ValueError (a 500) on a
    # Content-Length that is not a number. So the middleware passes this view by, and the
    # view runs the very same check itself (csrf_protect above), after check_form.
    return csrf_exempt(guarded)  # type: ignore[no-any-return]


def _action_view(action: str) -> Callable[..., HttpResponse]:
    """A run's form: a button (``cancel``, ``resume``, ``retry``), the fork form, a
    decision (``approve``, with the gate's ``name`` from the path) or an event
    (``send_event``)."""
    def act(request: HttpRequest, board: Dashboard, view: View, params: dict[str, str]
            ) -> Page:
        run_id = params["run_id"]
        if action == APPROVE:
            return board.decide(view, run_id, params["name"], request.POST)
        if action == SEND_EVENT:
            return board.send_event(view, run_id, request.POST)
        return board.act(view, run_id, action, request.POST)
    return _form_view(action, act)


def _schedule_action_view(action: str) -> Callable[..., HttpResponse]:
    """A Schedules page form: pause, resume or trigger the schedule ``name``."""
    def act(request: HttpRequest, board: Dashboard, view: View, params: dict[str, str]
            ) -> Page:
        return act_on_schedule(board, view, params["name"], action)
    return _form_view(action, act)


@require_http_methods(["GET"])
@ensure_csrf_cookie
def schedules_view(request: HttpRequest) -> HttpResponse:
    return _serve(request, "read", None, schedules_page)


urlpatterns = [
    path("", runs_view, name="dashboard"),
    path("runs/<str:run_id>", run_view, name="dashboard-run"),
    *(path(f"runs/<str:run_id>/{action}", _action_view(action), name=f"dashboard-{action}")
      for action in ACTIONS),
    path("runs/<str:run_id>/approvals/<str:name>", _action_view(APPROVE),
         name="dashboard-approve"),
    path("runs/<str:run_id>/events", _action_view(SEND_EVENT), name="dashboard-send-event"),
    path("schedules", schedules_view, name="dashboard-schedules"),
    *(path(f"schedules/<str:name>/{verb}", _schedule_action_view(action),
           name=f"dashboard-{action.replace('_', '-')}") for action, verb in VERBS.items()),
]
