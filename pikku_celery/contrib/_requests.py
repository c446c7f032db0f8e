"""What every request to the JSON API goes through around its handler, for both frameworks:
its body read (``application/json`` only, 415: a cross-site form can only send
``text/plain``, form or multipart bodies; at most ``max_body_bytes``, 413; nested no deeper
than MongoDB stores, 400), the cross-site check for frameworks without CSRF protection of
their own, and the one mapping of a handler's failure to a status (``handle``): the
caller's mistakes are served with their message, the server's are logged and served as a
bare 500.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pikku_celery.contrib._access import ApiError
from pikku_celery.model.errors import (
    InvalidInputError,
    PikkuConfigurationError,
    WorkflowApprovalError,
    WorkflowEventError,
    WorkflowEventLimitError,
    WorkflowEventNotSentError,
    WorkflowNotFoundError,
    WorkflowRunConflictError,
    WorkflowRunNotFoundError,
)
from pikku_celery.model.validate import MAX_DOCUMENT_DEPTH

log = logging.getLogger("pikku_celery.contrib")

Response = tuple[int, Any]
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
JSON_TYPE = "application/json"


@dataclass(frozen=True)
class ApiOptions:
    """What the adapters read from their settings (``PIKKU_SHOW_TRACEBACKS``,
    ``PIKKU_MAX_BODY_BYTES``)."""

    show_tracebacks: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def internal_error() -> Response:
    """The one answer to a failure that is the server's: no detail (it is in the log)."""
    return 500, {"error": "InternalError",
                 "message": "the server could not answer; the error is in its log"}


# --- request bodies ----------------------------------------------------------------------


def parse_body(raw: bytes | str) -> Any:
    """A request body as JSON (``None`` when empty). Not JSON is a 400; a body nested deeper
    than Python's parser recurses (a few thousand levels) raises ``RecursionError``,
    refused here as bad input rather than answered with a 500; a shallower body that is
    still too deep to store is refused by the input checks like any other value."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except RecursionError:
        raise InvalidInputError(
            f"the request body is nested too deeply (MongoDB stores at most "
            f"{MAX_DOCUMENT_DEPTH} levels per document)") from None
    except ValueError as exc:
        raise ApiError(400, "InvalidJSON", f"the request body is not JSON: {exc}") from None


def read_json_body(content_type: str | None, content_length: int | None,
                   read_at_most: Callable[[int], bytes], max_bytes: int) -> Any:
    """The JSON body of a POST. ``content_type`` is the bare media type; ``read_at_most(n)``
    reads up to ``n`` bytes (a chunked body has no length to check first)."""
    if (content_type or "").strip().lower() != JSON_TYPE:
        raise ApiError(415, "UnsupportedMediaType",
                       f"send the request body as {JSON_TYPE} (got {content_type or 'none'})")
    if content_length is not None and content_length > max_bytes:
        raise _too_large(max_bytes)
    raw = read_at_most(max_bytes + 1)
    if len(raw) > max_bytes:
        raise _too_large(max_bytes)
    return parse_body(raw)


def single_values(query: Mapping[str, Any]) -> dict[str, str]:
    """A request's query parameters, each given once: Flask's ``request.args`` reads the
    first of a repeated parameter and Django's ``request.GET`` the last, so
    ``?limit=5&limit=x`` would mean one thing in one framework and another in the other
    (and to a proxy that checked either): a repeat is the caller's mistake (400). A plain
    mapping (no ``lists()``) is taken as it is."""
    lists = getattr(query, "lists", None)
    if lists is None:
        return dict(query)
    found = {}
    for name, values in lists():
        if len(values) != 1:
            raise ApiError(400, "InvalidQuery", f"the query parameter {name[:40]!r} is given "
                                                f"{len(values)} times: give it once")
        found[name] = values[0]
    return found


def content_length(header: str | None) -> int | None:
    """The ``Content-Length`` header as sent, as a number (``None``: none, or a chunked
    body); one that is not a number of bytes is the caller's mistake (400), never a 500."""
    if not header:
        return None
    text = header.strip()
    if not (text.isascii() and text.isdigit()):
        raise ApiError(400, "BadRequest", "the Content-Length header is not a number")
    return int(text)


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, "RequestTooLarge", f"the request body is over {max_bytes} bytes")


# --- who may call ------------------------------------------------------------------------


def cross_origin_refusal(header: Callable[[str], str | None], host: str,
                         trusted_origins: Collection[str] = ()) -> str | None:
    """Why a state-changing request comes from another site, or ``None``.

    For frameworks without CSRF protection of their own (Flask); ``header(name)`` reads a
    request header. Browsers say where a request comes from: ``Sec-Fetch-Site`` (every
    current browser) or, failing that, ``Origin``, compared with the ``Host`` the request
    was sent to. A request with neither is not a browser's cross-site request (a script,
    curl, an old browser's same-origin request)."""
    origin = header("Origin")
    if origin is not None and origin in trusted_origins:
        return None
    site = header("Sec-Fetch-Site")
    if site is not None:
        return None if site in ("same-origin", "none") else f"Sec-Fetch-Site: {site}"
    if origin is None:
        return None
    if urlsplit(origin).netloc.lower() != host.lower():
        return f"Origin {origin} is not {host}"
    return None


def handle(call: Callable[[], Response]) -> Response:
    """Run a handler and map its failure to a status, once for both frameworks."""
    try:
        return call()
    except ApiError as exc:
        return exc.response()
    except (WorkflowRunNotFoundError, WorkflowNotFoundError) as exc:
        return 404, {"error": type(exc).__name__, "message": str(exc)}
    except WorkflowEventLimitError as exc:
        # Past one of the run's limits on events (the message names the setting):
        # a payload too large, 413; a run that has kept as many events as it may, 409.
        return (413 if exc.too_large else 409), {
            "error": type(exc).__name__, "message": str(exc), "limit": exc.limit,
            "maximum": exc.maximum}
    except (WorkflowRunConflictError, WorkflowApprovalError, WorkflowEventError) as exc:
        # An approval refused (the run does not wait on it, or the decision or its
        # approver does not fit the gate), or an event sent to a run that has ended;
        # nothing was recorded.
        return 409, {"error": type(exc).__name__, "message": str(exc)}
    except WorkflowEventNotSentError as exc:
        # The store kept failing through the send's retries; the message says whether the
        # event may have been kept (it names the run and the event, never the server).
        return 503, {"error": type(exc).__name__, "message": str(exc),
                     "may_be_kept": exc.may_be_kept}
    except InvalidInputError as exc:
        # Only pikku's own: the message describes the caller's input. Any other ValueError
        # (a driver refusing a configured URL, a bad setting) is the server's, and its
        # message can quote a password.
        return 400, {"error": type(exc).__name__, "message": str(exc)}
    except PikkuConfigurationError as exc:
        # The deployment's mistake, not the caller's: named in the log (the message names
        # the setting and masks passwords), never served.
        log.error("pikku API: pikku is misconfigured: %s", exc)
        return internal_error()
    except Exception:
        # Never the message: a driver's error can quote a URL with its password.
        log.exception("pikku API: unexpected error")
        return internal_error()
