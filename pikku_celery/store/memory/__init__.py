"""The reference store: the full contract in one process, every operation under one lock.

Not a mock: it keeps the same documents as the MongoDB store and takes the same decisions
(``_decide``), so the contract suite runs unchanged on both. Values are stored as JSON would
carry them (a tuple comes back a list, as from MongoDB) and copied out, so callers can never
alias stored state.

``InMemoryWorkflowStore`` combines one class per concern, each on ``base.MemoryStoreBase``
(the documents and the lock), as the MongoDB store does: ``runs``, ``steps`` (claim, settle,
leases, history), ``gates``, ``events``, ``schedules``, ``retention`` and ``listing``
(``list_runs`` and the sweeps).
What both stores must agree on is written once beside them: ``store._decide`` (claims),
``store._settle`` (settles), ``store._ended`` (a run's end), ``store._retention`` (purges),
``store._checks`` (argument checks).
"""

from __future__ import annotations

from pikku_celery.store.memory.events import MemoryEvents
from pikku_celery.store.memory.gates import MemoryGates
from pikku_celery.store.memory.listing import MemoryListing
from pikku_celery.store.memory.retention import MemoryRetention
from pikku_celery.store.memory.runs import MemoryRuns
from pikku_celery.store.memory.schedules import MemorySchedules
from pikku_celery.store.memory.slots import MemorySlots
from pikku_celery.store.memory.steps import MemorySteps

__all__ = ["InMemoryWorkflowStore"]


class InMemoryWorkflowStore(MemoryRuns, MemorySteps, MemoryGates, MemoryEvents,
                            MemorySchedules, MemorySlots, MemoryRetention, MemoryListing):
    """A complete ``WorkflowStore`` for tests and single-process use."""
