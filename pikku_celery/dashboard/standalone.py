"""``pikku dashboard``: the dashboard (and the JSON API) as a Flask app of its own.

Who gets in, in this order: ``authorize`` (a callable ``(request, action, run_id) ->
bool`` or its dotted path, as ``PIKKU_AUTHORIZE``) decides every request when given; else
with a ``token``, whoever opens ``/?token=<token>`` once (the token is kept in the signed
session cookie) or sends ``Authorization: Bearer <token>``; else only requests from this
machine to a loopback name (``"allow-local"``). The CLI refuses to bind anything but
loopback without an authorize callable or a token.

None of these names the caller, so the JSON API here records approvals with no approver:
a body naming ``by`` is refused (403), and a decision without it is taken only by a gate
without approvers. To record who approves, mount ``PikkuFlask`` in your own app with
``PIKKU_IDENTIFY``.

``make_app`` returns a WSGI app: behind a real server,
``gunicorn 'pikku_celery.dashboard.standalone:from_env()'`` (reads the same settings from
``PIKKU_DASHBOARD_*`` environment variables) serves it on many threads.

The session cookie (the token login, the buttons' CSRF token) is signed with a secret key:
``PIKKU_DASHBOARD_SECRET_KEY`` (``from_env()`` and ``pikku dashboard``; at least 32
characters) when set, else one drawn at random when the app is made. A random key is
enough for one process, but every process draws its own: under ``gunicorn -w 4`` a cookie
one worker signed is refused by the others (401s and failed CSRF checks at random), and
every restart logs everyone out. Give every process the same key. It is never printed or
logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Any
from urllib.parse import urlencode

from flask import Flask, abort, redirect, request, session
from flask.typing import ResponseReturnValue

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib._api import ALLOW_LOCAL, Authorize, import_authorize

TOKEN_SESSION_KEY = "pikku_token"
SECRET_KEY_ENV = "PIKKU_DASHBOARD_SECRET_KEY"
MIN_SECRET_KEY_CHARS = 32


def make_app(pikku: PikkuCelery, *, authorize: Authorize | str | None = None,
             token: str | None = None, show_tracebacks: bool = False,
             secret_key: str | bytes | None = None) -> Flask:
    """A Flask app serving the dashboard at ``/`` and the JSON API at ``/api/``.
    ``secret_key`` signs its session cookie (``None``: a random one, for this process
    only)."""
    from pikku_celery.contrib.flask import PikkuFlask

    if secret_key is not None and len(secret_key) < MIN_SECRET_KEY_CHARS:
        # Never the key itself in the message: it is one line on a terminal or in a log.
        raise ValueError(
            f"a dashboard secret key ({SECRET_KEY_ENV}) must have at least "
            f"{MIN_SECRET_KEY_CHARS} characters; make one with "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'")

    if authorize is not None:
        rule: Authorize | str = import_authorize(authorize, "--authorize")
    elif token is not None:
        if len(token) < 16:
            raise ValueError("a dashboard token must have at least 16 characters")
        rule = _token_rule(token)
    else:
        rule = ALLOW_LOCAL
    app = Flask("pikku_celery.dashboard")
    app.config.update(
        SECRET_KEY=secret_key if secret_key is not None else secrets.token_bytes(32),
        SESSION_COOKIE_NAME="pikku_dashboard", SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax", MAX_CONTENT_LENGTH=1024 * 1024,
        PIKKU_URL_PREFIX="", PIKKU_AUTHORIZE=rule, PIKKU_SHOW_TRACEBACKS=show_tracebacks)
    if token is not None and authorize is None:
        app.before_request(_token_login(token))
    PikkuFlask(pikku).init_app(app)
    return app


def _digest(token: str) -> str:
    return hashlib.sha256(b"pikku-dashboard:" + token.encode()).hexdigest()


def _token_rule(token: str) -> Authorize:
    expected = _digest(token)

    def authorize(req: Any, action: str, run_id: str | None) -> bool:
        kept = session.get(TOKEN_SESSION_KEY, "")
        header = request.headers.get("Authorization", "")
        sent = _digest(header[7:]) if header.startswith("Bearer ") else ""
        if hmac.compare_digest(str(kept), expected) or hmac.compare_digest(sent, expected):
            return True
        abort(401)
    return authorize


def _token_login(token: str) -> Any:
    expected = _digest(token)

    def login() -> ResponseReturnValue | None:
        sent = request.args.get("token")
        if sent is None or request.method != "GET":
            return None
        if not hmac.compare_digest(_digest(sent), expected):
            abort(401)
        session[TOKEN_SESSION_KEY] = expected
        # The same page without the token in its address (history, Referer, screenshots).
        rest = [(k, v) for k, v in request.args.items(multi=True) if k != "token"]
        return redirect(request.path + (f"?{urlencode(rest)}" if rest else ""), 303)
    return login


def secret_key_from_env() -> str | None:
    """``PIKKU_DASHBOARD_SECRET_KEY``, or ``None`` when it is not set."""
    return os.environ.get(SECRET_KEY_ENV)


def from_env() -> Flask:
    """For a WSGI server: the app of ``PIKKU_DASHBOARD_CELERY_APP`` (``"proj.celery:app"``)
    with ``PIKKU_DASHBOARD_AUTHORIZE`` or ``PIKKU_DASHBOARD_TOKEN``, its session signed
    with ``PIKKU_DASHBOARD_SECRET_KEY`` (needed with more than one worker process)."""
    from pikku_celery.app import get_pikku
    from pikku_celery.contrib._api import import_dotted

    celery_app = import_dotted(os.environ["PIKKU_DASHBOARD_CELERY_APP"],
                               "PIKKU_DASHBOARD_CELERY_APP")
    return make_app(get_pikku(celery_app),
                    authorize=os.environ.get("PIKKU_DASHBOARD_AUTHORIZE"),
                    token=os.environ.get("PIKKU_DASHBOARD_TOKEN"),
                    secret_key=secret_key_from_env())
