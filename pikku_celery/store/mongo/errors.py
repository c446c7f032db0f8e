"""How the MongoDB store names what MongoDB refused: an unreachable server (by its address,
never its credentials) and a write no retry can fix (as bad input)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from bson.errors import InvalidDocument
from pymongo.errors import DocumentTooLarge, OperationFailure, ServerSelectionTimeoutError

from pikku_celery.model.errors import InvalidInputError

DUPLICATE_KEY = 11000
IMMUTABLE_FIELD = 66  # an upsert that would insert: how a guarded statement says "no match"

# Server errors that no retry can fix: the write itself is impossible.
#   2 BadValue, 10334 BSONObjectTooLarge, 17419 resulting document after update is larger
#   than 16 MiB, 17280 key too large to index, 121 DocumentValidationFailure,
#   15 Overflow, 17420 document too large after update (older servers).
PERMANENT_WRITE_CODES = frozenset({2, 15, 121, 10334, 17280, 17419, 17420})


class MongoUnreachableError(ServerSelectionTimeoutError):
    """No MongoDB server answered within the server-selection timeout.

    The message names the server and the setting. Deliberately a pymongo error (code catching
    ``ServerSelectionTimeoutError`` or ``ConnectionFailure`` keeps working), not a
    ``PikkuError``: the engine treats a ``PikkuError`` raised during a pass as the
    workflow's own failure and fails the run, while an outage only interrupts the pass, to be
    retried."""


def describe_database(db: Any) -> str:
    """Where ``db`` lives, from the client's seed list (which holds no credentials)."""
    try:
        hosts = ",".join(f"{host}:{port}" for host, port in
                         db.client.topology_description.server_descriptions())
    except Exception:  # a client without a topology (mongomock)
        return f"MongoDB database {db.name!r}"
    return f"MongoDB at mongodb://{hosts}/{db.name}"


def unreachable(db: Any, exc: ServerSelectionTimeoutError) -> MongoUnreachableError:
    # pymongo's message is the reason, then the timeout and a long topology dump.
    reason = re.sub(r" \(configured timeouts:[^)]*\)", "", str(exc).split(", Timeout:")[0])
    try:
        timeout = f"{db.client.options.server_selection_timeout:g} s"
    except Exception:  # pragma: no cover - every pymongo client has options
        timeout = "the server-selection timeout"
    return MongoUnreachableError(
        f"{describe_database(db)} is unreachable: no server answered within {timeout} "
        f"(server_selection_timeout): {reason[:300]}")


@contextlib.contextmanager
def storable(what: str) -> Iterator[None]:
    """A write MongoDB can never accept is reported as bad input, so callers fail at once
    instead of retrying it. BSON can be larger than the JSON the input checks measure
    (array indexes are keys): a document pymongo cannot encode is refused client-side,
    before anything is sent; one the server refuses (an update whose *result* passes
    16 MiB, a validation rule) is refused by error code."""
    try:
        yield
    except (DocumentTooLarge, InvalidDocument) as exc:
        raise InvalidInputError(f"{what} cannot be stored in MongoDB: {exc}") from exc
    except OperationFailure as exc:
        if exc.code not in PERMANENT_WRITE_CODES:
            raise
        raise InvalidInputError(f"{what} cannot be stored in MongoDB (error {exc.code}): "
                                f"{exc}") from exc
