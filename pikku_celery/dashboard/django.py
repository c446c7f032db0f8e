"""The dashboard in Django: pages beside the JSON API in
``pikku_celery.contrib.django.urls`` (``pikku/``: the runs page; ``pikku/runs/<run_id>``:
a run), behind the same ``PIKKU_AUTHORIZE`` (staff users by default) with the action each
needs (``read`` for a page, ``cancel``/``resume``/``retry``/``fork`` for a button or the fork
form, ``approve`` told the gate for a decision form, ``pikku/runs/<run_id>/approvals/
<name>``, ``send_event`` for the Send event form, ``pikku/runs/<run_id>/events``). The
forms carry
Django's CSRF token and their views are ``csrf_protect``-ed (with or without
``CsrfViewMiddleware``, which passes them by: they check the form's type and size, then
CSRF, before anything reads the form); every page sets the CSRF cookie
(``ensure_csrf_cookie``).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.middleware.csrf import get_token
from django.shortcuts import resolve_url
from django.urls import path, reverse
from django.views.decorators.csrf import csrf_exempt, csrf_protect, ensure_csrf_cookie
from django.views.decorators.http import require_http_methods

from pikku_celery.contrib._api import APPROVE, SEND_EVENT
from pikku_celery.contrib.django import project_pikku
from pikku_celery.contrib.django.views import caller, options
from pikku_celery.dashboard._http import PageError, check_form, security_headers
from pikku_celery.dashboard._pages import ACTIONS, Dashboard, Page, View

CSRF_FIELD = "csrfmiddlewaretoken"  # what csrf_protect reads from a form


def _serve(request: HttpRequest, action: str, run_id: str | None,
           page: Callable[[Dashboard, View], Page], gate: str | None = None) -> HttpResponse:
    board = Dashboard(project_pikku(), options())
    base = reverse("pikku:dashboard")
    nonce = secrets.token_urlsafe(16)
    who = caller(request)

    def login() -> str:
        return (str(resolve_url(settings.LOGIN_URL)) + "?"
                + urlencode({"next": request.get_full_path()}))

    refused = board.refusal(who, action, run_id, base, login, gate)
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


def _action_view(action: str) -> Callable[..., HttpResponse]:
    """A form's POST: a button (``cancel``, ``resume``, ``retry``), the fork form, a
    decision (``approve``, with the gate's ``name`` from the path) or an event
    (``send_event``)."""
    def checked(request: HttpRequest, run_id: str, name: str | None = None) -> HttpResponse:
        def act(board: Dashboard, view: View) -> Page:
            if action == APPROVE:
                assert name is not None
                return board.decide(view, run_id, name, request.POST)
            if action == SEND_EVENT:
                return board.send_event(view, run_id, request.POST)
            return board.act(view, run_id, action, request.POST)
        return _serve(request, action, run_id, act, name)

    protected = csrf_protect(checked)

    def view(request: HttpRequest, run_id: str, **gate: str) -> HttpResponse:
        # The size and type of the form before anything reads it (csrf_protect does); a
        # Content-Length that is not a number is a 400 here, not int()'s ValueError.
        try:
            check_form(request.content_type, request.META.get("CONTENT_LENGTH"))
        except PageError as exc:
            return HttpResponse(exc.message, status=exc.status, content_type="text/plain")
        response: HttpResponse = protected(request, run_id, **gate)
        return response

    view.__name__ = f"pikku_dashboard_{action}"
    guarded: Any = require_http_methods(["POST"])(view)
    # CsrfViewMiddleware would read the form (request.POST) before this view checks its
    # type and size, and Django's own body reader raises ValueError (a 500) on a
    # Content-Length that is not a number. So the middleware passes this view by, and the
    # view runs the very same check itself (csrf_protect above), after check_form.
    return csrf_exempt(guarded)  # type: ignore[no-any-return]


urlpatterns = [
    path("", runs_view, name="dashboard"),
    path("runs/<str:run_id>", run_view, name="dashboard-run"),
    *(path(f"runs/<str:run_id>/{action}", _action_view(action), name=f"dashboard-{action}")
      for action in ACTIONS),
    path("runs/<str:run_id>/approvals/<str:name>", _action_view(APPROVE),
         name="dashboard-approve"),
    path("runs/<str:run_id>/events", _action_view(SEND_EVENT), name="dashboard-send-event"),
]
