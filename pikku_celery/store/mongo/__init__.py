"""The MongoDB store (pymongo): ``MongoWorkflowStore``, one class over the concerns of the
modules beside this one.

Schema (names live in ``pikku_celery.model.keys``; times are int epoch ms on the lease clock):

``workflow_runs``   ``_id`` run id, ``run_id`` (the same id again: see below), ``workflow``,
                    ``status``, ``input``, ``output``, ``error``, ``version``,
                    ``parent_run_id``, ``parent_step_name``, ``cancel_reason``,
                    ``created_ms``, ``updated_ms``; a fork's ``forked_from`` (its source
                    run); ``lineage`` (its forks and retries: ``[{op, at, by, from_step,
                    run_id}]``); ``trace`` (the W3C ``traceparent``/``tracestate`` of
                    whoever created the run, when tracing was on).
                    Indexes: ``(status, updated_ms)`` for the stalled sweep and purges;
                    ``(forked_from, created_ms, run_id)`` for a run's forks;
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
``workflow_events``  ``_id`` (derived from the run and the sender's key, or the run and the
                    sending call's id: ``keys.keyed_event_id``, ``keys.sent_event_id``),
                    ``run_id``, ``name``, ``seq`` (the run's ``events_sent`` counter when it
                    was kept; null until then: the run's ``event_pending`` names the event
                    given the latest, ``store.mongo.events``), ``send_id``,
                    ``payload``, ``key``, ``sent_ms``, ``wake_ms`` (when the reaper wakes the
                    run should the sender stop before it did; null once it has). Indexes:
                    ``(run_id, name, seq)`` for the next event a wait takes, ``(run_id, seq)``
                    for a run's events in order, ``(wake_ms, _id)`` for the wake sweep.
                    Deleted with their run.
``workflow_schedules``  ``_id`` the schedule's name, ``workflow``, ``cron``, ``every_ms``,
                    ``tz``, ``data``, ``catch_up``, ``paused``, ``next_ms`` (the next tick not
                    yet started), ``last_ms`` (the latest tick fired), ``created_ms``,
                    ``updated_ms`` (``store._schedules``). Read and written by ``_id`` only:
                    no index of its own. Runs a tick started carry ``schedule`` and
                    ``scheduled_ms``.

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

Modules (one concern each, every one a class on ``base.MongoStoreBase``, combined below):
``base`` the collections, the causal session of each call (``_causally``) and the indexes;
``runs`` create, read, transition, run state, the end's fence (``cancel_steps``), versions;
``steps`` insert, settle, leases, history; ``claims`` claims, and the settles that travel
with a pass's next write; ``gates`` waiting steps and wake checks;
``events`` events sent to runs; ``transactions`` a transactional step's transaction;
``retention`` counts and purges; ``listing`` ``list_runs``
and the reaper's sweeps;
``session`` the wrapper every public method runs in; ``errors`` how refusals are named.
The decisions both stores must agree on are shared with the in-memory store:
``store._decide`` (claims), ``store._settle`` (settles), ``store._ended`` (a run's end),
``store._retention`` (purges), ``store._checks`` (argument checks), ``store._events``
(events).
"""

from __future__ import annotations

import inspect
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from pymongo import MongoClient

from pikku_celery.model import keys
from pikku_celery.model.durations import Duration, to_seconds
from pikku_celery.store import _concerns
from pikku_celery.store._concerns import ReadConcernLike, WriteConcernLike
from pikku_celery.store.mongo.base import INDEXES, Doc
from pikku_celery.store.mongo.claims import MongoClaims
from pikku_celery.store.mongo.errors import (
    DUPLICATE_KEY,
    PERMANENT_WRITE_CODES,
    MongoUnreachableError,
    describe_database,
)
from pikku_celery.store.mongo.events import MongoEvents
from pikku_celery.store.mongo.gates import MongoGates
from pikku_celery.store.mongo.listing import MongoListing
from pikku_celery.store.mongo.retention import MongoRetention
from pikku_celery.store.mongo.runs import MongoRuns
from pikku_celery.store.mongo.schedules import MongoSchedules
from pikku_celery.store.mongo.session import public as _public
from pikku_celery.store.mongo.slots import MongoSlots
from pikku_celery.store.mongo.steps import MongoSteps
from pikku_celery.store.mongo.transactions import MongoTransactions

__all__ = ["DEFAULT_SERVER_SELECTION_TIMEOUT_S", "DUPLICATE_KEY", "INDEXES",
           "PERMANENT_WRITE_CODES", "MongoUnreachableError", "MongoWorkflowStore",
           "describe_database"]

DEFAULT_SERVER_SELECTION_TIMEOUT_S = 5.0


class MongoWorkflowStore(MongoRuns, MongoSteps, MongoClaims, MongoGates, MongoEvents,
                         MongoSchedules, MongoSlots, MongoRetention, MongoListing,
                         MongoTransactions):
    """A ``WorkflowStore`` on a pymongo ``Database``; safe from any number of processes."""

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



# Every public method, whichever concern defines it, runs in this thread's causal session
# and names an unreachable server (``session.public``); set on the combined class, so
# ``vars(MongoWorkflowStore)`` lists the whole public surface.
def _wrap_public(cls: type[Any]) -> None:
    for name in dir(cls):
        member = inspect.getattr_static(cls, name)
        if inspect.isfunction(member) and not name.startswith("_"):
            setattr(cls, name, _public(member))


_wrap_public(MongoWorkflowStore)
