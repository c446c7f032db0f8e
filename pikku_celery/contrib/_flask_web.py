"""The Flask adapter of the web core: one blueprint with the JSON API (``_api.ROUTES``) and
the dashboard's pages (``pikku_celery.dashboard.flask``), reading what each request is
served with from the app's ``PikkuState``.

Both the ``PikkuFlask`` extension (``contrib.flask``: settings from ``app.config``, ``flask
pikku``) and the standalone dashboard (``dashboard.standalone``) mount it; neither imports
the other, and the pages get the request's ``Served`` from here as an argument, so the
dashboard imports no Flask extension code.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Flask, current_app, jsonify, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib import _access, _api
from pikku_celery.dashboard.flask import add_routes

EXTENSION = "pikku"


@dataclass(frozen=True)
class PikkuState:
    """What is kept in ``app.extensions["pikku"]``: ``rules`` is ``None`` when no API is
    mounted."""

    pikku: PikkuCelery
    rules: _access.Rules | None
    options: _api.ApiOptions
    trusted_origins: Collection[str] = ()


def state(app: Flask) -> PikkuState:
    found: PikkuState = app.extensions[EXTENSION]
    return found


def served() -> _api.Served:
    """The current request's ``Served``: its caller decided by the app's rules."""
    found = state(current_app)
    assert found.rules is not None  # no rules, no blueprint
    return _api.Served(found.pikku, found.options, _caller(found.rules),
                       found.trusted_origins)


def _caller(rules: _access.Rules) -> _access.Caller:
    req = request._get_current_object()  # type: ignore[attr-defined]

    def check(action: str, run_id: str | None, about: Mapping[str, Any]) -> None:
        try:
            allowed = rules.allowed(req, action, run_id, about)
        except HTTPException as exc:  # abort(401) in PIKKU_AUTHORIZE
            raise http_error(exc, action) from None
        if not allowed:
            raise _api.forbidden(action)

    def name() -> str | None:
        try:
            return _access.caller_name(rules.identify, req, "PIKKU_IDENTIFY")
        except HTTPException as exc:
            raise http_error(exc, _api.APPROVE) from None

    return _access.Caller(rules, req, check, name=name)


def http_error(exc: HTTPException, action: str) -> _api.ApiError:
    if exc.code == 401:
        return _api.not_authenticated()
    if exc.code == 403:
        return _api.forbidden(action)
    return _api.ApiError(exc.code or 500, (exc.name or "HTTPError").replace(" ", ""),
                         exc.description or "")


def blueprint() -> Blueprint:
    """The API's routes and the dashboard's pages."""
    bp = Blueprint("pikku", __name__)
    for route in _api.ROUTES:
        bp.add_url_rule("/" + route.path, route.name, _view(route), methods=[route.method])
    add_routes(bp, served)
    return bp


def _view(route: _api.Route) -> Callable[..., ResponseReturnValue]:
    def view(**params: str) -> ResponseReturnValue:
        status, payload = _api.handle(lambda: _serve(route, params))
        return jsonify(payload), status
    return view


def _serve(route: _api.Route, params: dict[str, str]) -> _api.Response:
    now = served()
    if route.method == "POST":
        why = _api.cross_origin_refusal(request.headers.get, request.host,
                                        now.trusted_origins)
        if why is not None:
            raise _api.ApiError(403, "CrossSiteRequest", f"refused a cross-site request ({why})")
    api = _api.RunsApi(now.pikku, now.options, now.caller)
    return route.serve(api, params, request.args,
                       lambda: _read_body(now.options.max_body_bytes, route.action))


def _read_body(max_bytes: int, action: str) -> Any:
    try:
        return _api.read_json_body(request.mimetype, request.content_length,
                                   request.stream.read, max_bytes)
    except HTTPException as exc:  # Flask's own MAX_CONTENT_LENGTH
        raise http_error(exc, action) from None
