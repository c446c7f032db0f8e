"""What both stores share about concurrency slots (``@pikku.workflow(concurrency=N)``).

A slot group is one workflow's limit for one key (``slot_id``); its document holds the run
ids that hold a slot now (``holders``). Taking a slot is one guarded write that adds the
run while the group has fewer than ``limit`` holders and not the run already; giving it
back removes the run (idempotent). A run waits ``queued`` until a slot is taken for it; the
order of the queue is the runs' creation order, kept by the run documents (``slot`` and
``created_ms``), so a slot never decides who is next: whoever frees one admits the oldest
queued run (``concurrency``)."""

from __future__ import annotations

import uuid
from typing import Any

from pikku_celery.errors import InvalidInputError
from pikku_celery.validate import check_name

Doc = dict[str, Any]
SLOTS = "workflow_slots"
RUN_SLOT = "slot"  # the field of a run document that names its slot group
_SLOT_NAMESPACE = uuid.UUID("70696b6b-7500-5770-9f6c-6f77000a0007")
MAX_LIMIT = 10_000


class SlotField:
    """Fields of a ``workflow_slots`` document (``_id`` is the group's ``slot_id``)."""

    ID = "_id"
    WORKFLOW = "workflow"
    KEY = "key"
    HOLDERS = "holders"


def slot_id(workflow: str, key: str | None) -> str:
    """The id of ``workflow``'s slot group for ``key`` (``None``: one group for all its
    runs): the same on every machine, and no two (workflow, key) pairs share one."""
    tail = "-" if key is None else f"k{key}"
    return str(uuid.uuid5(_SLOT_NAMESPACE, f"{len(workflow)}:{workflow}:{tail}"))


def check_slot(slot: str, run_id: str, limit: int | None = None) -> None:
    check_name("slot", slot)
    check_name("run id", run_id)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or not 1 <= limit <= MAX_LIMIT):
        raise InvalidInputError(f"concurrency must be an int from 1 to {MAX_LIMIT}, got "
                                f"{limit!r}")
