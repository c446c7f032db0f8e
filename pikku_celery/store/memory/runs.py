"""Runs: create, read, transitions, run state, and the end's fence of the steps a run left
unsettled (``store._ended``); workflow versions."""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from pikku_celery.model import keys
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import (
    RUN_CANCELLED,
    RUN_FAILED,
    RUN_QUEUED,
    RUN_RUNNING,
    RUN_TERMINAL,
    STEP_FAILED,
    STEP_RUNNING,
    StepState,
    WorkflowRun,
)
from pikku_celery.model.validate import as_stored, check_name, check_state_write
from pikku_celery.store import _docs, _ended, _retry
from pikku_celery.store._checks import check_new_run, check_run_end, run_conflict
from pikku_celery.store.base import NewRun, RunRead
from pikku_celery.store.memory.base import Doc, MemoryStoreBase


class MemoryRuns(MemoryStoreBase):
    def create_run(self, run: NewRun, now_ms: int) -> tuple[WorkflowRun, bool]:
        check_new_run(run)
        with self._lock:
            existing = self._runs.get(run.run_id)
            if existing is not None:
                if existing[R.WORKFLOW] != run.workflow:
                    raise run_conflict(run, existing[R.WORKFLOW])
                return _docs.run_from_doc(copy.deepcopy(existing)), False
            doc = _docs.new_run_doc(run, now_ms)
            doc[R.INPUT] = as_stored(doc[R.INPUT])
            self._runs[run.run_id] = doc
            return _docs.run_from_doc(copy.deepcopy(doc)), True

    def get_run(self, run_id: str) -> WorkflowRun | None:
        check_name("run id", run_id)
        with self._lock:
            doc = self._runs.get(run_id)
            return None if doc is None else _docs.run_from_doc(copy.deepcopy(doc))

    def read_run(self, run_id: str, *, run: bool = True, input: bool = True,
                 all_steps: bool = False, step_names: Collection[str] = (),
                 recorded_after: int | None = None) -> RunRead:
        check_name("run id", run_id)
        ids = {keys.invocation_id(run_id, name) for name in step_names}
        with self._lock:
            found: WorkflowRun | None = None
            if run and run_id in self._runs:
                doc = copy.deepcopy(self._runs[run_id])
                if not input:
                    doc.pop(R.INPUT, None)
                found = _docs.run_from_doc(doc)
            if all_steps or recorded_after is not None:
                docs = [d for d in self._run_steps(run_id) if all_steps or d[S.ID] in ids
                        or (recorded_after is not None and d.get(S.SEQ, 0) > recorded_after)]
            else:  # by id: as cheap as MongoDB's ``_id`` lookups, whatever the store holds
                docs = [self._steps[i] for i in sorted(ids) if i in self._steps]
            steps = [_docs.step_from_doc(copy.deepcopy(d)) for d in docs]
        return RunRead(found, steps)

    def transition_run(self, run_id: str, from_statuses: Iterable[str], to_status: str,
                       now_ms: int, *, output: Any = None, error: dict[str, Any] | None = None,
                       cancel_reason: str | None = None, marked: bool = False) -> bool:
        # ``marked``: nothing to skip; one lock orders an end and a claim here, no mark.
        check_run_end(run_id, output, error)
        with self._lock:
            doc = self._runs.get(run_id)
            if doc is None or doc[R.STATUS] not in set(from_statuses):
                return False
            doc.update({R.STATUS: to_status, R.OUTPUT: as_stored(output),
                        R.ERROR: as_stored(error), R.UPDATED: now_ms})
            if cancel_reason is not None:
                doc[R.CANCEL_REASON] = cancel_reason
            return True

    def retry_run(self, run_id: str, now_ms: int, *, queued: bool = False,
                  by: str | None = None) -> list[StepState] | None:
        check_name("run id", run_id)
        entry = _retry.retry_entry(now_ms, by)
        with self._lock:
            doc = self._runs.get(run_id)
            if doc is None or doc[R.STATUS] not in (RUN_FAILED, RUN_CANCELLED):
                return None
            doc.update(_retry.revived_fields(now_ms, queued=queued))
            doc[R.LINEAGE] = [*(doc.get(R.LINEAGE) or ()), entry]
            return [] if queued else self._reopen_steps(run_id, now_ms)

    def resume_retry(self, run_id: str, now_ms: int) -> list[StepState] | None:
        check_name("run id", run_id)
        return None  # ``retry_run`` is one step under the lock here: never left half-done

    def admit_run(self, run_id: str, now_ms: int) -> list[StepState] | None:
        check_name("run id", run_id)
        with self._lock:
            doc = self._runs.get(run_id)
            if doc is None or doc[R.STATUS] != RUN_QUEUED:
                return None
            doc.update({R.STATUS: RUN_RUNNING, R.UPDATED: now_ms})
            return self._reopen_steps(run_id, now_ms) if doc.pop(R.REOPEN, None) else []

    def _reopen_steps(self, run_id: str, now_ms: int) -> list[StepState]:
        """Under the lock: the steps of a run just made live again that its end left
        failed for good."""
        reopened = []
        for step in self._run_steps(run_id):
            if step[S.STATUS] == STEP_FAILED and step[S.DUE] is None:
                _docs.apply_set(step, copy.deepcopy(_retry.reopened(step, now_ms)["$set"]))
                reopened.append(_docs.step_from_doc(copy.deepcopy(step)))
        return reopened

    def write_run_state(self, run_id: str, writer: str, values: Mapping[str, Any],
                        version: int, now_ms: int) -> WorkflowRun | None:
        check_name("run id", run_id)
        with self._lock:
            doc = self._runs.get(run_id)
            if doc is None or (doc.get(R.STATE_VERSION) or 0) != version:
                return None
            state = doc.get(R.STATE) or {}
            stored = check_state_write(writer, values, state)
            doc.update({R.STATE: {**state, **stored}, R.STATE_VERSION: version + 1,
                        R.STATE_WRITERS: [*(doc.get(R.STATE_WRITERS) or ()), writer],
                        R.UPDATED: max(doc[R.UPDATED], now_ms)})
            return _docs.run_from_doc(copy.deepcopy(doc))

    def touch_run(self, run_id: str, now_ms: int) -> str | None:
        check_name("run id", run_id)
        with self._lock:
            doc = self._runs.get(run_id)
            if doc is None:
                return None
            doc[R.UPDATED] = max(doc[R.UPDATED], now_ms)
            return str(doc[R.STATUS])

    def cancel_steps(self, run_id: str, error: dict[str, Any], now_ms: int, *,
                     while_ended: bool = False) -> int:
        check_name("run id", run_id)
        with self._lock:
            run = self._runs.get(run_id)
            if while_ended and (run is None or run[R.STATUS] not in RUN_TERMINAL):
                return 0  # the end was undone (a retry) before its fence: nothing to fence
            docs = [d for d in self._run_steps(run_id) if _ended.is_unsettled(d)]
            for doc in docs:
                # A running attempt's entry is closed; a failed attempt waiting for its
                # retry keeps its own entry.
                _docs.apply_set(doc, copy.deepcopy(_ended.fence_fields(
                    doc[S.ATTEMPT], as_stored(error), now_ms,
                    running=doc[S.STATUS] == STEP_RUNNING)))
            return len(docs)

    # --- versions ---------------------------------------------------------------------

    def record_version(self, workflow: str, version: str, source: str, now_ms: int) -> bool:
        key = f"{workflow}:{version}"
        with self._lock:
            if key in self._versions:
                return False
            self._versions[key] = {"workflow": workflow, "version": version, "source": source,
                                   "created_ms": now_ms}
            return True

    def get_version(self, workflow: str, version: str) -> dict[str, Any] | None:
        with self._lock:
            doc: Doc | None = self._versions.get(f"{workflow}:{version}")
            return None if doc is None else dict(doc)
