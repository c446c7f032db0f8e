"""What mongomock lacks of the MongoDB the store is written for, added for the tests.

``$unionWith`` (MongoDB 4.4): ``MongoWorkflowStore.read_run`` reads a run and its steps in
one aggregate, the run's document followed by the steps'. mongomock has no handler for the
stage; this adds one with MongoDB's semantics (the input documents, then the other
collection's documents through its own pipeline). The nx-27017 stand-in and MongoDB run
the stage themselves.
"""

from __future__ import annotations

from typing import Any

from mongomock import aggregate


def _union_with(collection: list[dict[str, Any]], database: Any, options: Any
                ) -> list[dict[str, Any]]:
    name = options if isinstance(options, str) else options["coll"]
    pipeline = [] if isinstance(options, str) else options.get("pipeline", [])
    other = list(database.get_collection(name).find())
    return list(collection) + list(aggregate.process_pipeline(other, database, pipeline, None))


def install() -> None:
    """Register the missing stages (idempotent)."""
    aggregate._PIPELINE_HANDLERS.setdefault("$unionWith", _union_with)
