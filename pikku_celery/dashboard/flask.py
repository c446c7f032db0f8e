"""The dashboard in Flask: pages on the ``PikkuFlask`` extension's blueprint, beside the
JSON API, under ``PIKKU_URL_PREFIX`` (``/pikku/`` by default: the runs page; ``/pikku/runs/
<run_id>``: a run; ``/pikku/schedules``: the schedules). Every request goes through the
caller the adapter makes (``contrib._access.Caller``) with the action it needs (``read``
for a page, ``cancel``/``resume``/``retry``/``fork`` for a button or the fork form,
``approve`` told the gate for a decision form, ``/pikku/runs/<run_id>/approvals/<name>``,
``send_event`` for the Send event form, ``/pikku/runs/<run_id>/events``, then told the
event typed; ``pause_schedule``, ``resume_schedule``, ``trigger_schedule``, with
``run_id`` ``None`` and told the schedule, for the Schedules page's forms,
``/pikku/schedules/<name>/pause|resume|trigger``). This
module imports no Flask extension code: the adapter hands it ``served``
(``contrib._flask_web``).

The buttons POST small urlencoded forms, which a cross-site page can also send, so each
carries a CSRF token kept in Flask's signed session (the app needs a ``SECRET_KEY``;
without one the pages show no buttons), compared in constant time; a POST a browser marks
as cross-site (``Sec-Fetch-Site``, else ``Origin``) is refused first, as for the API.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable, Mapping

from flask import Blueprint, Response, current_app, redirect, request, session, url_for

from pikku_celery.contrib import _api
from pikku_celery.contrib._access import named
from pikku_celery.dashboard._http import PageError, check_form, security_headers
from pikku_celery.dashboard._pages import ACTIONS, Dashboard, Page, View
from pikku_celery.dashboard._schedules import VERBS, act_on_schedule, schedules_page

CSRF_FIELD = "pikku_csrf"
CSRF_SESSION_KEY = "pikku_csrf"
#: What a page is served with for the current request (the adapter's ``served``).
CurrentServed = Callable[[], _api.Served]


def add_routes(bp: Blueprint, served: CurrentServed) -> None:
    """The pages, on the Flask adapter's blueprint (``contrib._flask_web.blueprint``);
    ``served()`` gives each request its app, options and caller."""
    bp.add_url_rule("/", "dashboard", _runs_view(served), methods=["GET"])
    bp.add_url_rule("/runs/<run_id>", "dashboard_run", _run_view(served), methods=["GET"])
    for action in ACTIONS:
        bp.add_url_rule(f"/runs/<run_id>/{action}", f"dashboard_{action}",
                        _action_view(served, action), methods=["POST"])
    bp.add_url_rule("/runs/<run_id>/approvals/<name>", "dashboard_approve",
                    _action_view(served, _api.APPROVE), methods=["POST"])
    bp.add_url_rule("/runs/<run_id>/events", "dashboard_send_event",
                    _action_view(served, _api.SEND_EVENT), methods=["POST"])
    bp.add_url_rule("/schedules", "dashboard_schedules", _schedules_view(served),
                    methods=["GET"])
    for action, verb in VERBS.items():
        bp.add_url_rule(f"/schedules/<name>/{verb}", f"dashboard_{action}",
                        _schedule_action_view(served, action), methods=["POST"])


def _runs_view(served: CurrentServed) -> Callable[[], Response]:
    def view() -> Response:
        return _serve(served, _api.READ, None, lambda board, page: board.runs_page(page))
    return view


def _run_view(served: CurrentServed) -> Callable[[str], Response]:
    def view(run_id: str) -> Response:
        return _serve(served, _api.READ, run_id,
                      lambda board, page: board.run_page(page, run_id))
    return view


def _schedules_view(served: CurrentServed) -> Callable[[], Response]:
    def view() -> Response:
        return _serve(served, _api.READ, None, schedules_page)
    return view


def _schedule_action_view(served: CurrentServed, action: str) -> Callable[[str], Response]:
    """A Schedules page form's POST: ``pause_schedule``, ``resume_schedule`` or
    ``trigger_schedule`` (authorized with ``run_id`` ``None``) on the schedule ``name``."""
    def view(name: str) -> Response:
        def act(board: Dashboard, page_view: View) -> Page:
            _check_post(page_view)
            return act_on_schedule(board, page_view, name, action)
        return _serve(served, action, None, act, named(action, name))
    return view


def _check_post(page_view: View) -> None:
    """What a form's POST passes before anything reads it: not cross-site, a small
    urlencoded form, the session's CSRF token."""
    why = _api.cross_origin_refusal(request.headers.get, request.host,
                                    page_view.trusted_origins)
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


def _action_view(served: CurrentServed, action: str) -> Callable[..., Response]:
    """A form's POST: a button (``cancel``, ``resume``, ``retry``), the fork form, a
    decision (``approve``, with the gate's ``name`` from the path) or an event
    (``send_event``)."""
    def view(run_id: str, name: str | None = None) -> Response:
        def act(board: Dashboard, page_view: View) -> Page:
            _check_post(page_view)
            if action == _api.APPROVE:
                assert name is not None
                return board.decide(page_view, run_id, name, request.form)
            if action == _api.SEND_EVENT:
                return board.send_event(page_view, run_id, request.form)
            return board.act(page_view, run_id, action, request.form)
        return _serve(served, action, run_id, act, named(action, name))
    return view


def _serve(served: CurrentServed, action: str, run_id: str | None,
           page: Callable[[Dashboard, View], Page],
           about: Mapping[str, str] | None = None) -> Response:
    """Authorize ``action`` (told ``about``: ``_access.named``), then serve ``page``."""
    base = url_for("pikku.dashboard")
    nonce = secrets.token_urlsafe(16)
    now = served()
    board = Dashboard(now.pikku, now.options)
    refused = board.refusal(now.caller, action, run_id, base, about=about)
    if refused is not None:
        return _respond(refused, nonce)
    view = View(base=base, query=request.args, caller=now.caller, csrf=_csrf_field(),
                nonce=nonce, trusted_origins=now.trusted_origins)
    try:
        return _respond(page(board, view), nonce)
    except PageError as exc:
        return _respond(board.error(exc.status, exc.title, exc.message, base), nonce)


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
