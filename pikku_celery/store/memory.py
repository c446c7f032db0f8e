"""The reference store: the full contract in one process, every operation under one lock.

Not a mock: it keeps the same documents as the MongoDB store and takes the same decisions
(``_decide``), so the contract suite runs unchanged on both. Values are stored as JSON would
carry them (a tuple comes back a list, as from MongoDB) and copied out, so callers can never
alias stored state.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from pikku_celery import keys
from pikku_celery.errors import (
    InvalidInputError,
    WorkflowRunConflictError,
    WorkflowStepNotFoundError,
    WorkflowStepSupersededError,
)
from pikku_celery.keys import HistoryField as H
from pikku_celery.keys import RunField as R
from pikku_celery.keys import StepField as S
from pikku_celery.records import (
    RUN_RUNNING,
    RUN_STATUSES,
    RUN_TERMINAL,
    STEP_FAILED,
    STEP_PENDING,
    STEP_RUNNING,
    STEP_SCHEDULED,
    STEP_SUCCEEDED,
    StepAttempt,
    StepState,
    WorkflowRun,
)
from pikku_celery.store import _docs, _ended, _retention
from pikku_celery.store._decide import Action, decide_claim, is_due, lease_lapsed, running_fields
from pikku_celery.store.base import (
    ClaimResult,
    NewRun,
    NewStep,
    RunMatch,
    RunRead,
    check_run_match,
    due_sweep_key,
    run_matches,
)
from pikku_celery.validate import (
    as_stored,
    check_listing,
    check_name,
    check_state_write,
    check_value,
)

Doc = dict[str, Any]
_UNSETTLED = (STEP_PENDING, STEP_SCHEDULED, STEP_RUNNING)


class InMemoryWorkflowStore:
    """A complete ``WorkflowStore`` for tests and single-process use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, Doc] = {}
        self._steps: dict[str, Doc] = {}  # each with its history (``attempts``)
        self._versions: dict[str, Doc] = {}

    # --- runs -------------------------------------------------------------------------

    def create_run(self, run: NewRun, now_ms: int) -> tuple[WorkflowRun, bool]:
        check_name("run id", run.run_id)
        check_name("workflow name", run.workflow)
        check_value("workflow input", run.input)
        with self._lock:
            existing = self._runs.get(run.run_id)
            if existing is not None:
                if existing[R.WORKFLOW] != run.workflow:
                    raise WorkflowRunConflictError(
                        run.run_id, f"it already belongs to workflow {existing[R.WORKFLOW]!r}, "
                        f"not {run.workflow!r}"
                    )
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

    def transition_run(self, run_id: str, from_statuses: Iterable[str], to_status: str,
                       now_ms: int, *, output: Any = None, error: dict[str, Any] | None = None,
                       cancel_reason: str | None = None) -> bool:
        check_name("run id", run_id)
        check_value("workflow output", output)
        check_value("workflow error", error)
        with self._lock:
            doc = self._runs.get(run_id)
            if doc is None or doc[R.STATUS] not in set(from_statuses):
                return False
            doc.update({R.STATUS: to_status, R.OUTPUT: as_stored(output),
                        R.ERROR: as_stored(error), R.UPDATED: now_ms})
            if cancel_reason is not None:
                doc[R.CANCEL_REASON] = cancel_reason
            return True

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

    def list_runs(self, *, workflow: str | None = None, status: str | None = None,
                  limit: int = 50, created_before_ms: int | None = None,
                  before_run_id: str | None = None, match: RunMatch | None = None
                  ) -> list[WorkflowRun]:
        check_listing(workflow, status, limit, RUN_STATUSES)
        wanted = check_run_match(match)
        cursor = None if created_before_ms is None else (created_before_ms, before_run_id)
        with self._lock:
            docs = [d for d in self._runs.values()
                    if (workflow is None or d[R.WORKFLOW] == workflow)
                    and (status is None or d[R.STATUS] == status)
                    and (cursor is None or _before(d, cursor))
                    and run_matches(d.get(R.INPUT), wanted)]
            docs.sort(key=lambda d: (d[R.CREATED], d[R.ID]), reverse=True)
            return [_docs.run_from_doc(copy.deepcopy(d)) for d in docs[:limit]]

    # --- steps ------------------------------------------------------------------------

    def insert_step(self, step: NewStep, now_ms: int) -> tuple[StepState, bool]:
        check_name("run id", step.run_id)
        check_name("step name", step.step_name)
        check_value(f"data of step {step.step_name!r}", step.data)
        with self._lock:
            if step.run_id not in self._runs:
                raise InvalidInputError(f"cannot add step {step.step_name!r}: no run "
                                        f"{step.run_id!r}")
            doc = _docs.new_step_doc(step, now_ms)
            existing = self._steps.get(doc[S.ID])
            if existing is not None:
                return _docs.step_from_doc(copy.deepcopy(existing)), False
            doc[S.DATA] = as_stored(doc[S.DATA])
            self._steps[doc[S.ID]] = copy.deepcopy(doc)
            return _docs.step_from_doc(doc), True

    def insert_steps(self, steps: Sequence[NewStep], now_ms: int, *, seq: int = 0
                     ) -> list[tuple[StepState, bool]]:
        for step in steps:
            check_name("run id", step.run_id)
            check_name("step name", step.step_name)
            check_value(f"data of step {step.step_name!r}", step.data)
        out: list[tuple[StepState, bool]] = []
        with self._lock:
            for step in steps:
                doc = _docs.new_step_doc(step, now_ms, seq)
                existing = self._steps.get(doc[S.ID])
                if existing is not None:
                    out.append((_docs.step_from_doc(copy.deepcopy(existing)), False))
                    continue
                doc[S.DATA] = as_stored(doc[S.DATA])
                self._steps[doc[S.ID]] = copy.deepcopy(doc)
                out.append((_docs.step_from_doc(doc), True))
        return out

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

    def get_step(self, run_id: str, step_name: str) -> StepState | None:
        with self._lock:
            doc = self._steps.get(keys.invocation_id(run_id, step_name))
            return None if doc is None else _docs.step_from_doc(copy.deepcopy(doc))

    def list_steps(self, run_id: str) -> list[StepState]:
        check_name("run id", run_id)
        with self._lock:
            return [_docs.step_from_doc(copy.deepcopy(d)) for d in self._run_steps(run_id)]

    def claim_step(self, run_id: str, step_name: str, function: str | None, now_ms: int,
                   lease_ms: int, worker: str | None = None,
                   task_id: str | None = None) -> ClaimResult:
        with self._lock:
            doc = self._step_doc(run_id, step_name)
            decision = decide_claim(doc, function, now_ms)
            if decision.action is Action.NONE:
                return ClaimResult(None)
            if decision.action is Action.EXPIRE:
                self._expire(doc, now_ms)
                return ClaimResult(None, wake_run=True)
            attempt = doc[S.ATTEMPT] + (1 if decision.action is Action.RECLAIM else 0)
            fields = running_fields(now_ms, lease_ms, worker, task_id, attempt=attempt)
            if decision.action is Action.RECLAIM and doc[S.STATUS] == STEP_RUNNING:
                fields.update(_docs.superseded_fields(doc))  # the attempt fenced out
            _docs.apply_set(doc, copy.deepcopy(fields))
            doc[S.ATTEMPT] = attempt
            run = self._runs.get(run_id)
            if run is not None and run[R.STATUS] in RUN_TERMINAL:
                # What the MongoDB store's claim does when it reads the run after its write
                # and finds it ended (``store._ended``): the attempt it started is fenced.
                error = _ended.ended_error(run_id, run[R.STATUS], run.get(R.ERROR))
                _docs.apply_set(doc, _ended.fence_fields(attempt, copy.deepcopy(error),
                                                         now_ms, running=True))
                return ClaimResult(None)
            return ClaimResult(_docs.step_from_doc(copy.deepcopy(doc)))

    def set_result(self, run_id: str, step_name: str, attempt: int, result: Any,
                   now_ms: int) -> StepState:
        check_value(f"result of step {step_name!r}", result)
        with self._lock:
            doc = self._fenced(run_id, step_name, attempt)
            doc.update({S.STATUS: STEP_SUCCEEDED, S.RESULT: as_stored(result),
                        S.ERROR: None, S.LEASE: None, S.DUE: None, S.UPDATED: now_ms})
            _docs.apply_set(doc, _docs.closing_fields(attempt, STEP_SUCCEEDED, now_ms))
            return _docs.step_from_doc(copy.deepcopy(doc))

    def set_error(self, run_id: str, step_name: str, attempt: int, error: dict[str, Any],
                  now_ms: int, *, retry_at_ms: int | None = None,
                  final: bool = False) -> StepState:
        check_value(f"error of step {step_name!r}", error)
        with self._lock:
            doc = self._fenced(run_id, step_name, attempt)
            spent = final or attempt >= doc[S.MAX_ATTEMPTS]
            doc.update({S.STATUS: STEP_FAILED, S.ERROR: as_stored(error), S.RESULT: None,
                        S.LEASE: None, S.DUE: None if spent else (retry_at_ms or now_ms),
                        S.UPDATED: now_ms})
            _docs.apply_set(doc, _docs.closing_fields(attempt, STEP_FAILED, now_ms,
                                                      as_stored(error)))
            return _docs.step_from_doc(copy.deepcopy(doc))

    def renew_leases(self, held: Sequence[tuple[str, str, int]], now_ms: int,
                     lease_ms: int) -> set[tuple[str, str]]:
        refused: set[tuple[str, str]] = set()
        with self._lock:
            for run_id, step_name, attempt in held:
                doc = self._steps.get(keys.invocation_id(run_id, step_name))
                if (doc is None or doc[S.ATTEMPT] != attempt or doc[S.STATUS] != STEP_RUNNING
                        or doc[S.LEASE] is None):
                    refused.add((run_id, step_name))
                    continue
                doc[S.LEASE] = now_ms + lease_ms
        return refused

    def release_lease(self, run_id: str, step_name: str, attempt: int) -> bool:
        with self._lock:
            doc = self._steps.get(keys.invocation_id(run_id, step_name))
            if doc is None or doc[S.ATTEMPT] != attempt or doc[S.STATUS] != STEP_RUNNING:
                return False
            doc[S.LEASE] = None
            return True

    def settle_waiting_step(self, run_id: str, step_name: str, now_ms: int, *,
                            result: Any = None, error: dict[str, Any] | None = None,
                            child_run_id: str | None = None, gate: bool = False,
                            by: str | None = None, wake_check_ms: int | None = None) -> bool:
        check_value(f"result of step {step_name!r}", result)
        with self._lock:
            doc = self._steps.get(keys.invocation_id(run_id, step_name))
            if doc is None or not _is_waiting(doc, now_ms, child_run_id, gate):
                return False
            status = STEP_FAILED if error is not None else STEP_SUCCEEDED
            parked = doc[S.STATUS] == STEP_RUNNING
            doc.update({S.STATUS: status, S.RESULT: as_stored(result),
                        S.ERROR: as_stored(error), S.LEASE: None, S.DUE: wake_check_ms,
                        S.UPDATED: now_ms})
            if parked:  # on a child since its insert, which opened its one attempt
                _docs.apply_set(doc, _docs.closing_fields(1, status, now_ms, as_stored(error)))
            else:  # a sleep or a gate: its one attempt starts and ends here
                doc[S.WORKER] = by
                _docs.apply_set(doc, {_docs.entry_path(1): {
                    **_docs.open_entry(now_ms, by, None), H.STATUS: status,
                    H.ERROR: as_stored(error), H.ENDED: now_ms}})
            return True

    def clear_wake_check(self, run_id: str, step_name: str, due_ms: int) -> bool:
        with self._lock:
            doc = self._steps.get(keys.invocation_id(run_id, step_name))
            if doc is None or doc[S.STATUS] != STEP_SUCCEEDED or doc[S.DUE] != due_ms:
                return False
            doc[S.DUE] = None
            return True

    def cancel_steps(self, run_id: str, error: dict[str, Any], now_ms: int) -> int:
        check_name("run id", run_id)
        with self._lock:
            docs = [d for d in self._run_steps(run_id) if d[S.STATUS] in _UNSETTLED
                    or (d[S.STATUS] == STEP_FAILED and d[S.DUE] is not None)]
            for doc in docs:
                # A running attempt's entry is closed; a failed attempt waiting for its
                # retry keeps its own entry.
                _docs.apply_set(doc, copy.deepcopy(_ended.fence_fields(
                    doc[S.ATTEMPT], as_stored(error), now_ms,
                    running=doc[S.STATUS] == STEP_RUNNING)))
            return len(docs)

    # --- history ----------------------------------------------------------------------

    def get_history(self, run_id: str) -> list[StepAttempt]:
        check_name("run id", run_id)
        with self._lock:
            steps = copy.deepcopy(self._run_steps(run_id))
        return _docs.merge_history(steps)

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
            doc = self._versions.get(f"{workflow}:{version}")
            return None if doc is None else dict(doc)

    # --- sweeps -----------------------------------------------------------------------

    def find_lapsed_steps(self, now_ms: int, limit: int,
                          after: tuple[int, str] | None = None) -> list[StepState]:
        with self._lock:
            docs = [d for d in self._steps.values()
                    if d[S.STATUS] == STEP_RUNNING and lease_lapsed(d, now_ms)]
            return self._page(docs, S.LEASE, after, limit)

    def find_due_steps(self, now_ms: int, dispatched_before_ms: int, limit: int,
                       after: tuple[int, str] | None = None) -> list[StepState]:
        with self._lock:
            docs = [d for d in self._steps.values()
                    if (d[S.STATUS] == STEP_PENDING and d[S.UPDATED] < dispatched_before_ms)
                    or (d[S.STATUS] in (STEP_SCHEDULED, STEP_FAILED, STEP_SUCCEEDED)
                        and is_due(d, now_ms))]
            keyed = sorted((due_sweep_key(_docs.step_from_doc(d)), d) for d in docs)
            page = [d for key, d in keyed if after is None or key > after][:limit]
            return [_docs.step_from_doc(copy.deepcopy(d)) for d in page]

    @staticmethod
    def _page(docs: list[Doc], field: str, after: tuple[int, str] | None,
              limit: int) -> list[StepState]:
        keyed = sorted(((d[field], d[S.ID]), d) for d in docs)
        page = [d for key, d in keyed if after is None or key > after][:limit]
        return [_docs.step_from_doc(copy.deepcopy(d)) for d in page]

    def find_stalled_runs(self, idle_since_ms: int, limit: int) -> list[WorkflowRun]:
        with self._lock:
            docs = [d for d in self._runs.values()
                    if d[R.STATUS] == RUN_RUNNING and d[R.UPDATED] < idle_since_ms]
            return [_docs.run_from_doc(copy.deepcopy(d)) for d in docs[:limit]]

    def touch_runs(self, run_ids: Collection[str], now_ms: int) -> None:
        with self._lock:
            for run_id in run_ids:
                doc = self._runs.get(run_id)
                if doc is not None:
                    doc[R.UPDATED] = max(doc[R.UPDATED], now_ms)

    def find_unsettled_steps(self, run_ids: Collection[str]) -> list[StepState]:
        wanted = set(run_ids)
        with self._lock:
            return [_docs.step_from_doc(copy.deepcopy(d)) for d in self._steps.values()
                    if d[S.RUN] in wanted and (d[S.STATUS] in _UNSETTLED or (
                        d[S.STATUS] == STEP_FAILED and d[S.DUE] is not None))]

    # --- retention and counts -----------------------------------------------------------

    def count_runs(self, *, status: str, workflow: str | None = None,
                   updated_before_ms: int | None = None, limit: int = 10_000,
                   match: RunMatch | None = None) -> int:
        _retention.check_count(status, workflow, updated_before_ms, limit)
        wanted = check_run_match(match)
        with self._lock:
            found = sum(1 for d in self._runs.values()
                        if d[R.STATUS] == status
                        and (workflow is None or d[R.WORKFLOW] == workflow)
                        and (updated_before_ms is None or d[R.UPDATED] < updated_before_ms)
                        and run_matches(d.get(R.INPUT), wanted))
        return min(found, limit)

    def purge_runs(self, ended_before_ms: int, *, statuses: Iterable[str] = RUN_TERMINAL,
                   limit: int = 500) -> list[str]:
        chosen = _retention.check_purge(ended_before_ms, statuses, limit)
        with self._lock:
            found = [d for d in self._runs.values()
                     if d[R.STATUS] in chosen and d[R.UPDATED] < ended_before_ms]
            # A child its parent has not heard yet is kept (``_retention.parked_steps``).
            parked = _retention.parked_steps(found)
            unheard = {child for step_id, child in parked.items()
                       if (step := self._steps.get(step_id)) is not None
                       and step[S.STATUS] == STEP_RUNNING and step.get(S.CHILD_RUN) == child}
            ids = [d[R.ID] for d in found if d[R.ID] not in unheard][:limit]
            doomed = set(ids)  # a step's history is in its document: it goes with it
            for key in [k for k, d in self._steps.items() if d[S.RUN] in doomed]:
                del self._steps[key]
            for run_id in ids:
                del self._runs[run_id]
        return ids

    # --- internals (call with the lock held) --------------------------------------------

    def _run_steps(self, run_id: str) -> list[Doc]:
        docs = [d for d in self._steps.values() if d[S.RUN] == run_id]
        docs.sort(key=lambda d: (d[S.CREATED], d[S.NAME]))
        return docs

    def _step_doc(self, run_id: str, step_name: str) -> Doc:
        doc = self._steps.get(keys.invocation_id(run_id, step_name))
        if doc is None:
            raise WorkflowStepNotFoundError(run_id, step_name)
        return doc

    def _fenced(self, run_id: str, step_name: str, attempt: int) -> Doc:
        doc = self._steps.get(keys.invocation_id(run_id, step_name))
        if doc is None or doc[S.ATTEMPT] != attempt or doc[S.STATUS] != STEP_RUNNING:
            current = None if doc is None else doc[S.ATTEMPT]
            raise WorkflowStepSupersededError(run_id, step_name, attempt, current)
        return doc

    def _expire(self, doc: Doc, now_ms: int) -> None:
        error = _docs.lease_expired_error(doc)
        doc.update({S.STATUS: STEP_FAILED, S.LEASE: None, S.DUE: None, S.RESULT: None,
                    S.ERROR: error, S.UPDATED: now_ms})
        _docs.apply_set(doc, _docs.closing_fields(doc[S.ATTEMPT], STEP_FAILED, now_ms,
                                                  copy.deepcopy(error)))


def _is_waiting(doc: Doc, now_ms: int, child_run_id: str | None, gate: bool) -> bool:
    if child_run_id is not None:
        return doc[S.STATUS] == STEP_RUNNING and doc.get(S.CHILD_RUN) == child_run_id
    if doc[S.STATUS] != STEP_SCHEDULED or doc.get(S.FUNCTION) is not None:
        return False
    if gate:  # never due by itself, or an approval not yet expired
        return doc.get(S.DUE) is None or not is_due(doc, now_ms)
    return is_due(doc, now_ms)


def _before(doc: Doc, cursor: tuple[int, str | None]) -> bool:
    created, run_id = cursor
    if doc[R.CREATED] != created:
        return bool(doc[R.CREATED] < created)
    return run_id is not None and doc[R.ID] < run_id
