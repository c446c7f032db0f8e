"""Read what a store really wrote, below its read API.

``get_history`` merges history entries with the step documents and fills a missing earlier
attempt in as lease-expired (so a crash between the two writes never misreports a step).
That is right for readers, and it means an "one entry per attempt" assert made through
``get_history`` can never fail. Tests that check what was *written* read the raw documents
here: the in-memory store's dicts, or MongoDB's ``workflow_steps`` and
``workflow_step_history`` collections (names from ``pikku_celery.keys``).
"""

from __future__ import annotations

import copy
from typing import Any

from pikku_celery import keys
from pikku_celery.keys import HistoryField as H
from pikku_celery.keys import StepField as S
from pikku_celery.store.memory import InMemoryWorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore

Doc = dict[str, Any]


def raw_steps(store: Any, run_id: str) -> list[Doc]:
    """Every step document of ``run_id`` as stored, in no particular order."""
    if isinstance(store, InMemoryWorkflowStore):
        with store._lock:
            return [copy.deepcopy(d) for d in store._steps.values() if d[S.RUN] == run_id]
    if isinstance(store, MongoWorkflowStore):
        return list(store.db[keys.STEPS].find({S.RUN: run_id}))
    raise TypeError(f"no raw view of {type(store).__name__}")


def raw_history(store: Any, run_id: str) -> list[Doc]:
    """Every history entry of ``run_id`` as stored, sorted by step name then attempt."""
    if isinstance(store, InMemoryWorkflowStore):
        with store._lock:
            docs = [copy.deepcopy(d) for d in store._history.values() if d[H.RUN] == run_id]
    elif isinstance(store, MongoWorkflowStore):
        docs = list(store.db[keys.HISTORY].find({H.RUN: run_id}))
    else:
        raise TypeError(f"no raw view of {type(store).__name__}")
    return sorted(docs, key=lambda d: (d[H.NAME], d[H.ATTEMPT]))


def entries(store: Any, run_id: str, step_name: str) -> list[tuple[int, str]]:
    """``(attempt, status)`` of each raw history entry of one step."""
    return [(d[H.ATTEMPT], d[H.STATUS]) for d in raw_history(store, run_id)
            if d[H.NAME] == step_name]
