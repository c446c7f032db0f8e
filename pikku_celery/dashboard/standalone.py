"""``pikku dashboard``: the dashboard (and the JSON API) as a WSGI app of its own, served by
waitress, a production WSGI server (a bounded pool of threads, a cap on connections and a
timeout for idle clients), guarded against slow and greedy clients before any request
reaches the app (``_guard``): at most 8 open connections per client address, and 10 s for
a client to send a whole request, which a trickle of bytes cannot extend. Exposed beyond
this host, it goes behind a reverse proxy (``docs/guide/dashboard-nginx.conf``).

Who gets in: ``authorize`` (a callable ``(request, action, run_id) -> bool`` or its dotted
path, as ``PIKKU_AUTHORIZE``) decides every request when given; else a **token**: whoever
opens ``/?token=<token>`` once (the token is then kept in the signed session cookie, and
the browser sent on to the same page without it) or sends ``Authorization: Bearer
<token>``. The token comes from ``PIKKU_DASHBOARD_TOKEN`` only (a command-line argument
shows in ``ps`` and shell history); without it, ``pikku dashboard`` on loopback draws a
random one per process and prints the URL carrying it once, as Jupyter does. Loopback
alone lets nobody in: a proxy, ``ssh -R`` or a port-forward on this host looks local.

The session cookie is ``HttpOnly``, ``SameSite=Lax`` and ``Secure`` unless ``plain_http``
(which ``pikku dashboard`` sets only when it serves plain HTTP on a loopback address and
was not told that browsers reach it over HTTPS). It is signed with
``PIKKU_DASHBOARD_SECRET_KEY`` (at least 32 characters) when set, else with a key drawn
at random when the app is made: enough for one process, but every process draws its own,
so a server with several worker processes must set it. It is never printed or logged.

Who the caller is: neither the token nor ``authorize`` names anyone, so by default the
dashboard records approvals with no approver: its decision forms are offered only for
gates without approvers, and the JSON API refuses a body naming ``by`` (403). To decide a
gate that names approvers, either mount the dashboard in your app, which identifies its
users (``PikkuFlask`` with ``PIKKU_IDENTIFY``; Django's signed-in user), or put the
standalone dashboard behind a proxy that signs users in and names them in a header, and
name that header here: ``identity_header`` (``pikku dashboard --identity-header
X-Forwarded-User``, ``PIKKU_DASHBOARD_IDENTITY_HEADER``). Off by default, and trusted only
when set: the header's value is then the caller's name (the approval's ``by``, the
approver checked), so the proxy must set it on every request, replacing any the client
sent (nginx's ``proxy_set_header`` does), and the dashboard must be reachable only through
that proxy (bind it to loopback). A request without the header names no one. The token
(or ``authorize``) still decides who gets in.

Access log: ``serve`` logs one line per request on ``pikku_celery.dashboard.access`` with
the value of every query parameter the app reads as ``token`` replaced by ``***``: the
query is split and each name decoded as the app decodes it, so ``?%74oken=`` (which logs
in) is masked as ``?token=`` is; ``RedactTokens`` does the same for another server's
access log (``logging.getLogger("gunicorn.access").addFilter(RedactTokens())``;
``from_env()`` adds it to gunicorn's and werkzeug's loggers).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote_plus, urlencode

from pikku_celery.dashboard import missing_extra

try:
    from flask import Flask, abort, redirect, request, session
    from flask.typing import ResponseReturnValue
except ModuleNotFoundError as exc:  # say which extra brings it, not only its name
    raise missing_extra(exc) from exc

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib import _access, _api
from pikku_celery.contrib._flask_web import EXTENSION, PikkuState, blueprint

TOKEN_SESSION_KEY = "pikku_token"
TOKEN_ENV = "PIKKU_DASHBOARD_TOKEN"
SECRET_KEY_ENV = "PIKKU_DASHBOARD_SECRET_KEY"
MIN_SECRET_KEY_CHARS = 32
MIN_TOKEN_CHARS = 16
#: waitress: threads serving requests, open connections at most (more wait in the listen
#: backlog), and seconds a connection may sit idle (sending or reading nothing) before it
#: is closed.
THREADS = 8
CONNECTION_LIMIT = 64
CHANNEL_TIMEOUT_S = 30
#: Open connections from one client address at most (more are answered 503 and closed),
#: and seconds a client has to send a whole request (headers and body) once its
#: connection waits for one, whatever it sends meanwhile (``_guard``).
CONNECTIONS_PER_ADDRESS = 8
REQUEST_DEADLINE_S = 10.0
MAX_REQUEST_BODY_BYTES = 1024 * 1024
MAX_HEADER_BYTES = 64 * 1024
IDENTITY_HEADER_ENV = "PIKKU_DASHBOARD_IDENTITY_HEADER"
#: A header that can name the caller: an HTTP token without ``_`` (servers drop or merge
#: such names: ``X_User`` would reach the app as ``X-User``, past a proxy setting it).
_HEADER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,99}")
#: Headers waitress removes (it trusts no proxy) or that carry something else.
_NOT_AN_IDENTITY = frozenset({
    "forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto",
    "x-forwarded-port", "x-forwarded-by", "authorization", "cookie", "host",
    "content-type", "content-length", "origin", "referer"})
#: A ``name=value`` of a query in a line of text: what follows ``?``, ``&``, ``;`` or a
#: space, up to the next of them (``name`` is matched as sent, percent-encoded or not).
_PAIR_IN_TEXT = re.compile(r"(^|[?&;\s])([^=?&;\s\"']+)=([^&;\s\"']*)")
#: The separators of a query's parameters (``;`` as older parsers read it too).
_SEPARATORS = re.compile(r"([&;])")
access_log = logging.getLogger("pikku_celery.dashboard.access")


def make_app(pikku: PikkuCelery, *, authorize: _access.Authorize | str | None = None,
             token: str | None = None, show_tracebacks: bool = False,
             secret_key: str | bytes | None = None, plain_http: bool = False,
             identity_header: str | None = None) -> Flask:
    """A Flask app serving the dashboard at ``/`` and the JSON API at ``/api/``, letting
    in the callers ``authorize`` allows, else whoever has ``token``; one of them is
    required. ``secret_key`` signs its session cookie (``None``: a random one, for this
    process only). ``plain_http``: served over plain HTTP on loopback, so the cookie
    cannot be ``Secure``. ``identity_header``: the header a proxy names its signed-in
    user in (``None``: no caller is named; see the module)."""
    identify = None if identity_header is None else header_identity(identity_header)
    if secret_key is not None and len(secret_key) < MIN_SECRET_KEY_CHARS:
        # Never the key itself in the message: it is one line on a terminal or in a log.
        raise ValueError(
            f"a dashboard secret key ({SECRET_KEY_ENV}) must have at least "
            f"{MIN_SECRET_KEY_CHARS} characters; make one with "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    if authorize is not None:
        rule = _access.import_authorize(authorize, "--authorize")
    elif token is not None:
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"a dashboard token ({TOKEN_ENV}) must have at least "
                             f"{MIN_TOKEN_CHARS} characters")
        rule = _token_rule(token)
    else:
        raise ValueError(f"the dashboard needs an authorize callable or a token "
                         f"({TOKEN_ENV}): loopback is not an identity")
    app = Flask("pikku_celery.dashboard")
    app.config.update(
        SECRET_KEY=secret_key if secret_key is not None else secrets.token_bytes(32),
        SESSION_COOKIE_NAME="pikku_dashboard", SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax", SESSION_COOKIE_SECURE=not plain_http,
        MAX_CONTENT_LENGTH=MAX_REQUEST_BODY_BYTES)
    if token is not None and authorize is None:
        app.before_request(_token_login(token))
    app.extensions[EXTENSION] = PikkuState(
        pikku=pikku, rules=_access.Rules(authorize=rule, identify=identify),
        options=_api.ApiOptions(show_tracebacks=show_tracebacks))
    app.register_blueprint(blueprint(), url_prefix="")
    return app


def header_identity(header: str) -> _access.Identify:
    """``identify`` reading the caller's name from the request's ``header`` (set by the
    proxy in front); ``None`` when the request has none, or an empty one, or several (a
    value with a comma: a client's header the proxy appended to rather than replaced).
    Raises ``ValueError`` for a name that cannot be a proxy's identity header."""
    if not _HEADER_NAME.fullmatch(header) or header.lower() in _NOT_AN_IDENTITY:
        raise ValueError(
            f"{header!r} cannot be the identity header: name a header your proxy sets to "
            "the signed-in user (letters, digits and '-', such as X-Forwarded-User; not "
            "one of " + ", ".join(sorted(_NOT_AN_IDENTITY)) + ")")

    def identify(req: Any) -> str | None:
        sent = req.headers.get(header)
        if not sent:
            return None
        with contextlib.suppress(UnicodeError):  # WSGI reads latin-1: a proxy sends UTF-8
            sent = sent.encode("latin-1").decode("utf-8")
        name = str(sent).strip()
        return name if name and "," not in name else None
    return identify


def new_token() -> str:
    """A random token for one ``pikku dashboard`` process."""
    return secrets.token_urlsafe(32)


def _digest(token: str) -> str:
    return hashlib.sha256(b"pikku-dashboard:" + token.encode()).hexdigest()


def _token_rule(token: str) -> _access.Authorize:
    expected = _digest(token)

    def authorize(req: Any, action: str, run_id: str | None) -> bool:
        kept = session.get(TOKEN_SESSION_KEY, "")
        header = request.headers.get("Authorization", "")
        sent = _digest(header[7:]) if header.startswith("Bearer ") else ""
        if hmac.compare_digest(str(kept), expected) or hmac.compare_digest(sent, expected):
            return True
        abort(401)
    return authorize


def _token_login(token: str) -> Callable[[], ResponseReturnValue | None]:
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


# --- serving --------------------------------------------------------------------------------


def is_token_name(sent: str) -> bool:
    """Whether a query parameter's name, as sent, is ``token`` once decoded as the app
    decodes it (``%74oken``, ``t%6Fken`` and ``+token+`` log in as ``token`` does, so
    they are masked too). Decoded until it no longer changes and compared without case:
    masking a parameter that would not log in costs nothing."""
    name = sent
    for _ in range(5):
        decoded = unquote_plus(name)
        if decoded == name:
            break
        name = decoded
    return name.strip().lower() == "token"


def redact_query(query: str) -> str:
    """A raw query string with the value of every parameter whose decoded name is
    ``token`` as ``***`` (its name and every other parameter as sent): the query as the
    app parses it, not as its text reads, which a percent-encoded name would slip past."""
    parts = _SEPARATORS.split(query)
    for i in range(0, len(parts), 2):
        name = parts[i].partition("=")[0]
        if is_token_name(name):
            parts[i] = f"{name}=***"
    return "".join(parts)


def redact_tokens(text: str) -> str:
    """``text`` (a log line of any server) with the value of every query parameter whose
    decoded name is ``token`` (``is_token_name``) as ``***``."""
    def masked(found: re.Match[str]) -> str:
        return (f"{found[1]}{found[2]}=***" if is_token_name(found[2])
                else found[0])
    return _PAIR_IN_TEXT.sub(masked, text)


class RedactTokens(logging.Filter):
    """A logging filter that masks ``token=`` values in a record's message (an access log
    line of any server)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_tokens(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


class AccessLog:
    """WSGI middleware: one line per request (method, path and query with tokens masked
    by ``redact_query``, status) on ``pikku_celery.dashboard.access``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Iterable[bytes]:
        def logged(status: str, headers: Any, *rest: Any) -> Any:
            query = redact_query(environ.get("QUERY_STRING", ""))
            path = redact_tokens(environ.get("PATH_INFO", "")) + (f"?{query}" if query
                                                                 else "")
            access_log.info("%s %s %s %s", environ.get("REMOTE_ADDR", "-"),
                            environ.get("REQUEST_METHOD", "-"), path,
                            status.split(" ", 1)[0])
            return start_response(status, headers, *rest)
        result: Iterable[bytes] = self.app(environ, logged)
        return result


def create_server(app: Flask, host: str, port: int, *,
                  connections_per_address: int | None = CONNECTIONS_PER_ADDRESS,
                  request_deadline_s: float = REQUEST_DEADLINE_S) -> Any:
    """A waitress server for ``app`` on ``host:port`` (not yet serving: call ``run()``),
    with at most ``connections_per_address`` open connections per client address
    (``None``: no cap) and ``request_deadline_s`` for a client to send a request."""
    try:
        import waitress  # noqa: F401  (first: a missing waitress is named as such)

        from pikku_celery.dashboard import _guard
    except ModuleNotFoundError as exc:
        raise missing_extra(exc) from exc

    return _guard.create_server(
        AccessLog(app), connections_per_address=connections_per_address,
        request_deadline_s=request_deadline_s, host=host, port=port, threads=THREADS,
        connection_limit=CONNECTION_LIMIT, channel_timeout=CHANNEL_TIMEOUT_S,
        max_request_body_size=MAX_REQUEST_BODY_BYTES,
        max_request_header_size=MAX_HEADER_BYTES, expose_tracebacks=False,
        ident="pikku", clear_untrusted_proxy_headers=True)


def secret_key_from_env() -> str | None:
    """``PIKKU_DASHBOARD_SECRET_KEY``, or ``None`` when it is not set."""
    return os.environ.get(SECRET_KEY_ENV)


def token_from_env() -> str | None:
    """``PIKKU_DASHBOARD_TOKEN``, or ``None`` when it is not set (or empty)."""
    return os.environ.get(TOKEN_ENV) or None


def from_env() -> Flask:
    """For a WSGI server: the app of ``PIKKU_DASHBOARD_CELERY_APP`` (``"proj.celery:app"``)
    with ``PIKKU_DASHBOARD_AUTHORIZE`` or ``PIKKU_DASHBOARD_TOKEN``, its session signed
    with ``PIKKU_DASHBOARD_SECRET_KEY`` (needed with more than one worker process), its
    cookie ``Secure`` (put it behind HTTPS), its callers named by the header
    ``PIKKU_DASHBOARD_IDENTITY_HEADER`` when set."""
    from pikku_celery.app import get_pikku

    for name in ("gunicorn.access", "werkzeug"):
        logging.getLogger(name).addFilter(RedactTokens())
    celery_app = _access.import_dotted(os.environ["PIKKU_DASHBOARD_CELERY_APP"],
                                       "PIKKU_DASHBOARD_CELERY_APP")
    return make_app(get_pikku(celery_app),
                    authorize=os.environ.get("PIKKU_DASHBOARD_AUTHORIZE"),
                    token=token_from_env(), secret_key=secret_key_from_env(),
                    identity_header=os.environ.get(IDENTITY_HEADER_ENV) or None)
