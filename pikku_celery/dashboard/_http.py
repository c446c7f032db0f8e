"""What every dashboard request goes through at the HTTP level, for the Flask and Django
adapters alike: the security headers sent with every page, and the check a form's POST
passes before anything reads it (its type and size)."""

from __future__ import annotations

from pikku_celery.contrib._api import ApiError
from pikku_celery.contrib._api import content_length as content_length_of

MAX_FORM_BYTES = 16 * 1024


class PageError(Exception):
    def __init__(self, status: int, title: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.title = title
        self.message = message


def security_headers(nonce: str) -> dict[str, str]:
    """Sent with every page: only the page's own nonce'd script runs (an injected
    ``<script>`` would not, were escaping ever missed), no framing (a cancel button under
    another site's clicks), no sniffing, no caching of run data."""
    return {
        "Content-Security-Policy": (
            "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
            f"script-src 'nonce-{nonce}'; connect-src 'self'; form-action 'self'; "
            "frame-ancestors 'none'; base-uri 'none'"),
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "same-origin",
        "Cache-Control": "no-store",
    }


def check_form(content_type: str | None, content_length: str | None) -> None:
    """A button's POST is a small urlencoded form: anything else is refused before it is
    read. ``content_length`` is the ``Content-Length`` header as sent (``None``: none, or
    a chunked body); one that is not a number is the caller's mistake (400), never a
    server error."""
    if (content_type or "").split(";")[0].strip().lower() != \
            "application/x-www-form-urlencoded":
        raise PageError(415, "Unsupported form", "the dashboard's forms are urlencoded")
    try:
        length = content_length_of(content_length)
    except ApiError as exc:
        raise PageError(400, "Bad request", exc.message) from None
    if length is None or length > MAX_FORM_BYTES:
        raise PageError(413, "Form too large",
                        f"a dashboard form is at most {MAX_FORM_BYTES} bytes")
