"""Record every query ``MongoWorkflowStore`` sends, to check them against its indexes.

As a pytest plugin (``-p tests.support.query_recorder`` with ``PIKKU_QUERY_LOG`` set to a
file), it wraps the collections of every ``MongoWorkflowStore`` built during the session
and appends one JSON line per query: the collection, the operation, the filter, the sort
and the public store method that issued it. ``tests/unit/test_hardening_infra.py`` runs the
store contract suite this way and checks each line against the declared indexes.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from pikku_celery.store.mongo import MongoWorkflowStore

ENV_LOG = "PIKKU_QUERY_LOG"
# Operations that select documents by a filter (insert_one/insert_many select none).
FILTERED = ("find", "find_one", "find_one_and_update", "find_one_and_replace",
            "find_one_and_delete", "update_one", "update_many", "replace_one", "delete_one",
            "delete_many", "count_documents", "distinct")
UNCHECKABLE = ("watch",)  # recorded so the check fails loudly
# The store's package: each concern's methods live in a module of their own there.
STORE_DIR = os.path.join("pikku_celery", "store", "mongo")

Sink = Callable[[dict[str, Any]], None]


def _caller() -> str:
    """The public ``MongoWorkflowStore`` method on the stack (``?`` if none)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if (os.path.dirname(code.co_filename).endswith(STORE_DIR)
                and not code.co_name.startswith("_")):
            return code.co_name
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def _sort_spec(key_or_list: Any, direction: Any = None) -> list[list[Any]]:
    if isinstance(key_or_list, str):
        return [[key_or_list, 1 if direction is None else direction]]
    return [[field, order] for field, order in key_or_list]


class RecordingCursor:
    def __init__(self, cursor: Any, entry: dict[str, Any], sink: Sink) -> None:
        self._cursor = cursor
        self._entry = entry
        self._sink = sink
        self._sent = False

    def sort(self, key_or_list: Any, direction: Any = None) -> RecordingCursor:
        self._entry["sort"] = _sort_spec(key_or_list, direction)
        self._cursor = self._cursor.sort(key_or_list, direction)
        return self

    def limit(self, n: int) -> RecordingCursor:
        self._cursor = self._cursor.limit(n)
        return self

    def __iter__(self) -> Any:
        self._flush()
        return iter(self._cursor)

    def __getattr__(self, name: str) -> Any:
        self._flush()
        return getattr(self._cursor, name)

    def _flush(self) -> None:
        if not self._sent:
            self._sent = True
            self._sink(self._entry)


class RecordingCollection:
    def __init__(self, collection: Any, sink: Sink) -> None:
        self._collection = collection
        self._sink = sink

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._collection, name)
        if name == "aggregate":
            return self._aggregate(target)
        if name == "bulk_write":
            return self._bulk_write(target)
        if name not in FILTERED and name not in UNCHECKABLE and name != "find":
            return target

        def recorded(*args: Any, **kwargs: Any) -> Any:
            query = args[0] if args else kwargs.get("filter", {})
            entry = {"collection": self._collection.name, "op": name, "filter": query,
                     "sort": _sort_spec(kwargs["sort"]) if kwargs.get("sort") else None,
                     "method": _caller()}
            result = target(*args, **kwargs)
            if name == "find":
                return RecordingCursor(result, entry, self._sink)
            self._sink(entry)
            return result

        return recorded


    def _bulk_write(self, target: Any) -> Any:
        """A bulk write is recorded as the writes it holds, each with its own filter (an
        insert selects nothing; anything but updates and inserts is uncheckable)."""
        def recorded(requests: list[Any], *args: Any, **kwargs: Any) -> Any:
            method = _caller()
            for request in requests:
                kind = type(request).__name__
                if kind == "InsertOne":
                    continue
                query = getattr(request, "_filter", None)
                self._sink({"collection": self._collection.name,
                            "op": "update_one" if kind == "UpdateOne" else "bulk_write",
                            "filter": query if query is not None else {}, "sort": None,
                            "method": method})
            return target(requests, *args, **kwargs)

        return recorded

    def _aggregate(self, target: Any) -> Any:
        """An aggregate is recorded as the finds its ``$match`` stages are: the first on
        this collection, each ``$unionWith``'s on its own (a pipeline of anything else is
        recorded as an uncheckable aggregate)."""
        def recorded(pipeline: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
            method = _caller()
            for entry in _matches(self._collection.name, pipeline, method):
                self._sink(entry)
            return target(pipeline, *args, **kwargs)

        return recorded


def _matches(collection: str, pipeline: list[dict[str, Any]], method: str
             ) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for index, stage in enumerate(pipeline):
        (operator, options), = stage.items()
        if operator == "$match" and index == 0:
            found.append({"collection": collection, "op": "find", "filter": options,
                          "sort": None, "method": method})
        elif operator == "$unionWith":
            found += _matches(options["coll"], options.get("pipeline", []), method)
        elif operator != "$project":
            found.append({"collection": collection, "op": "aggregate", "filter": {},
                          "sort": None, "method": method})
    return found


def record_store(store: MongoWorkflowStore, sink: Sink) -> None:
    """Wrap every collection attribute of ``store`` so its queries go to ``sink``."""
    for attr, value in list(vars(store).items()):
        if type(value).__name__ == "Collection":  # pymongo's or mongomock's
            setattr(store, attr, RecordingCollection(value, sink))


def pytest_configure(config: Any) -> None:
    path = os.environ.get(ENV_LOG)
    if not path:
        return

    def sink(entry: dict[str, Any]) -> None:
        with open(path, "a") as log:
            log.write(json.dumps(entry, default=repr) + "\n")

    original = MongoWorkflowStore.__init__

    def recording_init(self: MongoWorkflowStore, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        record_store(self, sink)

    MongoWorkflowStore.__init__ = recording_init  # type: ignore[method-assign]
