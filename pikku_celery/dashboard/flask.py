"""The dashboard in Flask: pages on the ``PikkuFlask`` extension's blueprint, beside the
JSON API, under ``PIKKU_URL_PREFIX`` (``/pikku/`` by default: the runs page; ``/pikku/runs/
<run_id>``: a run). Every request goes through the API's ``PIKKU_AUTHORIZE`` with the
action it needs (``read`` for a page, ``cancel``/``resume`` for a button).

The buttons POST small urlencoded forms, which a cross-site page can also send, so each
carries a CSRF token kept in Flask's signed session (the app needs a ``SECRET_KEY``;
without one the pages show no buttons), compared in constant time; a POST a browser marks
as cross-site (``Sec-Fetch-Site``, else ``Origin``) is refused first, as for the API.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, current_app, redirect, request, session, url_for
from werkzeug.exceptions import HTTPException

from pikku_celery.contrib import _api
from pikku_celery.dashboard._pages import (
    ACTIONS,
    Dashboard,
    Page,
    PageError,
    View,
    check_form,
    security_headers,
)

CSRF_FIELD = "pikku_csrf"
CSRF_SESSION_KEY = "pikku_csrf"


def add_routes(bp: Blueprint) -> None:
    """The pages, on the extension's blueprint (``contrib.flask.blueprint``)."""
    bp.add_url_rule("/", "dashboard", runs_view, methods=["GET"])
    bp.add_url_rule("/runs/<run_id>", "dashboard_run", run_view, methods=["GET"])
    for action in ACTIONS:
        bp.add_url_rule(f"/runs/<run_id>/{action}", f"dashboard_{action}",
                        _action_view(action), methods=["POST"])


def runs_view() -> Response:
    return _serve(_api.READ, None, lambda board, view: board.runs_page(view))


def run_view(run_id: str) -> Response:
    return _serve(_api.READ, run_id, lambda board, view: board.run_page(view, run_id))


def _action_view(action: str) -> Callable[..., Response]:
    def view(run_id: str) -> Response:
        def act(board: Dashboard, page_view: View) -> Page:
            why = _api.cross_origin_refusal(request.headers.get, request.host,
                                            _state().trusted_origins)
            if why is not None:
                raise PageError(403, "Cross-site request", f"refused ({why})")
            # The header as sent: werkzeug reads one that is not a number as 0 (an empty
            # form, refused below as a CSRF failure); it is a 400, as in Django.
            check_form(request.mimetype, None if request.content_length is None
                       else request.headers.get("Content-Length"))
            sent = request.form.get(CSRF_FIELD, "")
            kept = session.get(CSRF_SESSION_KEY) if current_app.secret_key else None
            if not kept or not hmac.compare_digest(str(kept), sent):
                raise PageError(403, "CSRF check failed",
                                "the form's token is missing or stale: reload the page")
            return board.act(page_view, run_id, action, request.form)
        return _serve(action, run_id, act)
    return view


def _state() -> Any:
    from pikku_celery.contrib.flask import _state as state

    return state(current_app)


def _serve(action: str, run_id: str | None,
           page: Callable[[Dashboard, View], Page]) -> Response:
    state = _state()
    board = Dashboard(state.pikku, state.options)
    base = url_for("pikku.dashboard")
    nonce = secrets.token_urlsafe(16)
    refused = _refusal(board, action, run_id, base)
    if refused is not None:
        return _respond(refused, nonce)
    view = View(base=base, query=request.args, can=_can, csrf=_csrf_field(), nonce=nonce)
    try:
        return _respond(page(board, view), nonce)
    except PageError as exc:
        return _respond(board.error(exc.status, exc.title, exc.message, base), nonce)


def _refusal(board: Dashboard, action: str, run_id: str | None, base: str) -> Page | None:
    from pikku_celery.contrib.flask import _authorize, _http_error

    try:
        _authorize(_state(), action, run_id)
    except _api.ApiError as exc:
        return board.refused(exc.status, exc.message, base)
    except HTTPException as exc:  # abort(401) in PIKKU_AUTHORIZE
        error = _http_error(exc, action)
        return board.refused(error.status, error.message, base)
    return None


def _can(action: str, run_id: str | None) -> bool:
    """May the caller do ``action``? (For the buttons: a refusal here is just no button.)"""
    from pikku_celery.contrib.flask import _authorize

    try:
        _authorize(_state(), action, run_id)
    except (_api.ApiError, HTTPException):
        return False
    return True


def _csrf_field() -> tuple[str, str] | None:
    if not current_app.secret_key:
        return None  # no session to keep a token in: no forms
    token = session.get(CSRF_SESSION_KEY)
    if not token:
        token = session[CSRF_SESSION_KEY] = secrets.token_urlsafe(32)
    return CSRF_FIELD, str(token)


def _respond(page: Page, nonce: str) -> Response:
    response: Response
    if page.redirect is not None:
        response = redirect(page.redirect, 303)  # type: ignore[assignment]
    else:
        response = Response(page.html, page.status, mimetype="text/html")
    response.headers.update(security_headers(nonce))
    return response
