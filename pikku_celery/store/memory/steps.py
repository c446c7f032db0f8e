"""Steps: insert, claim (``_decide``), settle (``_settle``), leases and history, each under
the lock. A claim of a step of an ended run fences the attempt it started, as the MongoDB
store's claim does when it reads the run after its write (``store._ended``)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from pikku_celery.model import keys
from pikku_celery.model.errors import (
    InvalidInputError,
    WorkflowStepNotFoundError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import RUN_TERMINAL, STEP_RUNNING, StepAttempt, StepState
from pikku_celery.model.validate import as_stored, check_name, check_progress, check_value
from pikku_celery.store import _docs, _ended, _retry
from pikku_celery.store._checks import check_new_steps
from pikku_celery.store._decide import Action, claimed_step_doc, decide_claim, running_fields
from pikku_celery.store._settle import expired_fields, failed_fields, succeeded_fields
from pikku_celery.store.base import NOT_GIVEN, ClaimResult, NewClaim, NewStep
from pikku_celery.store.memory.base import Doc, MemoryStoreBase


class MemorySteps(MemoryStoreBase):
    def insert_step(self, step: NewStep, now_ms: int) -> tuple[StepState, bool]:
        check_new_steps([step])
        with self._lock:
            if step.run_id not in self._runs:
                raise InvalidInputError(f"cannot add step {step.step_name!r}: no run "
                                        f"{step.run_id!r}")
            return self._insert(_docs.new_step_doc(step, now_ms))

    def insert_steps(self, steps: Sequence[NewStep], now_ms: int, *, seq: int = 0
                     ) -> list[tuple[StepState, bool]]:
        check_new_steps(steps)
        with self._lock:
            return [self._insert(_docs.new_step_doc(step, now_ms, seq)) for step in steps]

    def claim_new_step(self, step: NewStep, now_ms: int, lease_ms: int, *, seq: int = 0,
                       worker: str | None = None, task_id: str | None = None) -> NewClaim:
        check_new_steps([step])
        with self._lock:
            return self._claim_new(step, now_ms, lease_ms, seq, worker, task_id)

    def _claim_new(self, step: NewStep, now_ms: int, lease_ms: int, seq: int,
                   worker: str | None, task_id: str | None) -> NewClaim:
        """``claim_new_step`` under the caller's lock."""
        doc = claimed_step_doc(step, now_ms, lease_ms, worker, task_id, seq)
        state, created = self._insert(doc)
        if not created:
            return NewClaim(state, created=False)
        run = self._runs.get(step.run_id)
        if run is None or run[R.STATUS] not in RUN_TERMINAL:
            return NewClaim(state, created=True)
        # What the MongoDB store does when its read after the insert finds the run ended.
        stored = self._steps[doc[S.ID]]
        error = _ended.ended_error(step.run_id, run[R.STATUS], run.get(R.ERROR))
        _docs.apply_set(stored, _ended.fence_fields(1, copy.deepcopy(error), now_ms,
                                                    running=True))
        return NewClaim(None, created=True, run_status=run[R.STATUS])

    def settle_and_claim_new(self, run_id: str, step_name: str, attempt: int, result: Any,
                             now_ms: int, step: NewStep, lease_ms: int, *, seq: int = 0,
                             worker: str | None = None, task_id: str | None = None
                             ) -> NewClaim:
        check_value(f"result of step {step_name!r}", result)
        check_new_steps([step])
        with self._lock:  # one atomic step, as MongoDB's one command
            settled = self._fenced(run_id, step_name, attempt)
            _docs.apply_set(settled, succeeded_fields(attempt, as_stored(result), now_ms))
            return self._claim_new(step, now_ms, lease_ms, seq, worker, task_id)

    def settle_and_insert_steps(self, run_id: str, step_name: str, attempt: int, result: Any,
                                now_ms: int, steps: Sequence[NewStep], *, seq: int = 0,
                                end_mark: bool = False) -> list[tuple[StepState, bool]]:
        # ``end_mark``: no mark to leave; one lock orders an end and a claim here.
        check_value(f"result of step {step_name!r}", result)
        check_new_steps(steps)
        with self._lock:  # one atomic step, as MongoDB's one command
            settled = self._fenced(run_id, step_name, attempt)
            _docs.apply_set(settled, succeeded_fields(attempt, as_stored(result), now_ms))
            return [self._insert(_docs.new_step_doc(step, now_ms, seq)) for step in steps]

    def insert_replayed_steps(self, run_id: str, steps: Sequence[StepState], now_ms: int,
                              *, source_run_id: str) -> int:
        check_name("run id", run_id)
        with self._lock:
            return sum(self._insert(_retry.forked_doc(run_id, state, now_ms,
                                                      source_run_id))[1] for state in steps)

    def _insert(self, doc: Doc) -> tuple[StepState, bool]:
        existing = self._steps.get(doc[S.ID])
        if existing is not None:
            return _docs.step_from_doc(copy.deepcopy(existing)), False
        doc[S.DATA] = as_stored(doc[S.DATA])
        self._steps[doc[S.ID]] = copy.deepcopy(doc)
        return _docs.step_from_doc(doc), True

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
                   task_id: str | None = None, *, expected: object = None) -> ClaimResult:
        # ``expected`` (the step as its message says it was recorded) only saves MongoDB a
        # read; here the step is at hand, and the claim decides from it.
        with self._lock:
            doc = self._steps.get(keys.invocation_id(run_id, step_name))
            if doc is None:
                raise WorkflowStepNotFoundError(run_id, step_name)
            decision = decide_claim(doc, function, now_ms)
            if decision.action is Action.NONE:
                return ClaimResult(None)
            if decision.action is Action.EXPIRE:
                _docs.apply_set(doc, copy.deepcopy(expired_fields(doc, now_ms)))
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
                return ClaimResult(None, run_status=run[R.STATUS])
            return ClaimResult(_docs.step_from_doc(copy.deepcopy(doc)))

    def set_result(self, run_id: str, step_name: str, attempt: int, result: Any,
                   now_ms: int, *, claimed_data: Any = NOT_GIVEN) -> StepState:
        check_value(f"result of step {step_name!r}", result)
        with self._lock:
            doc = self._fenced(run_id, step_name, attempt)
            _docs.apply_set(doc, succeeded_fields(attempt, as_stored(result), now_ms))
            return _docs.step_from_doc(copy.deepcopy(doc))

    def set_error(self, run_id: str, step_name: str, attempt: int, error: dict[str, Any],
                  now_ms: int, *, retry_at_ms: int | None = None,
                  final: bool = False, claimed_data: Any = NOT_GIVEN) -> StepState:
        check_value(f"error of step {step_name!r}", error)
        with self._lock:
            doc = self._fenced(run_id, step_name, attempt)
            spent = final or attempt >= doc[S.MAX_ATTEMPTS]
            due = None if spent else (retry_at_ms or now_ms)
            _docs.apply_set(doc, copy.deepcopy(failed_fields(attempt, as_stored(error),
                                                             now_ms, due)))
            return _docs.step_from_doc(copy.deepcopy(doc))

    def _fenced(self, run_id: str, step_name: str, attempt: int) -> Doc:
        doc = self._steps.get(keys.invocation_id(run_id, step_name))
        if doc is None or doc[S.ATTEMPT] != attempt or doc[S.STATUS] != STEP_RUNNING:
            current = None if doc is None else doc[S.ATTEMPT]
            raise WorkflowStepSupersededError(run_id, step_name, attempt, current)
        return doc

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

    def record_progress(self, run_id: str, step_name: str, attempt: int, progress: Any,
                        now_ms: int) -> None:
        check_progress(step_name, progress)
        with self._lock:
            doc = self._steps.get(keys.invocation_id(run_id, step_name))
            if doc is None or doc[S.ATTEMPT] != attempt or doc[S.STATUS] != STEP_RUNNING:
                raise WorkflowStepSupersededError(run_id, step_name, attempt,
                                                  None if doc is None else doc[S.ATTEMPT])
            doc[S.PROGRESS] = copy.deepcopy(progress)
            doc[S.PROGRESS_AT] = now_ms

    def release_lease(self, run_id: str, step_name: str, attempt: int) -> bool:
        with self._lock:
            doc = self._steps.get(keys.invocation_id(run_id, step_name))
            if doc is None or doc[S.ATTEMPT] != attempt or doc[S.STATUS] != STEP_RUNNING:
                return False
            doc[S.LEASE] = None
            return True

    def get_history(self, run_id: str) -> list[StepAttempt]:
        check_name("run id", run_id)
        with self._lock:
            steps = copy.deepcopy(self._run_steps(run_id))
        return _docs.merge_history(steps)
