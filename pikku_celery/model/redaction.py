"""Secrets in recorded errors: masked before an error is stored.

A step's or a run's error is stored (the step, its attempt's history entry, the run) and
served from there: ``get_run``/``get_steps``/``get_history``, the CLI, exports, the web API
and the dashboard all read the stored text. A driver's message is where a connection string
sits (``could not connect to postgres://app:S3cretPw@db.internal/x``), so every error the
engine records passes through ``redact_error`` first:

1. the built-in masking (``mask_secrets``): the user information of a URL
   (``postgres://app:***@db.internal/x``; user information without a ``:`` is masked
   whole), the value of a ``name=value`` or ``name: value`` pair whose name contains
   ``password``, ``passwd``, ``pwd``, ``secret``, ``token``, ``api_key``/``apikey``,
   ``access_key``, ``private_key`` or ``credential`` (``password=***``, ``"token": "***"``,
   ``?api_key=***&...``), and a ``Bearer`` credential or any other after ``Authorization:``
   (``Authorization: Basic ***``);
2. then the user's own hook, ``redact_error`` (``PikkuCelery(redact_error=...)`` or the
   ``pikku_redact_error`` setting: a callable ``(text: str) -> str`` or its dotted path),
   on each text field (the message and the traceback). It is given the already-masked text.
   A hook that raises, or returns something other than a string, does not lose the error:
   the built-in masked text is stored and the failure is logged (without the text).

The masking is a net for the common forms, not a guarantee: a secret with no marker
(a bare password in a sentence) is not recognised. Code that knows its secrets should keep
them out of its exceptions, or name them in the hook.

Values (a run's input, output and state, a step's input and result, an event's payload, a
schedule's data) are stored as they are given; what the web surface (the JSON API and the
dashboard) *shows* of them passes through the user's ``redact_value`` hook
(``PikkuCelery(redact_value=...)`` or the ``pikku_redact_value`` setting: a callable
``(value, where) -> value`` or its dotted path; ``where`` is one of ``VALUE_KINDS``), given
a copy of the value as JSON. A hook that raises, or returns what JSON cannot hold, shows
``REDACTION_FAILED`` in the value's place (never the value) and is logged by name (never
with the value): ``redact_value``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from pikku_celery.model.dotted import import_dotted

log = logging.getLogger("pikku_celery.redaction")

MASK = "***"
#: The fields of a stored error that hold free text (``type`` is a class name).
TEXT_FIELDS = ("message", "traceback")

Redactor = Callable[[str], str]
#: ``redact_value``: ``(value, where) -> the value shown``.
ValueRedactor = Callable[[Any, str], Any]
#: What the web surface shows in place of a value the ``redact_value`` hook failed on.
REDACTION_FAILED = "[redaction failed]"
#: The ``where`` a ``redact_value`` hook is told: the kind of value shown.
VALUE_KINDS = ("input", "output", "state", "step_input", "step_result", "event_payload",
               "schedule_data")

# Every pattern starts only where a token starts (a look-behind, not ``\b``, which also
# matches inside ``a.b.c``) and bounds what it scans, so masking stays linear in the text:
# an error message can be megabytes of somebody's data.
_TOKEN = r"A-Za-z0-9_.\-"
# ``scheme://userinfo@``: the user information ends at the last ``@`` (of up to four) before
# white space or a quote, so a password holding an unescaped ``@`` or ``/`` is masked whole.
_URL_USERINFO = re.compile(
    r"(?<![A-Za-z0-9+.\-])(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]{0,31}://)"
    r"(?P<userinfo>(?:[^\s'\"<>@]{0,256}@){1,4})")
_SECRET_WORDS = (r"password|passwd|pwd|secret|token|api[_\-]?key|access[_\-]?key|"
                 r"private[_\-]?key|credential")
# name=value / name: value / "name": "value" / name='value' (a name holding one of
# _SECRET_WORDS; a scheme's ``://`` is no separator, and ``//name:`` is a URL's user or
# host, masked by _URL_USERINFO: ``https://token:pw@h/?token=x`` is a URL first)
_PAIR = re.compile(
    rf"(?<![{_TOKEN}])(?<!//)(?P<name>(?P<q1>['\"]?)(?=[{_TOKEN}]{{0,120}}?(?:{_SECRET_WORDS}))"
    rf"[{_TOKEN}]{{1,128}}(?P=q1)\s{{0,8}}(?:=|:(?!//))\s{{0,8}})"
    r"(?P<value>\"[^\"\n]{0,1024}\"|'[^'\n]{0,1024}'|['\"]?[^\s&,;'\")}\]]{1,1024})",
    re.IGNORECASE)
# ``Bearer <credential>`` anywhere; any scheme after ``Authorization:`` (``Basic x``).
_AUTH_SCHEME = re.compile(
    r"(?<![A-Za-z0-9])(?P<scheme>(?:Bearer|Authorization['\"]?\s{0,8}[:=]\s{0,8}['\"]?"
    r"[A-Za-z]{1,20})\s{1,8})(?P<credential>[A-Za-z0-9._~+/=\-]{4,})", re.IGNORECASE)


def mask_secrets(text: str) -> str:
    """``text`` with credentials in URLs, secret-named pairs and ``Authorization``
    credentials masked (``***``). Idempotent: masking masked text changes nothing."""
    text = _URL_USERINFO.sub(_mask_userinfo, text)
    text = _AUTH_SCHEME.sub(lambda m: m.group("scheme") + MASK, text)
    return _PAIR.sub(_mask_pair, text)


def _mask_userinfo(match: re.Match[str]) -> str:
    userinfo = match.group("userinfo")[:-1]  # without its closing '@'
    user, colon, _ = userinfo.partition(":")
    return match.group("scheme") + (f"{user}:{MASK}@" if colon else f"{MASK}@")


def _mask_pair(match: re.Match[str]) -> str:
    value = match.group("value")
    quote = value[0] if value[:1] in ("'", '"') else ""
    return f"{match.group('name')}{quote}{MASK}{quote}"


def redact_text(text: str, hook: Redactor | None = None) -> str:
    """``text`` masked by ``mask_secrets``, then by ``hook`` (if any). A failing hook
    leaves the built-in masking's result, and is logged."""
    masked = mask_secrets(text)
    if hook is None:
        return masked
    try:
        redacted = hook(masked)
    except Exception as exc:
        log.error("pikku: the redact_error hook %r raised %s; the error is stored with the "
                  "built-in masking only", hook, type(exc).__name__)
        return masked
    if not isinstance(redacted, str):
        log.error("pikku: the redact_error hook %r returned a %s, not a str; the error is "
                  "stored with the built-in masking only", hook, type(redacted).__name__)
        return masked
    return redacted


def redact_error(error: Mapping[str, Any], hook: Redactor | None = None) -> dict[str, Any]:
    """A copy of the stored error ``error`` with its text fields passed through
    ``redact_text``; other fields (type, ids, attempt) are kept as they are."""
    return {key: redact_text(value, hook) if key in TEXT_FIELDS and isinstance(value, str)
            else value for key, value in error.items()}


def redact_value(value: Any, where: str, hook: ValueRedactor | None) -> Any:
    """``value`` as the web surface shows it: ``hook(value, where)`` (``value`` itself
    without a hook). A hook that raises, or returns something JSON cannot hold, shows
    ``REDACTION_FAILED`` instead, never ``value``, and is logged once, by the hook's name
    and ``where`` (never the value, nor the exception's message, which may quote it)."""
    if hook is None:
        return value
    try:
        shown = hook(value, where)
    except Exception as exc:
        log.error("pikku: the redact_value hook %s raised %s on a value shown as %r; %r is "
                  "shown in its place", hook_name(hook), type(exc).__name__, where,
                  REDACTION_FAILED)
        return REDACTION_FAILED
    try:
        json.dumps(shown)
    except Exception:  # not JSON: a set, an object, a cycle
        log.error("pikku: the redact_value hook %s returned a %s that is not JSON for a value "
                  "shown as %r; %r is shown in its place", hook_name(hook),
                  type(shown).__name__, where, REDACTION_FAILED)
        return REDACTION_FAILED
    return shown


def hook_name(hook: Callable[..., Any]) -> str:
    """``module.qualname`` of a hook (its class's for a callable object): never its
    ``repr``, which may show what the hook holds."""
    named = hook if hasattr(hook, "__qualname__") else type(hook)
    module = getattr(named, "__module__", None)
    qualname = getattr(named, "__qualname__", type(hook).__name__)
    return f"{module}.{qualname}" if module else str(qualname)


def load_redactor(value: object, what: str) -> Redactor | None:
    """The hook a setting names: a callable, or the dotted path of one (``pkg.mod:fn`` or
    ``pkg.mod.fn``); ``None`` or ``""`` for none. Raises ``ValueError`` naming ``what``."""
    hook: Redactor | None = load_hook(value, what, "(text: str) -> str")
    return hook


def load_value_redactor(value: object, what: str) -> ValueRedactor | None:
    """The ``redact_value`` hook a setting names, as ``load_redactor`` reads it."""
    hook: ValueRedactor | None = load_hook(value, what, "(value, where: str) -> value")
    return hook


def load_hook(value: object, what: str, shape: str) -> Any:
    """A callable, or the one a dotted path names; ``None`` for ``None`` or ``""``."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = import_dotted(value)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"invalid {what}: cannot import {value!r} ({exc})") from None
    if not callable(value):
        raise ValueError(f"invalid {what}: {value!r} is not callable (a function "
                         f"{shape}, or its dotted path)")
    return value
