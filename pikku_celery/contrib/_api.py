"""A small JSON API over a ``PikkuCelery``, free of any web framework: each handler returns
``(status, payload)``, and the Flask and Django adapters only translate requests and
responses. Errors map to statuses here, once: unknown run or workflow 404, bad input 400."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from pikku_celery.app import PikkuCelery
from pikku_celery.errors import (
    InvalidInputError,
    WorkflowNotFoundError,
    WorkflowRunNotFoundError,
)
from pikku_celery.validate import MAX_DOCUMENT_DEPTH

Response = tuple[int, Any]


def to_json(record: Any) -> Any:
    """A read model as plain JSON (datetimes as ISO 8601 strings)."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {k: to_json(v) for k, v in dataclasses.asdict(record).items()}
    if isinstance(record, datetime):
        return record.isoformat()
    if isinstance(record, Mapping):
        return {k: to_json(v) for k, v in record.items()}
    if isinstance(record, list | tuple):
        return [to_json(v) for v in record]
    return record


def parse_body(raw: bytes | str) -> Any:
    """A request body as JSON; ``None`` when it is empty or not JSON (the handler then says
    what it expected). Call it inside ``handle``: a body nested deeper than Python's parser
    recurses (a few thousand levels) raises ``RecursionError``, refused here as bad input
    rather than answered with a 500; a shallower body that is still too deep to store is
    refused by the input checks like any other value."""
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return None
    except RecursionError:
        raise InvalidInputError(
            f"the request body is nested too deeply (MongoDB stores at most "
            f"{MAX_DOCUMENT_DEPTH} levels per document)") from None


def handle(call: Callable[[], Response]) -> Response:
    try:
        return call()
    except (WorkflowRunNotFoundError, WorkflowNotFoundError) as exc:
        return 404, {"error": type(exc).__name__, "message": str(exc)}
    except (InvalidInputError, ValueError) as exc:
        return 400, {"error": type(exc).__name__, "message": str(exc)}


class RunsApi:
    """``GET runs``, ``GET runs/<id>``, ``GET runs/<id>/steps``, ``GET runs/<id>/history``,
    ``POST runs/<id>/cancel``, ``POST workflows/<name>/runs``."""

    def __init__(self, pikku: PikkuCelery) -> None:
        self.pikku = pikku

    def list_runs(self, query: Mapping[str, str]) -> Response:
        def call() -> Response:
            raw = query.get("limit", "50")
            try:
                limit = int(raw)
            except ValueError:
                raise InvalidInputError(f"limit must be an integer, got {raw!r}") from None
            runs = self.pikku.list_runs(workflow=query.get("workflow"),
                                        status=query.get("status"), limit=limit)
            return 200, {"runs": to_json(runs)}
        return handle(call)

    def get_run(self, run_id: str) -> Response:
        return handle(lambda: (200, to_json(self.pikku.get_run(run_id))))

    def get_steps(self, run_id: str) -> Response:
        return handle(lambda: (200, {"steps": to_json(self.pikku.get_steps(run_id))}))

    def get_history(self, run_id: str) -> Response:
        return handle(lambda: (200, {"attempts": to_json(self.pikku.get_history(run_id))}))

    def cancel(self, run_id: str, body: Any) -> Response:
        reason = body.get("reason") if isinstance(body, Mapping) else None
        return handle(lambda: (200, {"cancelled": self.pikku.cancel(run_id, reason)}))

    def start(self, workflow: str, body: Any) -> Response:
        if not isinstance(body, Mapping):
            return 400, {"error": "InvalidInputError",
                         "message": "the body must be a JSON object with 'input' (and "
                                    "optionally 'run_id')"}
        return handle(lambda: (202, {"run_id": self.pikku.start(
            workflow, body.get("input"), run_id=body.get("run_id"))}))
