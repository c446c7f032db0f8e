"""The MongoDB store (pymongo).

Schema (names live in ``pikku_celery.keys``; times are int epoch ms on the lease clock):

``workflow_runs``   ``_id`` run id, ``run_id`` (the same id again: see below), ``workflow``,
                    ``status``, ``input``, ``output``, ``error``, ``version``,
                    ``parent_run_id``, ``parent_step_name``, ``cancel_reason``,
                    ``created_ms``, ``updated_ms``.
                    Indexes: ``(status, updated_ms)`` for the stalled sweep and purges;
                    ``(status, created_ms desc, run_id desc)`` and ``(workflow, status,
                    created_ms desc, run_id desc)`` for listing newest first (a listing
                    without a status filter names every status, and MongoDB merges one
                    sorted scan per status: no sort in memory, no scan of other workflows'
                    runs). The listing's tie-break is ``run_id``, a copy of ``_id``: as fast
                    on MongoDB as ``_id`` in the index, and the nx-27017 stand-in the tests
                    run on cannot index ``_id`` in a compound index.
``workflow_steps``  ``_id`` invocation id (uuid5 of run id and step name: the same across
                    attempts), ``run_id``, ``step_name``, ``function``, ``data``, ``status``,
                    ``attempt`` (the fencing token, 1-based), ``max_attempts``,
                    ``retry_delay_ms``, ``result``, ``error``, ``lease_expires_ms`` (null when
                    not running, or parked on a child run), ``due_ms`` (when a scheduled step
                    or a failed step's next attempt may start; null when never), ``started_ms``,
                    ``worker``, ``task_id`` (the Celery task id of the delivery that claimed
                    the attempt), ``child_run_id``, ``on_error``, ``attempts`` (the history:
                    ``{"<attempt>": {status, error, started_ms, ended_ms, worker, task_id}}``,
                    one entry per attempt), ``created_ms``, ``updated_ms``.
                    Indexes: ``(run_id, created_ms, step_name)`` for a run's steps in
                    order (``_id`` already makes a step unique); ``(run_id, status, seq)``
                    for the steps a pass recorded since its token and the unsettled steps
                    of the runs the stalled sweep found; ``(status,
                    lease_expires_ms, _id)`` for the lapsed sweep, ``(status, updated_ms,
                    _id)`` (undispatched) and ``(status, due_ms, _id)`` (due) for the due
                    sweep, which reads each branch with a query of its own. Each sweep's
                    range bounds the scan to its backlog (lapsed, undispatched or due
                    steps, the few the reaper has not handled yet), read in its paging
                    order from the index: nothing is sorted in memory.
``workflow_step_history``  written by earlier versions only (one document per attempt,
                    ``_id`` ``<step id>:<attempt>``, ``step_id``, ``run_id``, ...): read for
                    a step whose document has no ``attempts``, deleted with its run. Index:
                    ``run_id``.
``workflow_versions``  ``_id`` ``<workflow>:<version>``, ``workflow``, ``version``,
                    ``source``, ``created_ms``; first writer wins (insert, duplicate ignored).

Atomicity: every claim, fenced write and run transition is one ``update_one`` or
``find_one_and_update`` whose filter repeats what the decision read. A step's history lives
in its document, so each write that changes the step writes its history entry too, in the
same atomic write: the claim opens the attempt's entry (and a reclaim closes the entry of
the attempt it fences out), the settle closes it. A step in steady state costs three
commands: the claim (one optimistic ``find_one_and_update``), the claim's point read of its
run (a claim of a step of an ended run fences itself: ``store._ended``) and the settle.

Concerns: ``from_url`` writes with ``w="majority"`` (``wtimeout`` 10 s) and reads with
``readConcern "majority"`` unless told otherwise, and pymongo's retryable writes stay on:
see ``pikku_celery.store._concerns`` for why, for what a failover or a set without its
majority does to a claim or settle, and for the deadline the heartbeat and settles put on
their calls.

Indexes: every query's filter and sort is served by an index whose fields are the query's
equality fields, then its sort, then its range (``tests/unit/test_hardening_infra.py``
checks every query the store issues against them, and
``tests/contract/test_store_indexes.py`` has a real ``mongod`` explain each: no collection
scan, no sort in memory). Each index
costs on every write that changes its keys, so there are no others. A database created by
an earlier version keeps the indexes it had (``pikku check`` names the ones it lacks,
``pikku check --create-indexes`` makes them); the ones no longer declared (``(created_ms)``
and ``(workflow, created_ms)`` on runs; ``(run_id, step_name)``, ``(run_id, seq)``,
``(status, lease_expires_ms)``, ``(status, updated_ms)`` and ``(status, due_ms)`` on
steps; ``(step_id, attempt)`` on history) can be dropped. Its runs
have no ``run_id`` copy: they sort last among runs of the same millisecond.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import inspect
import itertools
import re
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar
from urllib.parse import parse_qsl, urlsplit

from bson.errors import InvalidDocument
from bson.timestamp import Timestamp
from pymongo import ASCENDING, DESCENDING, MongoClient, ReturnDocument
from pymongo.client_session import ClientSession
from pymongo.database import Database
from pymongo.errors import (
    BulkWriteError,
    ConfigurationError,
    DocumentTooLarge,
    DuplicateKeyError,
    OperationFailure,
    ServerSelectionTimeoutError,
)

from pikku_celery import keys
from pikku_celery.durations import Duration, to_seconds
from pikku_celery.errors import (
    InvalidInputError,
    WorkflowRunConflictError,
    WorkflowStepNotFoundError,
    WorkflowStepSupersededError,
)
from pikku_celery.keys import HistoryField as H
from pikku_celery.keys import RunField as R
from pikku_celery.keys import StepField as S
from pikku_celery.keys import VersionField as V
from pikku_celery.records import (
    RUN_RUNNING,
    RUN_STATUSES,
    RUN_TERMINAL,
    STEP_FAILED,
    STEP_PENDING,
    STEP_RUNNING,
    STEP_SCHEDULED,
    STEP_STATUSES,
    STEP_SUCCEEDED,
    StepAttempt,
    StepState,
    WorkflowRun,
)
from pikku_celery.store import _concerns, _docs, _ended, _retention
from pikku_celery.store._concerns import ReadConcernLike, WriteConcernLike
from pikku_celery.store._decide import (
    Action,
    decide_claim,
    first_claim_filter,
    guard_for,
    running_fields,
)
from pikku_celery.store.base import (
    ClaimResult,
    NewRun,
    NewStep,
    RunMatch,
    RunRead,
    check_run_match,
    due_sweep_key,
)
from pikku_celery.validate import check_listing, check_name, check_state_write, check_value

Doc = dict[str, Any]
_AFTER = ReturnDocument.AFTER
_UNSETTLED: Doc = {"$or": [{S.STATUS: {"$in": [STEP_PENDING, STEP_SCHEDULED, STEP_RUNNING]}},
                           {S.STATUS: STEP_FAILED, S.DUE: {"$ne": None}}]}


class MongoWorkflowStore:
    """A ``WorkflowStore`` on a pymongo ``Database``; safe from any number of processes."""

    def __init__(self, db: Database[Doc], *, create_indexes: bool = True) -> None:
        self.db = db
        self._runs = db[keys.RUNS]
        self._steps = db[keys.STEPS]
        self._history = db[keys.HISTORY]
        self._versions = db[keys.VERSIONS]
        self._causal = _CausalClock()
        self._sessions = True  # until the deployment says it has none (see ``_public``)
        # Indexes are created before the first insert, not here: constructing a store (at
        # import of a Celery app module, say) must not open a connection.
        self._indexes_ready = not create_indexes

    @classmethod
    def from_url(cls, url: str, *, server_selection_timeout: Duration | None = None,
                 write_concern: WriteConcernLike | None = None,
                 read_concern: ReadConcernLike | None = None,
                 **client_options: Any) -> MongoWorkflowStore:
        """Connect to ``url``; the database is the URL's path, ``pikku`` when it is empty.

        ``server_selection_timeout`` (any duration; default 5 s, or the URL's
        ``serverSelectionTimeoutMS``) is how long a call waits for a usable server before it
        fails with ``MongoUnreachableError``; pymongo's own default, 30 s, would hold a
        ``start`` or a worker's sweep that long.

        ``write_concern`` (a ``WriteConcern``, a mapping of its options, or ``w``) and
        ``read_concern`` (a ``ReadConcern`` or its level) apply to every collection of the
        store. Each write concern option comes from ``write_concern``, else the URL or
        ``client_options`` (``w=``, ``wtimeoutMS=``, ``journal=``), else the default
        ``w="majority"`` with a ``wtimeout`` of 10 s (none for ``w=1``); the read concern
        is ``majority`` with majority writes, ``local`` with any other ``w``, unless given or
        set by the URL (``readConcernLevel=``). Why:
        ``pikku_celery.store._concerns``. Other keyword arguments go to ``MongoClient``."""
        # connect=False: no connection and no monitor thread until first use, so a store
        # built in a Celery app module is safe across the prefork pool's fork.
        options: dict[str, Any] = {"connect": False, **client_options}
        given = {k.lower() for k in options} | {k.lower() for k, _ in parse_qsl(
            urlsplit(url).query)}
        if server_selection_timeout is not None or "serverselectiontimeoutms" not in given:
            timeout_s = to_seconds(DEFAULT_SERVER_SELECTION_TIMEOUT_S
                                   if server_selection_timeout is None
                                   else server_selection_timeout,
                                   what="server_selection_timeout")
            options["serverSelectionTimeoutMS"] = max(1, round(timeout_s * 1000))
        # Checked before a client exists: a bad setting makes none.
        if write_concern is not None:
            _concerns.write_concern(write_concern)
        reads = None if read_concern is None else _concerns.read_concern(read_concern)
        client: MongoClient[Doc] = MongoClient(url, **options)
        try:
            writes = _concerns.resolve_write_concern(client.write_concern, write_concern)
        except ValueError:
            client.close()
            raise
        if read_concern is None and "readconcernlevel" not in given:
            reads = _concerns.read_concern(_concerns.default_read_concern(writes))
        return cls(client.get_default_database(default=keys.DEFAULT_DATABASE,
                                               write_concern=writes, read_concern=reads))

    @property
    def _session(self) -> ClientSession | None:
        """The causally consistent session of this thread's call in progress (``_public``);
        every command of the store names it."""
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
            finally:
                clock.session = None
            # Reached only when the call returned. A call that raised may carry the time of
            # a write whose outcome is unknown (a ``WTimeoutError``: it waits for a
            # majority it may never get, or is rolled back): later reads must not wait for
            # it, or every read of this thread would hang while the set lacks its majority.
            clock.cluster_time = session.cluster_time or clock.cluster_time
            clock.operation_time = session.operation_time or clock.operation_time

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

    # --- runs -------------------------------------------------------------------------

    def create_run(self, run: NewRun, now_ms: int) -> tuple[WorkflowRun, bool]:
        check_name("run id", run.run_id)
        check_name("workflow name", run.workflow)
        check_value("workflow input", run.input)
        if not self._indexes_ready:
            self.create_indexes()
        doc = _docs.new_run_doc(run, now_ms)
        try:
            with _storable("workflow input"):
                self._runs.insert_one(doc, session=self._session)
            return _docs.run_from_doc(doc), True
        except DuplicateKeyError:
            existing = self._runs.find_one({R.ID: run.run_id}, session=self._session)
            if existing is None:  # pragma: no cover - purged between the two calls
                raise
            if existing[R.WORKFLOW] != run.workflow:
                raise WorkflowRunConflictError(
                    run.run_id, f"it already belongs to workflow {existing[R.WORKFLOW]!r}, "
                    f"not {run.workflow!r}"
                ) from None
            return _docs.run_from_doc(existing), False

    def get_run(self, run_id: str) -> WorkflowRun | None:
        check_name("run id", run_id)
        doc = self._runs.find_one({R.ID: run_id}, session=self._session)
        return None if doc is None else _docs.run_from_doc(doc)

    def transition_run(self, run_id: str, from_statuses: Iterable[str], to_status: str,
                       now_ms: int, *, output: Any = None, error: dict[str, Any] | None = None,
                       cancel_reason: str | None = None) -> bool:
        check_name("run id", run_id)
        check_value("workflow output", output)
        check_value("workflow error", error)
        fields: Doc = {R.STATUS: to_status, R.OUTPUT: output, R.ERROR: error,
                       R.UPDATED: now_ms}
        if cancel_reason is not None:
            fields[R.CANCEL_REASON] = cancel_reason
        with _storable("workflow output"):
            found = self._runs.update_one(
                {R.ID: run_id, R.STATUS: {"$in": list(from_statuses)}}, {"$set": fields},
                session=self._session)
        return found.matched_count == 1

    def write_run_state(self, run_id: str, writer: str, values: Mapping[str, Any],
                        version: int, now_ms: int) -> WorkflowRun | None:
        check_name("run id", run_id)
        current = self._runs.find_one({R.ID: run_id}, projection={R.STATE: 1},
                                      session=self._session)
        if current is None:
            return None
        # Checked against the map as read; the guard below makes sure it is still that map.
        stored = check_state_write(writer, values, current.get(R.STATE) or {})
        # Runs stored before run state have no version field: null matches a missing one.
        at = version if version else {"$in": [0, None]}
        doc = self._runs.find_one_and_update(
            {R.ID: run_id, R.STATE_VERSION: at},
            {"$set": {**{f"{R.STATE}.{k}": v for k, v in stored.items()},
                      R.STATE_VERSION: version + 1},
             "$push": {R.STATE_WRITERS: writer}, "$max": {R.UPDATED: now_ms}},
            return_document=_AFTER, session=self._session)
        return None if doc is None else _docs.run_from_doc(doc)

    def touch_run(self, run_id: str, now_ms: int) -> str | None:
        check_name("run id", run_id)
        doc = self._runs.find_one_and_update({R.ID: run_id}, {"$max": {R.UPDATED: now_ms}},
                                             projection={R.STATUS: 1}, return_document=_AFTER,
                                             session=self._session)
        return None if doc is None else str(doc[R.STATUS])

    def list_runs(self, *, workflow: str | None = None, status: str | None = None,
                  limit: int = 50, created_before_ms: int | None = None,
                  before_run_id: str | None = None, match: RunMatch | None = None
                  ) -> list[WorkflowRun]:
        check_listing(workflow, status, limit, RUN_STATUSES)
        wanted = check_run_match(match)  # plain values only: never an operator
        # Every run has one of RUN_STATUSES: naming them all when no status is asked for
        # lets a (status, created_ms, run_id) index serve the sort (one sorted scan per
        # status, merged) instead of a scan sorted in memory.
        query: Doc = {R.STATUS: status if status is not None else {"$in": list(RUN_STATUSES)},
                      **wanted}
        if workflow is not None:
            query[R.WORKFLOW] = workflow
        if created_before_ms is not None:
            # Page on (created, id), the sort order: runs of the same millisecond are kept.
            # The outer bound keeps the scan inside the page; the $or settles the tie.
            before_ms = int(created_before_ms)
            if before_run_id is None:
                query[R.CREATED] = {"$lt": before_ms}
            else:
                query[R.CREATED] = {"$lte": before_ms}
                query["$or"] = [{R.CREATED: {"$lt": before_ms}},
                                {R.RUN: {"$lt": check_name("run id", before_run_id)}}]
        cursor = self._runs.find(query, session=self._session).sort(
            [(R.CREATED, DESCENDING), (R.RUN, DESCENDING)])
        return [_docs.run_from_doc(d) for d in cursor.limit(limit)]

    # --- steps ------------------------------------------------------------------------

    def insert_step(self, step: NewStep, now_ms: int) -> tuple[StepState, bool]:
        check_name("run id", step.run_id)
        check_name("step name", step.step_name)
        check_value(f"data of step {step.step_name!r}", step.data)
        if self._runs.find_one({R.ID: step.run_id}, {R.ID: 1}, session=self._session) is None:
            raise InvalidInputError(f"cannot add step {step.step_name!r}: no run "
                                    f"{step.run_id!r}")
        doc = _docs.new_step_doc(step, now_ms)
        try:
            with _storable(f"data of step {step.step_name!r}"):
                self._steps.insert_one(doc, session=self._session)
            return _docs.step_from_doc(doc), True
        except DuplicateKeyError:
            existing = self._steps.find_one({S.ID: doc[S.ID]}, session=self._session)
            if existing is None:  # pragma: no cover - purged between the two calls
                raise
            return _docs.step_from_doc(existing), False

    def insert_steps(self, steps: Sequence[NewStep], now_ms: int, *, seq: int = 0
                     ) -> list[tuple[StepState, bool]]:
        for step in steps:
            check_name("run id", step.run_id)
            check_name("step name", step.step_name)
            check_value(f"data of step {step.step_name!r}", step.data)
        if not steps:
            return []
        if not self._indexes_ready:
            self.create_indexes()
        docs = [_docs.new_step_doc(step, now_ms, seq) for step in steps]
        taken: set[str] = set()
        try:
            with _storable("data of a step"):
                self._steps.insert_many(docs, ordered=False, session=self._session)
        except BulkWriteError as exc:
            errors = exc.details.get("writeErrors", [])
            if any(e.get("code") != DUPLICATE_KEY for e in errors):
                raise
            taken = {docs[e["index"]][S.ID] for e in errors}
        existing = {d[S.ID]: d for d in self._steps.find({S.ID: {"$in": sorted(taken)}},
                                                         session=self._session)
                    } if taken else {}
        return [(_docs.step_from_doc(existing[d[S.ID]]), False) if d[S.ID] in existing
                else (_docs.step_from_doc(d), True) for d in docs]

    def read_run(self, run_id: str, *, run: bool = True, input: bool = True,
                 all_steps: bool = False, step_names: Collection[str] = (),
                 recorded_after: int | None = None) -> RunRead:
        check_name("run id", run_id)
        wanted = _steps_filter(run_id, all_steps, step_names, recorded_after)
        if not run:
            found = [] if wanted is None else list(self._steps.find(wanted, session=self._session))
            return RunRead(None, [_docs.step_from_doc(d) for d in found])
        # The run and its steps in one command: the run's document, then the steps'.
        pipeline: list[Doc] = [{"$match": {R.ID: run_id}}]
        if not input:
            pipeline.append({"$project": {R.INPUT: 0}})
        if wanted is not None:
            pipeline.append({"$unionWith": {"coll": keys.STEPS,
                                            "pipeline": [{"$match": wanted}]}})
        docs = list(self._runs.aggregate(pipeline, session=self._session))
        head = docs[0] if docs and S.NAME not in docs[0] else None
        return RunRead(None if head is None else _docs.run_from_doc(head),
                       [_docs.step_from_doc(d) for d in docs[1 if head else 0:]])

    def get_step(self, run_id: str, step_name: str) -> StepState | None:
        doc = self._steps.find_one({S.ID: keys.invocation_id(run_id, step_name)},
                                   session=self._session)
        return None if doc is None else _docs.step_from_doc(doc)

    def list_steps(self, run_id: str) -> list[StepState]:
        check_name("run id", run_id)
        return [_docs.step_from_doc(d) for d in self._run_steps(run_id)]

    def claim_step(self, run_id: str, step_name: str, function: str | None, now_ms: int,
                   lease_ms: int, worker: str | None = None,
                   task_id: str | None = None) -> ClaimResult:
        step_id = keys.invocation_id(run_id, step_name)
        # Steady state: a fresh step is claimed by one write, with no read before it.
        claimed = self._steps.find_one_and_update(
            first_claim_filter(step_id, function, now_ms),
            {"$set": running_fields(now_ms, lease_ms, worker, task_id, attempt=1)},
            return_document=_AFTER, session=self._session)
        if claimed is not None:
            return self._unless_run_ended(claimed, now_ms)
        doc = self._steps.find_one({S.ID: step_id}, session=self._session)
        if doc is None:
            raise WorkflowStepNotFoundError(run_id, step_name)
        decision = decide_claim(doc, function, now_ms)
        guard = guard_for(decision, step_id, now_ms)
        if decision.action is Action.NONE:
            return ClaimResult(None)
        if decision.action is Action.EXPIRE:
            return self._expire(guard, doc, now_ms)
        attempt = doc[S.ATTEMPT] + (1 if decision.action is Action.RECLAIM else 0)
        fields = running_fields(now_ms, lease_ms, worker, task_id, attempt=attempt)
        if decision.action is Action.RECLAIM and doc[S.STATUS] == STEP_RUNNING:
            fields.update(_docs.superseded_fields(doc))  # the attempt this write fences out
        update: Doc = {"$set": fields}
        if decision.action is Action.RECLAIM:
            update["$inc"] = {S.ATTEMPT: 1}
        claimed = self._steps.find_one_and_update(guard, update, return_document=_AFTER,
                                                  session=self._session)
        if claimed is None:
            return ClaimResult(None)  # lost the race to another claimer
        return self._unless_run_ended(claimed, now_ms)

    def _unless_run_ended(self, claimed: Doc, now_ms: int) -> ClaimResult:
        """The claim's half of the Dekker pair with a run's end (``store._ended``): read the
        run *after* the claim's write; when it has ended, fence the attempt just started
        (guarded on it: a fence by the ender that landed first is kept) and claim nothing.
        One point read by ``_id`` per claim that won; a lost claim reads nothing."""
        run = self._runs.find_one({R.ID: claimed[S.RUN]}, {R.STATUS: 1, R.ERROR: 1},
                                  session=self._session)
        if run is None or run[R.STATUS] not in RUN_TERMINAL:
            return ClaimResult(_docs.step_from_doc(claimed))
        attempt = claimed[S.ATTEMPT]
        error = _ended.ended_error(claimed[S.RUN], run[R.STATUS], run.get(R.ERROR))
        self._steps.update_one(
            {S.ID: claimed[S.ID], S.ATTEMPT: attempt, S.STATUS: STEP_RUNNING},
            {"$set": _ended.fence_fields(attempt, error, now_ms, running=True)},
            session=self._session)
        return ClaimResult(None)

    def set_result(self, run_id: str, step_name: str, attempt: int, result: Any,
                   now_ms: int) -> StepState:
        check_value(f"result of step {step_name!r}", result)
        state = self._settle(run_id, step_name, attempt, {
            S.STATUS: STEP_SUCCEEDED, S.RESULT: result, S.ERROR: None, S.LEASE: None,
            S.DUE: None, S.UPDATED: now_ms,
            **_docs.closing_fields(attempt, STEP_SUCCEEDED, now_ms)})
        assert state is not None  # _settle raises when it must match and does not
        return state

    def set_error(self, run_id: str, step_name: str, attempt: int, error: dict[str, Any],
                  now_ms: int, *, retry_at_ms: int | None = None,
                  final: bool = False) -> StepState:
        check_value(f"error of step {step_name!r}", error)
        fields: Doc = {S.STATUS: STEP_FAILED, S.ERROR: error, S.RESULT: None, S.LEASE: None,
                       S.DUE: retry_at_ms or now_ms, S.UPDATED: now_ms,
                       **_docs.closing_fields(attempt, STEP_FAILED, now_ms, error)}
        # With attempts left the next one is due at retry_at_ms; with none left the step is
        # failed for good and never due again. Try the common case first.
        state = None if final else self._settle(
            run_id, step_name, attempt, fields, extra_guard={S.MAX_ATTEMPTS: {"$gt": attempt}},
            must_match=False)
        if state is None:
            fields[S.DUE] = None
            state = self._settle(run_id, step_name, attempt, fields)
        assert state is not None  # _settle raises when it must match and does not
        return state

    def renew_leases(self, held: Sequence[tuple[str, str, int]], now_ms: int,
                     lease_ms: int) -> set[tuple[str, str]]:
        if not held:
            return set()
        ids = {keys.invocation_id(run, name): (run, name, attempt) for run, name, attempt in held}
        by_attempt: dict[int, list[str]] = {}
        for step_id, (_, _, attempt) in ids.items():
            by_attempt.setdefault(attempt, []).append(step_id)
        # One write per distinct attempt number (almost always one or two), fenced by it.
        matched = 0
        for attempt, step_ids in by_attempt.items():
            matched += self._steps.update_many(
                {S.ID: {"$in": step_ids}, S.ATTEMPT: attempt, S.STATUS: STEP_RUNNING,
                 S.LEASE: {"$ne": None}},
                {"$set": {S.LEASE: now_ms + lease_ms}}, session=self._session).matched_count
        if matched == len(ids):
            return set()
        # Rare path: find out which renewals were refused.
        live = {d[S.ID] for d in self._steps.find(
            {S.ID: {"$in": list(ids)}, S.STATUS: STEP_RUNNING, S.LEASE: {"$ne": None}},
            {S.ID: 1, S.ATTEMPT: 1}, session=self._session) if d[S.ATTEMPT] == ids[d[S.ID]][2]}
        return {(run, name) for sid, (run, name, _) in ids.items() if sid not in live}

    def release_lease(self, run_id: str, step_name: str, attempt: int) -> bool:
        found = self._steps.update_one(
            {S.ID: keys.invocation_id(run_id, step_name), S.ATTEMPT: attempt,
             S.STATUS: STEP_RUNNING},
            {"$set": {S.LEASE: None}}, session=self._session)
        return found.matched_count == 1

    def settle_waiting_step(self, run_id: str, step_name: str, now_ms: int, *,
                            result: Any = None, error: dict[str, Any] | None = None,
                            child_run_id: str | None = None, gate: bool = False,
                            by: str | None = None, wake_check_ms: int | None = None) -> bool:
        check_value(f"result of step {step_name!r}", result)
        guard: Doc = {S.ID: keys.invocation_id(run_id, step_name)}
        status = STEP_FAILED if error is not None else STEP_SUCCEEDED
        fields: Doc = {S.STATUS: status, S.RESULT: result, S.ERROR: error, S.LEASE: None,
                       S.DUE: wake_check_ms, S.UPDATED: now_ms}
        if child_run_id is not None:
            # Parked on the child since its insert, which opened its one attempt.
            guard.update({S.STATUS: STEP_RUNNING, S.CHILD_RUN: child_run_id})
            fields.update(_docs.closing_fields(1, status, now_ms, error))
        else:
            # A sleep or a gate: its one attempt starts and ends with this write.
            guard.update({S.STATUS: STEP_SCHEDULED, S.FUNCTION: None})
            fields[S.WORKER] = by
            fields[_docs.entry_path(1)] = {**_docs.open_entry(now_ms, by, None),
                                           H.STATUS: status, H.ERROR: error, H.ENDED: now_ms}
            if gate:
                # Never due by itself, or an approval not yet expired: "due None, or later
                # than now" as two guarded writes, not one filter with an $or (no write
                # filter has one: the wire stand-in applies an $or write filter to the
                # whole collection). A gate's due time is fixed while it waits, so at most
                # one of the two can match; a gate without expiry takes one write.
                return any(self._steps.update_one({**guard, S.DUE: due},
                                                  {"$set": fields},
                                                  session=self._session).matched_count == 1
                           for due in (None, {"$ne": None, "$gt": now_ms}))
            guard[S.DUE] = {"$ne": None, "$lte": now_ms}
        found = self._steps.update_one(guard, {"$set": fields}, session=self._session)
        return found.matched_count == 1

    def clear_wake_check(self, run_id: str, step_name: str, due_ms: int) -> bool:
        found = self._steps.update_one(
            {S.ID: keys.invocation_id(run_id, step_name), S.STATUS: STEP_SUCCEEDED,
             S.DUE: due_ms}, {"$set": {S.DUE: None}}, session=self._session)
        return found.matched_count == 1

    def cancel_steps(self, run_id: str, error: dict[str, Any], now_ms: int) -> int:
        check_name("run id", run_id)
        fenced = 0
        # Only what the guard repeats (a projection built per call: drivers may keep it).
        read = {S.ATTEMPT: 1, S.STATUS: 1, S.DUE: 1}
        for doc in self._steps.find({S.RUN: run_id, **_UNSETTLED}, read, session=self._session):
            # Each step is fenced by a write that repeats what was read (attempt, status,
            # due): one that settled since the read keeps its outcome and its history entry.
            # An attempt in flight ends here, its entry closed by the same write; a failed
            # one waiting for its retry keeps its own entry. Cancels are rare and runs have
            # few unsettled steps: one write each is cheap.
            # A step claimed between the read and its write is not matched here: its claim
            # reads the run after its own write and fences itself (``_unless_run_ended``).
            guard: Doc = {S.ID: doc[S.ID], S.ATTEMPT: doc[S.ATTEMPT], S.STATUS: doc[S.STATUS],
                          S.DUE: doc.get(S.DUE)}
            fields = _ended.fence_fields(doc[S.ATTEMPT], error, now_ms,
                                         running=doc[S.STATUS] == STEP_RUNNING)
            fenced += self._steps.update_one(guard, {"$set": fields},
                                             session=self._session).matched_count
        return fenced

    # --- history ----------------------------------------------------------------------

    def get_history(self, run_id: str) -> list[StepAttempt]:
        check_name("run id", run_id)
        steps = self._run_steps(run_id)
        # Entries live in the step documents; a step written by an earlier version kept
        # them in the history collection, read only when such a step is there.
        legacy = (list(self._history.find({H.RUN: run_id}, session=self._session))
                  if any(S.ATTEMPTS not in d for d in steps) else None)
        return _docs.merge_history(steps, legacy)

    # --- versions ---------------------------------------------------------------------

    def record_version(self, workflow: str, version: str, source: str, now_ms: int) -> bool:
        try:
            self._versions.insert_one({V.ID: f"{workflow}:{version}", V.WORKFLOW: workflow,
                                       V.VERSION: version, V.SOURCE: source,
                                       V.CREATED: now_ms}, session=self._session)
            return True
        except DuplicateKeyError:
            return False

    def get_version(self, workflow: str, version: str) -> dict[str, Any] | None:
        doc = self._versions.find_one({V.ID: f"{workflow}:{version}"}, session=self._session)
        return None if doc is None else {k: v for k, v in doc.items() if k != V.ID}

    # --- sweeps -----------------------------------------------------------------------

    def find_lapsed_steps(self, now_ms: int, limit: int,
                          after: tuple[int, str] | None = None) -> list[StepState]:
        # (status, lease_expires_ms, _id) serves the range and the order: no sort in memory.
        query: Doc = {S.STATUS: STEP_RUNNING, S.LEASE: {"$ne": None, "$lt": now_ms}}
        query.update(_page_after(S.LEASE, after))
        cursor = self._steps.find(query, session=self._session).sort(
            [(S.LEASE, ASCENDING), (S.ID, ASCENDING)])
        return [_docs.step_from_doc(d) for d in cursor.limit(limit)]

    def find_due_steps(self, now_ms: int, dispatched_before_ms: int, limit: int,
                       after: tuple[int, str] | None = None) -> list[StepState]:
        # One query per branch, each read in order from its own index ((status, updated_ms,
        # _id) for undispatched steps, (status, due_ms, _id) for due ones, one sorted scan
        # per status merged by the server), then the two pages merged here: one query with
        # an $or had to sort the whole backlog in memory (no index orders both branches).
        undispatched = self._steps.find(
            {S.STATUS: STEP_PENDING, S.UPDATED: {"$lt": dispatched_before_ms},
             **_page_after(S.UPDATED, after)}, session=self._session
        ).sort([(S.UPDATED, ASCENDING), (S.ID, ASCENDING)]).limit(limit)
        due = self._steps.find(
            {S.STATUS: {"$in": [STEP_SCHEDULED, STEP_FAILED, STEP_SUCCEEDED]},
             S.DUE: {"$ne": None, "$lte": now_ms}, **_page_after(S.DUE, after)},
            session=self._session
        ).sort([(S.DUE, ASCENDING), (S.ID, ASCENDING)]).limit(limit)
        merged = heapq.merge([_docs.step_from_doc(d) for d in undispatched],
                             [_docs.step_from_doc(d) for d in due], key=due_sweep_key)
        return list(itertools.islice(merged, limit))

    def find_stalled_runs(self, idle_since_ms: int, limit: int) -> list[WorkflowRun]:
        cursor = self._runs.find({R.STATUS: RUN_RUNNING, R.UPDATED: {"$lt": idle_since_ms}},
                                 session=self._session)
        return [_docs.run_from_doc(d) for d in cursor.limit(limit)]

    def touch_runs(self, run_ids: Collection[str], now_ms: int) -> None:
        if run_ids:
            self._runs.update_many({R.ID: {"$in": list(run_ids)}},
                                   {"$max": {R.UPDATED: now_ms}}, session=self._session)

    def find_unsettled_steps(self, run_ids: Collection[str]) -> list[StepState]:
        if not run_ids:
            return []
        # Served by the (run_id, status, seq) index: a few keys per run, its unsettled
        # steps (and failed ones), not every step a long run has settled.
        found = self._steps.find({S.RUN: {"$in": list(run_ids)}, **_UNSETTLED},
                                 session=self._session)
        return [_docs.step_from_doc(d) for d in found]

    # --- retention and counts -----------------------------------------------------------

    def count_runs(self, *, status: str, workflow: str | None = None,
                   updated_before_ms: int | None = None, limit: int = 10_000,
                   match: RunMatch | None = None) -> int:
        _retention.check_count(status, workflow, updated_before_ms, limit)
        # Served by (workflow, status, ...), (status, created_ms, ...) or (status,
        # updated_ms): a count of index keys that stops at ``limit`` (with a ``match``,
        # of the documents it reads: index the fields it names).
        query: Doc = {R.STATUS: status, **check_run_match(match)}
        if workflow is not None:
            query[R.WORKFLOW] = workflow
        if updated_before_ms is not None:
            query[R.UPDATED] = {"$lt": updated_before_ms}
        return int(self._runs.count_documents(query, limit=limit, session=self._session))

    def purge_runs(self, ended_before_ms: int, *, statuses: Iterable[str] = RUN_TERMINAL,
                   limit: int = 500) -> list[str]:
        chosen = _retention.check_purge(ended_before_ms, statuses, limit)
        ended = {R.STATUS: {"$in": chosen}}
        # (status, updated_ms) serves the batch: the ended runs' keys before the cutoff.
        # A child its parent has not heard yet is kept (``_retention.parked_steps``), and
        # the batch read again past it, so a kept child never cuts a purge short: the
        # batch comes back short only when no run is left to purge. Rarely more than one
        # read (and one more of the batch's parked steps, only when it holds a child).
        unheard: set[str] = set()
        while True:
            found = list(self._runs.find({**ended, R.UPDATED: {"$lt": ended_before_ms}},
                                         {R.ID: 1, R.PARENT_RUN: 1, R.PARENT_STEP: 1},
                                         session=self._session
                                         ).limit(limit + len(unheard)))
            more = self._unheard_children([d for d in found if d[R.ID] not in unheard])
            unheard |= more
            if not more or len(found) < limit + len(unheard) - len(more):
                break
        ids = [d[R.ID] for d in found if d[R.ID] not in unheard][:limit]
        if not ids:
            return []
        self._steps.delete_many({S.RUN: {"$in": ids}}, session=self._session)
        self._history.delete_many({H.RUN: {"$in": ids}}, session=self._session)
        # The ended status again, in the delete itself: whatever was read, nothing live goes.
        self._runs.delete_many({R.ID: {"$in": ids}, **ended}, session=self._session)
        return ids

    # --- internals --------------------------------------------------------------------

    def _unheard_children(self, runs: list[Doc]) -> set[str]:
        """The child runs among ``runs`` whose parent's step still waits on them (the parent
        has not heard the outcome: ``_retention.unheard_children``); one read by ``_id``,
        none when the batch holds no child."""
        parked = _retention.parked_steps(runs)
        if not parked:
            return set()
        return {d[S.CHILD_RUN] for d in self._steps.find(
            {S.ID: {"$in": sorted(parked)}, S.STATUS: STEP_RUNNING},
            {S.CHILD_RUN: 1}, session=self._session) if parked.get(d[S.ID]) == d.get(S.CHILD_RUN)}

    def _run_steps(self, run_id: str) -> list[Doc]:
        return list(self._steps.find({S.RUN: run_id},
                                     session=self._session).sort([(S.CREATED, ASCENDING),
                                                            (S.NAME, ASCENDING)]))

    def _settle(self, run_id: str, step_name: str, attempt: int, fields: Doc, *,
                extra_guard: Doc | None = None, must_match: bool = True) -> StepState | None:
        step_id = keys.invocation_id(run_id, step_name)
        guard: Doc = {S.ID: step_id, S.ATTEMPT: attempt, S.STATUS: STEP_RUNNING,
                      **(extra_guard or {})}
        with _storable(f"outcome of step {step_name!r}"):
            doc = self._steps.find_one_and_update(guard, {"$set": fields},
                                                  return_document=_AFTER, session=self._session)
        if doc is None and not must_match:
            return None
        if doc is None:
            current = self._steps.find_one({S.ID: step_id}, {S.ATTEMPT: 1}, session=self._session)
            raise WorkflowStepSupersededError(run_id, step_name, attempt,
                                              None if current is None else current[S.ATTEMPT])
        return _docs.step_from_doc(doc)

    def _expire(self, guard: Doc, doc: Doc, now_ms: int) -> ClaimResult:
        error = _docs.lease_expired_error(doc)
        found = self._steps.update_one(guard, {"$set": {
            S.STATUS: STEP_FAILED, S.LEASE: None, S.DUE: None, S.RESULT: None, S.ERROR: error,
            S.UPDATED: now_ms, **_docs.closing_fields(doc[S.ATTEMPT], STEP_FAILED, now_ms,
                                                      error)}}, session=self._session)
        if found.matched_count == 0:
            return ClaimResult(None)  # renewed (or claimed) since we read it
        return ClaimResult(None, wake_run=True)


# Every index, by collection (see the schema above); ``create_indexes`` makes them and
# ``check_indexes`` reports the missing ones.
_NEWEST_FIRST = [(R.CREATED, DESCENDING), (R.RUN, DESCENDING)]
INDEXES: dict[str, list[list[tuple[str, int]]]] = {
    keys.RUNS: [[(R.STATUS, ASCENDING), (R.UPDATED, ASCENDING)],
                [(R.STATUS, ASCENDING), *_NEWEST_FIRST],
                [(R.WORKFLOW, ASCENDING), (R.STATUS, ASCENDING), *_NEWEST_FIRST]],
    keys.STEPS: [[(S.RUN, ASCENDING), (S.CREATED, ASCENDING), (S.NAME, ASCENDING)],
                 [(S.RUN, ASCENDING), (S.STATUS, ASCENDING), (S.SEQ, ASCENDING)],
                 *([(S.STATUS, ASCENDING), (field, ASCENDING), (S.ID, ASCENDING)]
                   for field in (S.LEASE, S.UPDATED, S.DUE))],
    keys.HISTORY: [[(H.RUN, ASCENDING)]],
}


DUPLICATE_KEY = 11000


def _steps_filter(run_id: str, all_steps: bool, step_names: Collection[str],
                  recorded_after: int | None) -> Doc | None:
    """The steps ``read_run`` asks for (``None``: none). Each clause is served by an index:
    ``_id`` for named steps, ``(run_id, status, seq)`` for those recorded since a token
    (every status named: one range of ``seq`` per status)."""
    if all_steps:
        return {S.RUN: run_id}
    clauses: list[Doc] = []
    if step_names:
        ids = sorted(keys.invocation_id(run_id, name) for name in step_names)
        clauses.append({S.ID: {"$in": ids}})
    if recorded_after is not None:
        clauses.append({S.RUN: run_id, S.STATUS: {"$in": list(STEP_STATUSES)},
                        S.SEQ: {"$gt": recorded_after}})
    if not clauses:
        return None
    return clauses[0] if len(clauses) == 1 else {"$or": clauses}


def _page_after(field: str, after: tuple[int, str] | None) -> Doc:
    """The filter of a page that starts after ``(field value, _id)`` in that sort order."""
    if after is None:
        return {}
    value, step_id = after
    return {"$or": [{field: {"$gt": value}}, {field: value, S.ID: {"$gt": step_id}}]}


DEFAULT_SERVER_SELECTION_TIMEOUT_S = 5.0

P = ParamSpec("P")
T = TypeVar("T")


class MongoUnreachableError(ServerSelectionTimeoutError):
    """No MongoDB server answered within the server-selection timeout.

    The message names the server and the setting. Deliberately a pymongo error (code catching
    ``ServerSelectionTimeoutError`` or ``ConnectionFailure`` keeps working), not a
    ``PikkuError``: the engine treats a ``PikkuError`` raised during a pass as the
    workflow's own failure and fails the run, while an outage only interrupts the pass, to be
    retried."""


def describe_database(db: Any) -> str:
    """Where ``db`` lives, from the client's seed list (which holds no credentials)."""
    try:
        hosts = ",".join(f"{host}:{port}" for host, port in
                         db.client.topology_description.server_descriptions())
    except Exception:  # a client without a topology (mongomock)
        return f"MongoDB database {db.name!r}"
    return f"MongoDB at mongodb://{hosts}/{db.name}"


def _unreachable(db: Any, exc: ServerSelectionTimeoutError) -> MongoUnreachableError:
    # pymongo's message is the reason, then the timeout and a long topology dump.
    reason = re.sub(r" \(configured timeouts:[^)]*\)", "", str(exc).split(", Timeout:")[0])
    try:
        timeout = f"{db.client.options.server_selection_timeout:g} s"
    except Exception:  # pragma: no cover - every pymongo client has options
        timeout = "the server-selection timeout"
    return MongoUnreachableError(
        f"{describe_database(db)} is unreachable: no server answered within {timeout} "
        f"(server_selection_timeout): {reason[:300]}")


class _CausalClock(threading.local):
    """Per thread and store: the newest cluster and operation times the thread's calls
    saw, and the session of its call in progress (``MongoWorkflowStore._causally``).
    Plain values, so a forked worker's copy is harmless."""

    session: ClientSession | None = None
    cluster_time: Mapping[str, Any] | None = None
    operation_time: Timestamp | None = None


def _public(method: Callable[P, T]) -> Callable[P, T]:
    """A public store method: run in this thread's causal session, and an unreachable
    server reported by name, whichever call (a start, a read of the web API, a worker's
    sweep) met it first."""
    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        store: Any = args[0]
        try:
            try:
                with store._causally():
                    return method(*args, **kwargs)
            except (ConfigurationError, NotImplementedError) as exc:
                if not store._sessions or not _no_sessions(exc):
                    raise
                # A deployment without sessions (a standalone server too old, an emulator)
                # refuses the session before its first command is sent: nothing was
                # written, so the call runs again without one, as every later call will.
                store._sessions = False
                return method(*args, **kwargs)
        except MongoUnreachableError:
            raise
        except ServerSelectionTimeoutError as exc:
            raise _unreachable(store.db, exc) from exc
    return call


def _no_sessions(exc: Exception) -> bool:
    return ("Sessions are not supported" in str(exc)
            or "does not support sessions" in str(exc))


for _name, _method in list(vars(MongoWorkflowStore).items()):
    if inspect.isfunction(_method) and not _name.startswith("_"):
        setattr(MongoWorkflowStore, _name, _public(_method))


# Server errors that no retry can fix: the write itself is impossible.
#   2 BadValue, 10334 BSONObjectTooLarge, 17419 resulting document after update is larger
#   than 16 MiB, 17280 key too large to index, 121 DocumentValidationFailure,
#   15 Overflow, 17420 document too large after update (older servers).
PERMANENT_WRITE_CODES = frozenset({2, 15, 121, 10334, 17280, 17419, 17420})


@contextlib.contextmanager
def _storable(what: str) -> Iterator[None]:
    """A write MongoDB can never accept is reported as bad input, so callers fail at once
    instead of retrying it. BSON can be larger than the JSON the input checks measure
    (array indexes are keys): a document pymongo cannot encode is refused client-side,
    before anything is sent; one the server refuses (an update whose *result* passes
    16 MiB, a validation rule) is refused by error code."""
    try:
        yield
    except (DocumentTooLarge, InvalidDocument) as exc:
        raise InvalidInputError(f"{what} cannot be stored in MongoDB: {exc}") from exc
    except OperationFailure as exc:
        if exc.code not in PERMANENT_WRITE_CODES:
            raise
        raise InvalidInputError(f"{what} cannot be stored in MongoDB (error {exc.code}): "
                                f"{exc}") from exc
