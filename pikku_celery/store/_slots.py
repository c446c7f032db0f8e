"""What both stores share about concurrency slots (``@pikku.workflow(concurrency=N)``).

A slot group is one workflow's limit for one key (``slot_id``); its document holds the runs
that hold a slot now (``holders``: each a run in one life of it, ``slot_holder``). Taking a
slot is one guarded write that adds the holder while the group has fewer than ``limit``
holders and not that one already; giving it back removes it (idempotent). A run waits
``queued`` until a slot is taken for it; the order of the queue is the runs' creation
order, kept by the run documents (``slot`` and ``created_ms``), so a slot never decides who
is next: whoever frees one admits the oldest queued run (``concurrency``)."""

from __future__ import annotations

import uuid
from typing import Any, Protocol, runtime_checkable

from pikku_celery.model.records import WorkflowRun
from pikku_celery.model.validate import check_concurrency, check_name

Doc = dict[str, Any]
_SLOT_NAMESPACE = uuid.UUID("70696b6b-7500-5770-9f6c-6f77000a0007")


class SlotField:
    """Fields of a ``workflow_slots`` document (``_id`` is the group's ``slot_id``)."""

    ID = "_id"
    WORKFLOW = "workflow"
    KEY = "key"
    HOLDERS = "holders"
    HELD = "held"  # how many holders: the index the sweep reads groups with holders by
    LIMIT = "limit"  # the limit its last taker had (what a queued run is told it waits on)


def slot_id(workflow: str, key: str | None) -> str:
    """The id of ``workflow``'s slot group for ``key`` (``None``: one group for all its
    runs): the same on every machine, and no two (workflow, key) pairs share one."""
    tail = "-" if key is None else f"k{key}"
    return str(uuid.uuid5(_SLOT_NAMESPACE, f"{len(workflow)}:{workflow}:{tail}"))


def slot_holder(run: WorkflowRun) -> str:
    """Who holds a slot for ``run``: the run in this life of it. A retry begins a new life
    (its lineage counts the retries), so a slot taken for the run retried is not the slot
    its earlier life held: a late release of the ended life (its ender, or a sweep that
    read it ended) gives back only that one, never the retried run's (issue 31). The
    first life is the run id alone; a later one is ``<run id> #<life>``, which no run id
    ends with (no run id holds a space but a schedule's, and those end with their tick)."""
    life = sum(1 for entry in run.lineage if entry.op == "retry")
    return run.run_id if life == 0 else f"{run.run_id} #{life}"


def holder_run(holder: str) -> tuple[str, int]:
    """The run id and life of the slot holder ``holder`` (``slot_holder``)."""
    head, sep, tail = holder.rpartition(" #")
    if sep and tail.isdigit():
        return head, int(tail)
    return holder, 0


def check_slot(slot: str, holder: str | None = None, limit: int | None = None) -> None:
    check_name("slot", slot)
    if holder is not None:
        check_name("run id", holder_run(holder)[0] if isinstance(holder, str) else holder)
    if limit is not None:
        check_concurrency("concurrency", limit)


def group_of(doc: Doc) -> dict[str, Any]:
    """A slot group document as ``slot_group`` returns it."""
    return {"slot": doc[SlotField.ID], "workflow": doc.get(SlotField.WORKFLOW),
            "key": doc.get(SlotField.KEY), "holders": list(doc.get(SlotField.HOLDERS) or []),
            "limit": doc.get(SlotField.LIMIT)}


@runtime_checkable
class SlotStore(Protocol):
    """The slots part of the store contract."""

    def take_slot(self, slot: str, run_id: str, limit: int, *, workflow: str = "",
                  key: str | None = None) -> bool:
        """Add ``run_id`` to the group's holders while it has fewer than ``limit``; whether
        the run holds a slot now (``True`` when it held one already)."""
        ...

    def give_slot(self, slot: str, run_id: str) -> bool:
        """Remove ``run_id`` from the group's holders; ``False`` when it held none."""
        ...

    def slot_holders(self, slot: str) -> list[str]:
        ...

    def list_slots(self, limit: int = 1000) -> list[dict[str, Any]]:
        """The groups with holders: ``{"slot", "workflow", "key", "holders"}`` each."""
        ...

    def slot_group(self, slot: str) -> dict[str, Any] | None:
        """One group: ``{"slot", "workflow", "key", "holders", "limit"}`` (``limit``: its
        last taker's, ``None`` for a group taken before it was kept); ``None``: no group."""
        ...

    def queued_ahead(self, slot: str, run: WorkflowRun) -> int:
        """How many of the group's ``queued`` runs come before ``run`` (created earlier, or
        at the same time with a smaller run id): the order admission follows."""
        ...

    def next_queued(self, slot: str) -> WorkflowRun | None:
        """The group's oldest ``queued`` run (creation time, then run id)."""
        ...

    def queued_slots(self, limit: int = 1000) -> list[str]:
        """The groups that have ``queued`` runs."""
        ...
