"""Read what a store really wrote, below its read API.

``get_history`` merges history entries with the step documents and fills a missing earlier
attempt in as lease-expired (so a document without its entries never misreports a step).
That is right for readers, and it means an "one entry per attempt" assert made through
``get_history`` can never fail. Tests that check what was *written* read the raw documents
here: the in-memory store's dicts, or MongoDB's ``workflow_steps`` collection (names from
``pikku_celery.model.keys``), whose documents hold each attempt's entry in ``attempts``. An entry
that was never written is absent here, whatever the readers fill in.
"""

from __future__ import annotations

import copy
from typing import Any

from pikku_celery.model import keys
from pikku_celery.model.keys import HistoryField as H
from pikku_celery.model.keys import StepField as S
from pikku_celery.store._docs import written_entries
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
    """Every history entry written for ``run_id``, sorted by step name then attempt, each
    in the shape of a history document (``step_id``, ``attempt``, ``status``, ``error``,
    ``worker``, ...; a succeeded entry's ``result`` is its step's, stored by the same
    write)."""
    docs = [entry for step in raw_steps(store, run_id)
            for entry in written_entries(step).values()]
    return sorted(docs, key=lambda d: (d[H.NAME], d[H.ATTEMPT]))


def drop_entries(store: Any, run_id: str, step_name: str, *attempts: int) -> None:
    """Remove written history entries (all of the step's when no attempt is named), as a
    store that forgot to write them would leave the step document."""
    step_id = keys.invocation_id(run_id, step_name)
    if isinstance(store, InMemoryWorkflowStore):
        with store._lock:
            entries = store._steps[step_id].get(S.ATTEMPTS, {})
            for attempt in attempts or [int(a) for a in list(entries)]:
                entries.pop(str(attempt), None)
    elif isinstance(store, MongoWorkflowStore):
        unset = ({f"{S.ATTEMPTS}.{a}": "" for a in attempts} if attempts
                 else {S.ATTEMPTS: ""})
        store.db[keys.STEPS].update_one({S.ID: step_id}, {"$unset": unset})
    else:
        raise TypeError(f"no raw view of {type(store).__name__}")


def entries(store: Any, run_id: str, step_name: str) -> list[tuple[int, str]]:
    """``(attempt, status)`` of each raw history entry of one step."""
    return [(d[H.ATTEMPT], d[H.STATUS]) for d in raw_history(store, run_id)
            if d[H.NAME] == step_name]


def drop_run_state_fields(store: Any, run_id: str) -> None:
    """Make ``run_id`` look stored by a version before run state: no state fields at all."""
    fields = (keys.RunField.STATE, keys.RunField.STATE_VERSION, keys.RunField.STATE_WRITERS)
    if isinstance(store, InMemoryWorkflowStore):
        with store._lock:
            for field in fields:
                store._runs[run_id].pop(field, None)
    elif isinstance(store, MongoWorkflowStore):
        store.db[keys.RUNS].update_one({keys.RunField.ID: run_id},
                                       {"$unset": dict.fromkeys(fields, "")})
    else:
        raise TypeError(f"no raw view of {type(store).__name__}")
