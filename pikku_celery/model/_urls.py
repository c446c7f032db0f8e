"""Connection URLs in messages: never their secrets.

A configured URL (``pikku_mongo_url``, ``pikku_redis_url``) can carry a password, in its
user information or in a query parameter. Errors and log lines show it through
``redact_url``. A driver's own message about a URL it could not parse may quote a piece of
it (redis-py: ``Port could not be cast to integer value as '<the password up to a />'``),
so it is shown only for a URL that carries no secret.
"""

from __future__ import annotations

MASK = "***"
#: Query parameters whose value can be a secret (matched in lower case, as substrings).
SECRET_PARAMETERS = ("password", "secret", "token", "authmechanismproperties")
#: What a user name or password must percent-encode: a parser reading the URL ends the
#: address at the first of them, and the password's tail becomes host, port or path.
RESERVED_IN_USERINFO = ("/", "?", "#", "@")


def _split(url: str) -> tuple[str, str | None, str]:
    """``(scheme://, userinfo or None, the rest)``. The user information ends at the
    *last* ``@``: a password with an unescaped ``/`` or ``@`` is still all masked."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, after = rest.rpartition("@")
    return scheme + sep, (userinfo if at else None), after


def redact_url(url: str) -> str:
    """``url`` as it may be shown: ``redis://:***@redis.internal:6379/0`` (the user name
    kept, the password masked; user information without a ``:`` masked whole), and the
    values of query parameters that can carry secrets masked too."""
    scheme, userinfo, rest = _split(url)
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        userinfo = f"{user}:{MASK}" if colon else MASK
    address, question, query = rest.partition("?")
    if question:
        query = "&".join(_redact_parameter(p) for p in query.split("&"))
    shown = address + question + query
    return scheme + (f"{userinfo}@" if userinfo is not None else "") + shown


def _redact_parameter(parameter: str) -> str:
    name, equals, value = parameter.partition("=")
    if equals and value and any(s in name.lower() for s in SECRET_PARAMETERS):
        return f"{name}={MASK}"
    return parameter


def carries_secret(url: str) -> bool:
    """Does ``url`` hold anything ``redact_url`` masks?"""
    return redact_url(url) != url


def reserved_in_userinfo(url: str) -> bool:
    """Does the user name or password hold a character it must percent-encode?"""
    userinfo = _split(url)[1]
    return userinfo is not None and any(c in userinfo for c in RESERVED_IN_USERINFO)
