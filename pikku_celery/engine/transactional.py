"""Transactional steps: exactly-once effects in MongoDB (DBOS's ``@transaction``).

A step declared ``@pikku.step(transactional=True, bind=True)`` gets ``ctx.session``, a
session of the store's MongoDB client with a transaction started; the body's writes made
with it commit in the same transaction as the step's fenced settle (``StepTransaction``).
An attempt that was superseded or cancelled while its body ran cannot settle, so its
transaction is aborted and its writes roll back: the app's collections hold the writes of
the attempt whose outcome is recorded, and of no other.

As MongoDB's drivers do in ``with_transaction``: a ``TransientTransactionError`` (a write
conflict, an election, a transaction the server aborted) runs the body again in a new
transaction, and a commit whose result is unknown (``UnknownTransactionCommitResult``) is
committed again, both for at most one step lease from the attempt's start; the attempt
checks that it still owns its step before each new try, so a superseded attempt does not
run its body again. A commit still unknown at the end is never taken for a settle: the
step is read back, and only a settle the store holds counts; otherwise the attempt lets its
lease lapse and the step is claimed again, as after a crash.

Only a body's failure is settled outside the transaction (its writes are rolled back
first): an error's record must not depend on the writes that failed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pikku_celery.engine.claims import Claimed, Claimer, StepContext
from pikku_celery.model.errors import (
    InvalidInputError,
    PikkuConfigurationError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.records import STEP_RUNNING, STEP_SUCCEEDED, StepState
from pikku_celery.model.validate import as_stored
from pikku_celery.store.base import WorkflowStore
from pikku_celery.store.mongo.transactions import COMMIT_UNKNOWN, TRANSIENT, has_label
from pikku_celery.workflow.definitions import StepDefinition

log = logging.getLogger("pikku_celery")
_PAUSE_S = 0.05  # between two tries after a transient error (doubled, at most 1 s)


@dataclass(frozen=True)
class Committed:
    """The body's result and the step as its settle, committed with the body's writes,
    left it."""

    result: Any
    settled: StepState


@dataclass(frozen=True)
class BodyFailed:
    """The body raised (its writes rolled back), or returned what can never be stored
    (``final``): the attempt's failure is for the caller to settle."""

    error: Exception
    final: bool = False


class TransactionalAttempt:
    """One claimed attempt of a transactional step on ``store``, its tries bounded by
    ``lease_ms`` from now."""

    def __init__(self, store: WorkflowStore, claimer: Claimer, lease_ms: int,
                 now_ms: Callable[[], int]) -> None:
        self.store = store
        self.claimer = claimer
        self.now_ms = now_ms
        self.ends = time.monotonic() + lease_ms / 1000
        self._pause = _PAUSE_S

    @staticmethod
    def possible(store: WorkflowStore) -> bool:
        """Whether ``store`` gives transactions (the test kit's in-memory store does not:
        there the body runs as any step's, with ``ctx.session`` ``None``)."""
        return getattr(store, "step_transaction", None) is not None

    def run(self, definition: StepDefinition, claim: Claimed) -> Committed | BodyFailed:
        """Tries until one commits or fails; ``WorkflowStepSupersededError`` (the attempt
        let go) when the attempt lost its step."""
        while True:
            outcome = self._try(definition, claim)
            if outcome is not None:
                return outcome

    def _try(self, definition: StepDefinition, claim: Claimed
             ) -> Committed | BodyFailed | None:
        """One transaction; ``None``: a transient error, try again."""
        state, held = claim.state, claim.held
        try:
            txn = self.store.step_transaction(state.step_name)  # type: ignore[attr-defined]
        except PikkuConfigurationError as exc:  # no transactions here: no attempt will do
            return BodyFailed(exc, final=True)
        held.in_transaction = True
        try:
            try:
                result = definition.fn(StepContext(
                    state, held, session=txn.session,
                    report=self.claimer.progress_of(state)), state.data)
            except Exception as exc:
                txn.abort()
                if has_label(exc, TRANSIENT):
                    self._check_still_owned(claim)  # a reclaim's write conflict, say
                return None if self._again(state, exc) else BodyFailed(exc)
            try:
                stored = as_stored(self.claimer.checked(claim, result).result)
            except InvalidInputError as exc:
                txn.abort()
                return BodyFailed(exc, final=True)
            try:
                settled = txn.settle(state.run_id, state.step_name, state.attempt, result,
                                     self.now_ms())
                self._commit(txn)
            except WorkflowStepSupersededError:
                txn.abort()
                self._let_go(claim)
                raise
            except Exception as exc:
                txn.abort()
                if has_label(exc, COMMIT_UNKNOWN):
                    landed = self._read_back(state, stored)
                    if landed is None:
                        raise  # not recorded: the lease lapses, the step is claimed again
                    settled = landed
                elif has_label(exc, TRANSIENT):
                    self._check_still_owned(claim)  # a reclaim's write conflict, say
                    if not self._again(state, exc):
                        raise
                    return None
                else:
                    raise
        finally:
            held.in_transaction = False
            txn.close()
        # Settled for good: its Redis lease lapses by itself (``Claimer._settle``).
        self.claimer.heartbeat.remove(held)
        return Committed(result, settled)

    def _again(self, state: StepState, exc: BaseException) -> bool:
        """A transient error with time left: pause, then the caller tries again."""
        if not has_label(exc, TRANSIENT) or time.monotonic() + self._pause >= self.ends:
            return False
        log.info("pikku: transactional step %r of run %s attempt %d: %s; its body runs "
                 "again in a new transaction", state.step_name, state.run_id, state.attempt,
                 exc)
        time.sleep(self._pause)
        self._pause = min(self._pause * 2, 1.0)
        return True

    def _commit(self, txn: Any) -> None:
        """Commit, asking again while the result is unknown (a commit is idempotent)."""
        pause = _PAUSE_S
        while True:
            try:
                txn.commit()
                return
            except Exception as exc:
                if not has_label(exc, COMMIT_UNKNOWN) or time.monotonic() + pause >= self.ends:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

    def _read_back(self, state: StepState, stored: Any) -> StepState | None:
        """After a commit whose result stayed unknown: the settle, if the store holds it."""
        try:
            current = self.store.get_step(state.run_id, state.step_name)
        except Exception:
            return None
        if (current is not None and current.attempt == state.attempt
                and current.status == STEP_SUCCEEDED and current.result == stored):
            return current
        return None

    def _check_still_owned(self, claim: Claimed) -> None:
        """After a transient error: a superseded attempt must not run its body again (its
        writes would only be rolled back), and ends as superseded, not with the error."""
        state = claim.state
        current = self.store.get_step(state.run_id, state.step_name)
        if current is None or current.attempt != state.attempt or current.status != STEP_RUNNING:
            self._let_go(claim)
            raise WorkflowStepSupersededError(state.run_id, state.step_name, state.attempt,
                                              None if current is None else current.attempt)

    def _let_go(self, claim: Claimed) -> None:
        claim.held.mark_lost("superseded at settle")
        self.claimer.heartbeat.remove(claim.held)
