"""What every concern of the MongoDB store shares: the database and its collections, the
causally consistent session each public call runs in, and the indexes.

Each concern (``runs``, ``steps``, ``gates``, ``retention``, ``listing``) is a class on
``MongoStoreBase``; ``MongoWorkflowStore`` combines them. Every collection call names
``session=self._session``."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any

from pymongo import ASCENDING, DESCENDING
from pymongo.client_session import ClientSession
from pymongo.database import Database

from pikku_celery.model import keys
from pikku_celery.model.errors import WorkflowStepSupersededError
from pikku_celery.model.keys import EventField as E
from pikku_celery.model.keys import HistoryField as H
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import StepState
from pikku_celery.store._docs import step_from_doc
from pikku_celery.store._slots import SlotField as F
from pikku_celery.store.mongo.errors import describe_database
from pikku_celery.store.mongo.session import CausalClock

Doc = dict[str, Any]
# What a claim's or a settle's reply leaves out: the attempts' history (no ``StepState``
# field reads it).
STEP_REPLY: Doc = {S.ATTEMPTS: 0}

# Every index, by collection (see the schema in ``store.mongo``); ``create_indexes`` makes
# them and ``check_indexes`` reports the missing ones.
_NEWEST_FIRST = [(R.CREATED, DESCENDING), (R.RUN, DESCENDING)]
INDEXES: dict[str, list[list[tuple[str, int]]]] = {
    keys.RUNS: [[(R.STATUS, ASCENDING), (R.UPDATED, ASCENDING)],
                [(R.STATUS, ASCENDING), *_NEWEST_FIRST],
                [(R.WORKFLOW, ASCENDING), (R.STATUS, ASCENDING), *_NEWEST_FIRST],
                [(R.SLOT, ASCENDING), (R.STATUS, ASCENDING), (R.CREATED, ASCENDING),
                 (R.RUN, ASCENDING)],
                # A run's forks (``list_forks``), in the order they were made.
                [(R.FORKED_FROM, ASCENDING), (R.CREATED, ASCENDING), (R.RUN, ASCENDING)]],
    keys.STEPS: [[(S.RUN, ASCENDING), (S.CREATED, ASCENDING), (S.NAME, ASCENDING)],
                 [(S.RUN, ASCENDING), (S.STATUS, ASCENDING), (S.SEQ, ASCENDING)],
                 *([(S.STATUS, ASCENDING), (field, ASCENDING), (S.ID, ASCENDING)]
                   for field in (S.LEASE, S.UPDATED, S.DUE))],
    keys.HISTORY: [[(H.RUN, ASCENDING)]],
    keys.EVENTS: [[(E.RUN, ASCENDING), (E.NAME, ASCENDING), (E.SEQ, ASCENDING)],
                  [(E.RUN, ASCENDING), (E.SEQ, ASCENDING)],
                  [(E.WAKE, ASCENDING), (E.ID, ASCENDING)]],
    keys.SLOTS: [[(F.HELD, ASCENDING), (F.ID, ASCENDING)]],
}


class MongoStoreBase:
    """The state every concern of ``MongoWorkflowStore`` works on."""

    def __init__(self, db: Database[Doc], *, create_indexes: bool = True) -> None:
        self.db = db
        self._runs = db[keys.RUNS]
        self._steps = db[keys.STEPS]
        self._history = db[keys.HISTORY]
        self._versions = db[keys.VERSIONS]
        self._events = db[keys.EVENTS]
        self._slots = db[keys.SLOTS]
        self._schedules = db[keys.SCHEDULES]  # by ``_id`` (the name) only: no index of its own
        self._causal = CausalClock()
        self._sessions = True  # until the deployment says it has none (``session.public``)
        # Indexes are created before the first insert, not here: constructing a store (at
        # import of a Celery app module, say) must not open a connection.
        self._indexes_ready = not create_indexes

    @property
    def _session(self) -> ClientSession | None:
        """The causally consistent session of this thread's call in progress
        (``session.public``); every command of the store names it."""
        return self._causal.session

    @contextlib.contextmanager
    def _causally(self) -> Iterator[None]:
        """Run one public call in a causally consistent session that starts where this
        thread's previous calls ended: its reads wait until they reflect every write and
        read this thread made before, on whichever primary serves them.

        Why: the Dekker pairs of ``store._ended`` (a claim writes its step, then reads the
        run; a run's end writes the run, then reads its steps; a child's creation and its
        parent's cancel likewise) need each side's read to see its own write. On one
        primary a majority read after a majority write does; right after an election a new
        primary serves majority reads from a commit point that may be behind a write the
        old primary acknowledged, so the read can miss it (and miss the other side's write
        ordered before it). ``afterClusterTime`` makes the new primary wait until its
        majority snapshot covers the write. The pairs' writes and reads are separate store
        calls of one thread (``transition_run`` then ``cancel_steps``), so the times carry
        from call to call per thread, not per call. No extra command is sent: the session
        only adds ``lsid`` and ``afterClusterTime`` to the commands it would send anyway."""
        clock = self._causal
        if clock.session is not None or not self._sessions:  # nested call, or no sessions
            yield
            return
        with self.db.client.start_session(causal_consistency=True) as session:
            if clock.cluster_time is not None:
                session.advance_cluster_time(clock.cluster_time)
            if clock.operation_time is not None:
                session.advance_operation_time(clock.operation_time)
            clock.session = session
            try:
                yield
            except WorkflowStepSupersededError:
                # A refusal is an answer, not an unknown outcome: the write changed nothing
                # and the read naming the attempt now returned. The next call (the settle's
                # check whether an earlier try of it landed) must read at least that much,
                # on whichever primary serves it.
                self._carry(session)
                raise
            finally:
                clock.session = None
            # Reached only when the call returned. A call that raised may carry the time of
            # a write whose outcome is unknown (a ``WTimeoutError``: it waits for a
            # majority it may never get, or is rolled back): later reads must not wait for
            # it, or every read of this thread would hang while the set lacks its majority.
            self._carry(session)

    def _carry(self, session: ClientSession) -> None:
        clock = self._causal
        clock.cluster_time = session.cluster_time or clock.cluster_time
        clock.operation_time = session.operation_time or clock.operation_time

    def _as_recorded(self, docs: list[Doc], taken: Collection[str]) -> list[tuple[StepState, bool]]:
        """``insert_steps``' answer for ``docs``, of which those whose ids are in ``taken``
        existed already: those read as stored (one read, only when there are any)."""
        existing = {d[S.ID]: d for d in self._steps.find({S.ID: {"$in": sorted(taken)}},
                                                         session=self._session)
                    } if taken else {}
        return [(step_from_doc(existing[d[S.ID]]), False) if d[S.ID] in existing
                else (step_from_doc(d), True) for d in docs]

    def describe(self) -> str:
        """``MongoDB at mongodb://<hosts>/<database>``, for log lines: never credentials."""
        return describe_database(self.db)

    def ping(self) -> None:
        """Ask the server to answer; ``MongoUnreachableError`` naming it when none does."""
        self.db.command("ping")

    def create_indexes(self) -> None:
        """Create every index (idempotent); done automatically before the first insert."""
        for collection, indexes in INDEXES.items():
            for index in indexes:
                self.db[collection].create_index(index)
        # Only now: a first call that met an unreachable server must try again next time.
        self._indexes_ready = True

    def check_indexes(self) -> list[str]:
        """The declared indexes the database lacks, as ``collection (field, -field)``
        (``pikku check``); empty when all exist."""
        missing = []
        for collection, indexes in INDEXES.items():
            present = {tuple((f, int(d)) for f, d in info["key"])
                       for info in self.db[collection].index_information().values()}
            missing += [f"{collection} ({', '.join(('-' if d < 0 else '') + f for f, d in i)})"
                        for i in indexes if tuple(i) not in present]
        return missing
