"""Not built yet (issue 33): installs nothing."""

from __future__ import annotations

from typing import Any

from pikku_celery.observe import Observer


def install(pikku: Any) -> Observer | None:
    return None
