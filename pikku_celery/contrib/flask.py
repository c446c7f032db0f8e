"""Flask: ``PikkuFlask(pikku=None)`` and ``init_app(app)``, the standard extension pattern.

``init_app`` reads ``PIKKU_*`` keys from ``app.config``:

- ``PIKKU_URL_PREFIX`` (default ``"/pikku"``): where the JSON API is mounted (routes in
  ``_api.ROUTES``, under ``<prefix>/api/``); ``None`` mounts nothing.
- ``PIKKU_AUTHORIZE`` (required to mount the API): a callable ``(request, action, run_id)
  -> bool`` or its dotted path (one that also takes a ``gate``, ``event``, ``schedule`` or
  ``input`` keyword is told which gate an approval decides, which event is sent, which
  schedule is acted on, a start's input: ``contrib._access``). ``False`` is a 403; call
  ``abort(401)`` in it for a 401. The old ``"allow-local"`` is refused with what to use
  instead (``contrib._access``).
- ``PIKKU_RUN_FILTER`` (default none): a callable ``(request) -> {"input.<field>": value}
  | None`` or its dotted path: the runs the caller may read, as a store query (the
  listing, its cursor, the dashboard's counts; another run reads as unknown), and the
  only runs they may start.
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

from collections.abc import Mapping
from typing import Any

from flask import Flask, current_app

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib import _access, _api
from pikku_celery.contrib._flask_web import EXTENSION, PikkuState, blueprint, state
from pikku_celery.model.errors import PikkuConfigurationError
from pikku_celery.operate.cli import bound

__all__ = ["PikkuFlask", "PikkuState", "current_pikku", "trusted_origins"]

DEFAULT_URL_PREFIX = "/pikku"
WEB_SETTINGS = frozenset({"PIKKU_URL_PREFIX", "PIKKU_AUTHORIZE", "PIKKU_IDENTIFY",
                          "PIKKU_RUN_FILTER", "PIKKU_SHOW_TRACEBACKS", "PIKKU_MAX_BODY_BYTES",
                          "PIKKU_TRUSTED_ORIGINS", "PIKKU_CELERY_APP"})
NO_AUTHORIZE = (
    "pikku: PIKKU_AUTHORIZE is not set, and the pikku API will not be mounted without it "
    "(it starts, reads and cancels runs). Set app.config['PIKKU_AUTHORIZE'] to a callable "
    "(request, action, run_id) -> bool, or its dotted path ('myapp.auth:can_use_pikku'); "
    f"action is one of {', '.join(repr(a) for a in _access.ACTIONS)}. To look at runs "
    "from this machine without a login, run `flask pikku dashboard` (a random token in the "
    "URL it prints). Or set PIKKU_URL_PREFIX = None to mount no API.")


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
        rules = None
        if prefix is not None:
            if config.get("PIKKU_AUTHORIZE") is None:
                raise PikkuConfigurationError(NO_AUTHORIZE)
            identify = config.get("PIKKU_IDENTIFY")
            rules = _access.Rules(
                authorize=_access.import_authorize(config["PIKKU_AUTHORIZE"],
                                                   "PIKKU_AUTHORIZE"),
                run_filter=_access.import_run_filter(config.get("PIKKU_RUN_FILTER"),
                                                     "PIKKU_RUN_FILTER"),
                identify=None if identify is None else _access.import_identify(
                    identify, "PIKKU_IDENTIFY"))
        app.extensions[EXTENSION] = PikkuState(
            pikku=self.pikku if self.pikku is not None else _find_pikku(app),
            rules=rules,
            options=_api.ApiOptions(
                show_tracebacks=bool(config.get("PIKKU_SHOW_TRACEBACKS", False)),
                max_body_bytes=int(config.get("PIKKU_MAX_BODY_BYTES",
                                              _api.DEFAULT_MAX_BODY_BYTES))),
            trusted_origins=trusted_origins(config.get("PIKKU_TRUSTED_ORIGINS")))
        if self.pikku is not None:
            _copy_settings(app, self.pikku.app)
        if prefix is not None:
            app.register_blueprint(blueprint(), url_prefix=prefix)
        app.cli.add_command(bound(lambda: state(app).pikku,
                                  web_checks=lambda: web_problems(app)))


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
    return state(current_app).pikku


def web_problems(app: Flask) -> list[str]:
    """What ``flask pikku check`` reports of this app's web settings: a session cookie a
    browser would send over plain HTTP, to scripts, or with another site's requests (it
    carries the dashboard's CSRF token, and your login if ``PIKKU_AUTHORIZE`` reads it)."""
    config = app.config
    found = []
    if not config.get("SESSION_COOKIE_SECURE") and not app.debug:
        found.append("the Flask session cookie is not Secure (SESSION_COOKIE_SECURE = "
                     "False): a browser sends it over plain HTTP too; set it True behind HTTPS")
    if not config.get("SESSION_COOKIE_HTTPONLY", True):
        found.append("the Flask session cookie is readable by scripts "
                     "(SESSION_COOKIE_HTTPONLY = False)")
    if config.get("SESSION_COOKIE_SAMESITE") not in ("Lax", "Strict"):
        found.append("the Flask session cookie goes with other sites' requests "
                     "(SESSION_COOKIE_SAMESITE is not 'Lax' or 'Strict')")
    return found


def _find_pikku(app: Flask) -> PikkuCelery:
    named = app.config.get("PIKKU_CELERY_APP")
    if isinstance(named, str):
        named = _access.import_dotted(named, "PIKKU_CELERY_APP")
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
