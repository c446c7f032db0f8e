"""Concurrency limits per key (``@pikku.workflow(concurrency=N, concurrency_key=fn)``): at
most N runs of the workflow per key run at once, over every worker; the others wait
``queued`` and start in the order they came.

A run of a limited workflow is created ``queued`` in its slot group (``store._slots``),
then admitted: whoever may have freed a slot (a start, a run's end, the reaper) takes a
slot for the group's oldest queued run, moves it to ``running`` (a guarded write: a run
cancelled meanwhile stays cancelled, and its slot is given back) and wakes it, until the
group is full or nobody waits. A slot is held from admission to the run's end, whatever
happens to workers meanwhile: a run whose worker died is still running, and resumes
elsewhere holding its slot.

No slot may leak. Each write that could be followed by a crash has a sweep behind it
(``Admission.sweep``, run by the reaper): a holder whose run ended (its ender stopped
before it gave the slot back) or does not exist (its starter stopped before it created it)
loses the slot; a holder still ``queued`` (its admitter stopped before it moved it) is moved
and woken; a group with a free slot and queued runs (a freer stopped before it admitted)
admits."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from pikku_celery.engine.protocols import Dispatcher
from pikku_celery.engine.reopen import send_reopened
from pikku_celery.leases.base import LeaseService
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.records import RUN_QUEUED, QueuedReason, WorkflowRun
from pikku_celery.model.validate import check_name
from pikku_celery.store._slots import holder_run, slot_holder, slot_id
from pikku_celery.store.base import WorkflowStore
from pikku_celery.workflow.definitions import WorkflowDefinition

log = logging.getLogger("pikku_celery")
MAX_ADMITS = 1000  # runs one call admits at most (a sweep admits the rest)


class Admission:
    """Admits queued runs into free slots and gives slots back; ``limit_of(workflow)`` is
    the workflow's limit in this process (``None``: unknown here, or not limited)."""

    def __init__(self, store: WorkflowStore, limit_of: Callable[[str], int | None],
                 now_ms: Callable[[], int], *, leases: LeaseService | None = None) -> None:
        self.store = store
        self.limit_of = limit_of
        self.now_ms = now_ms
        self.leases = leases  # frees a reopened step's stale lease (``reopen``)

    def _start(self, run_id: str, dispatcher: Dispatcher) -> bool:
        """Move the queued run ``run_id``, which holds a slot now, to ``running`` and wake
        it; a run a retry queued has its steps reopened and sent by the same move."""
        reopened = self.store.admit_run(run_id, self.now_ms())
        if reopened is None:
            return False
        if reopened and self.leases is not None:
            send_reopened(self.leases, dispatcher, run_id, reopened)
        dispatcher.wake_run(run_id)
        return True

    def admit(self, slot: str, dispatcher: Dispatcher) -> list[str]:
        """Take free slots of ``slot`` for its oldest queued runs, move them to
        ``running`` and wake them; the run ids admitted."""
        admitted: list[str] = []
        for _ in range(MAX_ADMITS):
            run = self.store.next_queued(slot)
            if run is None:
                break
            limit = self.limit_of(run.workflow)
            if limit is None:  # a workflow this process does not know: its workers admit
                break
            holder = slot_holder(run)
            if not self.store.take_slot(slot, holder, limit, workflow=run.workflow):
                break  # full
            if self._start(run.run_id, dispatcher):
                admitted.append(run.run_id)
            else:
                # Cancelled while queued (its slot goes back, the next one is tried), or
                # moved by the sweep meanwhile (it runs: the slot is its).
                current = self.store.get_run(run.run_id)
                if current is None or current.is_terminal:
                    self.store.give_slot(slot, holder)
        return admitted

    def release(self, run: WorkflowRun, dispatcher: Dispatcher) -> None:
        """``run``, as its ender read it, ended: give back the slot of that life of it
        (``slot_holder``: a retry that revived it meanwhile holds another) and admit the
        next."""
        if run.slot is None:
            return
        self.store.give_slot(run.slot, slot_holder(run))
        self.admit(run.slot, dispatcher)

    def sweep(self, dispatcher: Dispatcher, limit: int = 1000) -> int:
        """Mend what a crash between two of the writes above left (see the module's
        docstring); how many slots or runs it mended."""
        mended = 0
        for group in self.store.list_slots(limit):
            slot = group["slot"]
            for holder in group["holders"]:
                run_id, _ = holder_run(holder)
                run = self.store.get_run(run_id)
                if run is None or run.is_terminal or slot_holder(run) != holder:
                    if self.store.give_slot(slot, holder):
                        log.warning("pikku: slot of %s run %s given back by the sweep "
                                    "(%s)", group.get("workflow"), holder,
                                    "it never started" if run is None else "it had ended")
                        mended += 1
                elif run.status == RUN_QUEUED and self._start(run_id, dispatcher):
                    mended += 1
        for slot in self.store.queued_slots(limit):
            mended += len(self.admit(slot, dispatcher))
        return mended


def slot_of(definition: WorkflowDefinition, data: Any) -> str | None:
    """The slot group a new run of ``definition`` with input ``data`` queues in; ``None``
    for a workflow without a limit. ``InvalidInputError`` when its ``concurrency_key``
    gives anything but a string or ``None`` (one group for all), or raises."""
    if definition.concurrency is None:
        return None
    key = None
    if definition.concurrency_key is not None:
        try:
            key = definition.concurrency_key(data)
        except Exception as exc:
            raise InvalidInputError(
                f"the concurrency_key of workflow {definition.name!r} raised "
                f"{type(exc).__name__}: {exc}") from exc
        if key is not None and not isinstance(key, str):
            raise InvalidInputError(
                f"the concurrency_key of workflow {definition.name!r} returned {key!r} "
                f"({type(key).__name__}): it must return a string (or None)")
        if key is not None:
            check_name(f"concurrency key of workflow {definition.name!r}", key)
    return slot_id(definition.name, key)


def queued_reason(store: WorkflowStore, run: WorkflowRun,
                  definition: WorkflowDefinition | None) -> QueuedReason | None:
    """Why ``run`` waits ``queued`` (``None``: it does not): its key and limit (from its
    workflow's definition when this process has it, else what its slot group keeps), the
    runs holding the slots, and how many queued runs come before it."""
    if run.status != RUN_QUEUED or run.slot is None:
        return None
    group = store.slot_group(run.slot) or {}
    key, limit = group.get("key"), group.get("limit")
    if definition is not None:
        limit = definition.concurrency
        if definition.concurrency_key is not None:
            with contextlib.suppress(Exception):  # it queued the run: it answered then
                key = definition.concurrency_key(run.input)
    holders = tuple(dict.fromkeys(holder_run(h)[0] for h in group.get("holders") or ()))
    return QueuedReason(run.run_id, run.workflow, key, limit, holders,
                        store.queued_ahead(run.slot, run))
