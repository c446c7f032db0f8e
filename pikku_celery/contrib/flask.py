"""Flask: ``PikkuFlask(pikku=None)`` and ``init_app(app)``, the standard extension pattern.

``init_app`` reads ``PIKKU_*`` keys from ``app.config``:

- ``PIKKU_URL_PREFIX`` (default ``"/pikku"``): where the JSON API is mounted (routes in
  ``_api.ROUTES``, under ``<prefix>/api/``); ``None`` mounts nothing.
- ``PIKKU_AUTHORIZE`` (required to mount the API): a callable ``(request, action, run_id)
  -> bool`` or its dotted path, or ``"allow-local"`` (development only: requests from this
  machine to a loopback name). ``False`` is a 403; call ``abort(401)`` in it for a 401.
- ``PIKKU_IDENTIFY`` (default none): a callable ``(request) -> str | None`` or its dotted
  path, naming the caller (with Flask-Login, ``current_user.get_id()`` when
  ``current_user.is_authenticated``; a verified token's subject); ``None`` when it cannot
  tell. An approval (``POST .../approvals/<name>``) is
  recorded as given by that name: a body whose ``by`` is another name is refused (403).
  Without ``PIKKU_IDENTIFY`` (or when it returns ``None``) the server cannot tell who
  approves, so a body naming ``by`` is refused (403) and an approval without ``by`` is
  recorded with no approver (only a gate without ``approvers`` takes it). It is called
  for an approval, after ``PIKKU_AUTHORIZE`` allowed it; ``abort(401)`` in it is a 401.
- ``PIKKU_SHOW_TRACEBACKS`` (default off), ``PIKKU_MAX_BODY_BYTES`` (default 1 MiB),
  ``PIKKU_TRUSTED_ORIGINS`` (origins allowed to POST from another site, default none: a
  list, or one string of origins separated by commas or whitespace, as
  ``from_prefixed_env()`` reads ``FLASK_PIKKU_TRUSTED_ORIGINS``).
- ``PIKKU_CELERY_APP``: the Celery app (or its dotted path) when ``PikkuFlask`` was given
  no ``PikkuCelery``; default ``app.extensions["celery"]``, where Flask's Celery guide
  keeps it. Its ``PikkuCelery`` is used, or created (``PikkuCelery(celery_app)``).
- every other ``PIKKU_<NAME>`` (``PIKKU_MONGO_URL``, ``PIKKU_REDIS_URL``,
  ``PIKKU_KEY_PREFIX``...) becomes the Celery app's ``pikku_<name>`` setting unless that
  is set already, for a ``PikkuCelery`` that builds its store and leases from it.

Cross-site requests: Flask has no CSRF protection of its own and your ``PIKKU_AUTHORIZE``
may trust the session cookie, which a browser sends with a request another site makes. So
every POST must be ``application/json`` (a cross-site form or a no-preflight ``fetch`` can
only send ``text/plain``, form or multipart bodies: 415), and a POST a browser marks as
cross-site (``Sec-Fetch-Site``, else an ``Origin`` that is not the request's ``Host``) is
refused with 403 unless its origin is in ``PIKKU_TRUSTED_ORIGINS``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Flask, current_app, jsonify, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException

from pikku_celery.app import PikkuCelery
from pikku_celery.cli import bound
from pikku_celery.contrib import _api
from pikku_celery.errors import PikkuConfigurationError

EXTENSION = "pikku"
DEFAULT_URL_PREFIX = "/pikku"
WEB_SETTINGS = frozenset({"PIKKU_URL_PREFIX", "PIKKU_AUTHORIZE", "PIKKU_IDENTIFY",
                          "PIKKU_SHOW_TRACEBACKS", "PIKKU_MAX_BODY_BYTES",
                          "PIKKU_TRUSTED_ORIGINS", "PIKKU_CELERY_APP"})
NO_AUTHORIZE = (
    "pikku: PIKKU_AUTHORIZE is not set, and the pikku API will not be mounted without it "
    "(it starts, reads and cancels runs). Set app.config['PIKKU_AUTHORIZE'] to a callable "
    "(request, action, run_id) -> bool, or its dotted path ('myapp.auth:can_use_pikku'); "
    "action is one of 'read', 'start', 'cancel', 'resume', 'approve'. For local "
    "development only, PIKKU_AUTHORIZE = 'allow-local' allows requests from 127.0.0.1. Or set "
    "PIKKU_URL_PREFIX = None to mount no API.")


@dataclass(frozen=True)
class PikkuState:
    """What ``init_app`` put in ``app.extensions["pikku"]``."""

    pikku: PikkuCelery
    authorize: _api.Authorize | str | None
    options: _api.ApiOptions
    trusted_origins: Collection[str]
    identify: _api.Identify | None = None


class PikkuFlask:
    """``PikkuFlask(pikku)`` or ``PikkuFlask()`` then ``init_app(app)`` in your factory."""

    def __init__(self, pikku: PikkuCelery | None = None, app: Flask | None = None) -> None:
        self.pikku = pikku
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Bind to ``app``: its ``PikkuCelery``, the API blueprint, ``flask pikku``."""
        config = app.config
        prefix = config.get("PIKKU_URL_PREFIX", DEFAULT_URL_PREFIX)
        authorize = identify = None
        if prefix is not None:
            if config.get("PIKKU_AUTHORIZE") is None:
                raise PikkuConfigurationError(NO_AUTHORIZE)
            authorize = _api.import_authorize(config["PIKKU_AUTHORIZE"], "PIKKU_AUTHORIZE")
            if config.get("PIKKU_IDENTIFY") is not None:
                identify = _api.import_identify(config["PIKKU_IDENTIFY"], "PIKKU_IDENTIFY")
        app.extensions[EXTENSION] = PikkuState(
            pikku=self.pikku if self.pikku is not None else _find_pikku(app),
            authorize=authorize,
            options=_api.ApiOptions(
                show_tracebacks=bool(config.get("PIKKU_SHOW_TRACEBACKS", False)),
                max_body_bytes=int(config.get("PIKKU_MAX_BODY_BYTES",
                                              _api.DEFAULT_MAX_BODY_BYTES))),
            trusted_origins=trusted_origins(config.get("PIKKU_TRUSTED_ORIGINS")),
            identify=identify)
        if self.pikku is not None:
            _copy_settings(app, self.pikku.app)
        if prefix is not None:
            app.register_blueprint(blueprint(), url_prefix=prefix)
        app.cli.add_command(bound(lambda: _state(app).pikku))


def trusted_origins(value: Any) -> tuple[str, ...]:
    """``PIKKU_TRUSTED_ORIGINS``: a list (any iterable) of origins, or one string of them
    separated by commas or whitespace (what ``app.config.from_prefixed_env()`` makes of
    ``FLASK_PIKKU_TRUSTED_ORIGINS=https://admin.example.com``); ``None``: none. Anything
    else is refused: iterated as it is, it would trust no origin it names."""
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(value.replace(",", " ").split())
    got = type(value).__name__
    if not isinstance(value, (bytes, bytearray, Mapping)):
        try:
            origins = list(value)
        except TypeError:
            pass
        else:
            wrong = [o for o in origins if not isinstance(o, str)]
            if not wrong:
                return tuple(o.strip() for o in origins if o.strip())
            got = f"a {got} holding {type(wrong[0]).__name__}"
    raise PikkuConfigurationError(
        "PIKKU_TRUSTED_ORIGINS must be a list of origins or one string of them separated by "
        "commas or spaces ('https://admin.example.com, https://ops.example.com'), got "
        f"{got}")


def current_pikku() -> PikkuCelery:
    """The ``PikkuCelery`` of the current Flask app."""
    return _state(current_app).pikku


def _state(app: Flask) -> PikkuState:
    state: PikkuState = app.extensions[EXTENSION]
    return state


def _find_pikku(app: Flask) -> PikkuCelery:
    named = app.config.get("PIKKU_CELERY_APP")
    if isinstance(named, str):
        named = _api.import_dotted(named, "PIKKU_CELERY_APP")
    celery_app = named if named is not None else app.extensions.get("celery")
    if celery_app is None:
        raise PikkuConfigurationError(
            "PikkuFlask() was given no PikkuCelery and found no Celery app: pass "
            "PikkuFlask(pikku), or put your Celery app in app.extensions['celery'] (as "
            "Flask's Celery guide does) or name it in app.config['PIKKU_CELERY_APP'] "
            "before init_app(app)")
    if isinstance(celery_app, PikkuCelery):
        return celery_app
    _copy_settings(app, celery_app)
    found = getattr(celery_app, "pikku", None)
    return found if isinstance(found, PikkuCelery) else PikkuCelery(celery_app)


def _copy_settings(app: Flask, celery_app: Any) -> None:
    for key, value in app.config.items():
        if key.startswith("PIKKU_") and key not in WEB_SETTINGS:
            name = key.lower()
            if celery_app.conf.get(name) is None:
                celery_app.conf[name] = value


# --- the API -----------------------------------------------------------------------------


def blueprint() -> Blueprint:
    """The API's routes and the dashboard's pages; each view reads its settings from the
    current app."""
    from pikku_celery.dashboard.flask import add_routes

    bp = Blueprint("pikku", __name__)
    for route in _api.ROUTES:
        bp.add_url_rule("/" + route.path, route.name, _view(route), methods=[route.method])
    add_routes(bp)
    return bp


def _view(route: _api.Route) -> Callable[..., ResponseReturnValue]:
    def view(**params: str) -> ResponseReturnValue:
        status, payload = _api.handle(lambda: _serve(route, params))
        return jsonify(payload), status
    return view


def _serve(route: _api.Route, params: dict[str, str]) -> _api.Response:
    state = _state(current_app)
    try:
        if route.method == "POST":
            why = _api.cross_origin_refusal(request.headers.get, request.host,
                                            state.trusted_origins)
            if why is not None:
                raise _api.ApiError(403, "CrossSiteRequest",
                                    f"refused a cross-site request ({why})")
        _authorize(state, route.action, params.get("run_id"))
        caller = None
        if route.action == _api.APPROVE:  # the approver (None: a body's ``by`` is refused)
            caller = _api.caller_of(state.identify,
                                    request._get_current_object(),  # type: ignore[attr-defined]
                                    "PIKKU_IDENTIFY")
        api = _api.RunsApi(state.pikku, state.options, caller=caller)
        return route.serve(api, params, request.args,
                           lambda: _read_body(state.options.max_body_bytes, route.action))
    except HTTPException as exc:  # abort(401) in PIKKU_AUTHORIZE
        raise _http_error(exc, route.action) from None


def _read_body(max_bytes: int, action: str) -> Any:
    try:
        return _api.read_json_body(request.mimetype, request.content_length,
                                   request.stream.read, max_bytes)
    except HTTPException as exc:  # Flask's own MAX_CONTENT_LENGTH
        raise _http_error(exc, action) from None


def _authorize(state: PikkuState, action: str, run_id: str | None) -> None:
    if state.authorize == _api.ALLOW_LOCAL:
        allowed = _api.is_local_request(request.remote_addr, request.host,
                                          request.headers.get)
    else:
        assert callable(state.authorize)
        allowed = bool(state.authorize(request._get_current_object(),  # type: ignore[attr-defined]
                                       action, run_id))
    if not allowed:
        raise _api.forbidden(action)


def _http_error(exc: HTTPException, action: str) -> _api.ApiError:
    if exc.code == 401:
        return _api.not_authenticated()
    if exc.code == 403:
        return _api.forbidden(action)
    return _api.ApiError(exc.code or 500, (exc.name or "HTTPError").replace(" ", ""),
                         exc.description or "")
