"""A transactional step's MongoDB transaction: the body's writes (with ``ctx.session``) and
the step's fenced settle commit together, or not at all.

The settle is the transaction's last write, and the step document is written by nobody
else while the body runs: the heartbeat leaves the store lease of a step in a transaction
alone (``heartbeat.HeldStep.in_transaction``), since its renewal would be a write conflict
with the settle. So the only writes to the step meanwhile are a reclaim (its lease lapsed:
the attempt was stalled past it) and a cancel's fence, and each makes the settle fail: its
filter no longer matches (superseded), or MongoDB reports the write conflict. Either way
the transaction is aborted and the body's writes roll back with it: only the attempt whose
settle commits leaves its writes."""

from __future__ import annotations

import contextlib
from typing import Any

from pymongo import ReadPreference
from pymongo.client_session import ClientSession
from pymongo.errors import OperationFailure, PyMongoError
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from pikku_celery.model.errors import PikkuConfigurationError
from pikku_celery.model.records import StepState

TRANSIENT = "TransientTransactionError"
COMMIT_UNKNOWN = "UnknownTransactionCommitResult"
# "Transaction numbers are only allowed on a replica set member or mongos" (IllegalOperation)
_NO_TRANSACTIONS = 20


def has_label(exc: BaseException, label: str) -> bool:
    return isinstance(exc, PyMongoError) and exc.has_error_label(label)


class StepTransaction:
    """One try of a transactional step: a session of the store's client with a transaction
    started (``session``), then ``settle`` and ``commit`` (or ``abort``); ``close`` ends the
    session. Opened by ``MongoTransactions.step_transaction``."""

    def __init__(self, store: Any, session: ClientSession) -> None:
        self._store = store
        self.session = session

    def settle(self, run_id: str, step_name: str, attempt: int, result: Any,
               now_ms: int) -> StepState:
        """The step's fenced settle, inside the transaction: the store's own ``set_result``
        run in this session (its calls take the thread's session when one is set)."""
        clock = self._store._causal
        outer, clock.session = clock.session, self.session
        try:
            state: StepState = self._store.set_result(run_id, step_name, attempt, result,
                                                      now_ms)
            return state
        finally:
            clock.session = outer

    def commit(self) -> None:
        """Commit; a commit whose result is unknown is asked again (it is idempotent) by
        the caller, which bounds how long."""
        self.session.commit_transaction()

    def abort(self) -> None:
        if self.session.in_transaction:
            with contextlib.suppress(PyMongoError):  # aborted by the server already
                self.session.abort_transaction()

    def close(self) -> None:
        self.abort()
        self.session.end_session()


class MongoTransactions:
    """``step_transaction`` for ``MongoWorkflowStore``: MongoDB has transactions on a
    replica set or a sharded cluster (never on a standalone server)."""

    db: Any
    _steps: Any

    def step_transaction(self, step_name: str) -> StepTransaction:
        """Start a transaction for a try of ``step_name``'s body. Majority reads and writes:
        what the body reads was committed, and what it writes survives a failover once the
        commit returns. ``PikkuConfigurationError`` on a server that has no transactions."""
        session = self.db.client.start_session(causal_consistency=False)
        try:
            session.start_transaction(read_concern=ReadConcern("majority"),
                                      write_concern=WriteConcern("majority"),
                                      read_preference=ReadPreference.PRIMARY)
            # A first command, so a standalone server refuses here, before the body runs.
            self._steps.find_one({"_id": None}, session=session)
        except OperationFailure as exc:
            session.end_session()
            if exc.code == _NO_TRANSACTIONS or "Transaction numbers" in str(exc):
                raise PikkuConfigurationError(
                    f"step {step_name!r} is transactional, and {self.describe()} has no "
                    "transactions (a standalone server): run MongoDB as a replica set "
                    "(one node will do) and keep the step's collections on it") from None
            raise
        except BaseException:
            session.end_session()
            raise
        return StepTransaction(self, session)

    def describe(self) -> str:  # ``MongoStoreBase.describe``, earlier in the bases
        raise NotImplementedError
