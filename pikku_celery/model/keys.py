"""Every Redis key and every MongoDB collection and field name the library writes.

Kept in one module so a schema change is one diff, and so tests and operators can find
what to inspect. Redis keys here are *logical*: the lease service adds its ``key_prefix``
(default ``pikku``) in front of each, so two apps on one Redis never collide.
"""

from __future__ import annotations

import functools
import re
import uuid
from datetime import datetime, timezone

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

# --- Ids derived from a run id and a name ------------------------------------------------

# Fixed namespaces: derived ids must be the same on every machine and across versions.
INVOCATION_NAMESPACE = uuid.UUID("70696b6b-7500-5770-9f6c-6f77000a0001")
CHILD_NAMESPACE = uuid.UUID("70696b6b-7500-5770-9f6c-6f77000a0002")
_FRAMED_INVOCATION_NAMESPACE = uuid.UUID("70696b6b-7500-5770-9f6c-6f77000a0003")
_FRAMED_CHILD_NAMESPACE = uuid.UUID("70696b6b-7500-5770-9f6c-6f77000a0004")
EVENT_KEY_NAMESPACE = uuid.UUID("70696b6b-7500-5770-9f6c-6f77000a0005")
_FRAMED_EVENT_KEY_NAMESPACE = uuid.UUID("70696b6b-7500-5770-9f6c-6f77000a0006")


@functools.lru_cache(maxsize=4096)
def _derived(plain: uuid.UUID, framed: uuid.UUID, run_id: str, name: str) -> str:
    """An id for ``(run_id, name)`` that no other pair can produce.

    ``f"{run_id}:{name}"`` alone is ambiguous once a caller-chosen run id contains ``:``
    (``("a:b", "c")`` and ``("a", "b:c")`` would share a step, its result and its child
    run). A run id without ``:`` splits at the first ``:`` unambiguously, and keeps the id
    it always had, so stored runs stay readable; a run id with ``:`` is length-framed under
    another namespace, a space the plain ids can only reach through a SHA-1 collision.

    Cached: a pass derives the id of every step it replays and records, and a SHA-1 per
    call was 2 % of a sent step's Python; the ids of the runs a process is advancing now
    are what it asks for again.
    """
    if ":" not in run_id:
        return str(uuid.uuid5(plain, f"{run_id}:{name}"))
    return str(uuid.uuid5(framed, f"{len(run_id)}:{run_id}:{name}"))


def invocation_id(run_id: str, step_name: str) -> str:
    """The step's id and idempotency key: stable across attempts, stores and machines."""
    return _derived(INVOCATION_NAMESPACE, _FRAMED_INVOCATION_NAMESPACE, run_id, step_name)


def keyed_event_id(run_id: str, key: str) -> str:
    """The ``_id`` of an event sent with an idempotency ``key``: a retried send of the same
    key to the same run lands on the same document, so it is delivered once."""
    return _derived(EVENT_KEY_NAMESPACE, _FRAMED_EVENT_KEY_NAMESPACE, run_id, f"k:{key}")


def sent_event_id(run_id: str, send_id: str) -> str:
    """The ``_id`` of an event sent without a key: its run and the id of the one
    ``send_event`` call that sends it, so the call's retries of its writes (through a
    primary election, say) land on one document: one event per call (issue 31). Derived
    from ``s:<send id>``; a keyed id from ``k:<key>``, and the events earlier versions
    kept without a key from ``#<seq>``: the three never meet."""
    return _derived(EVENT_KEY_NAMESPACE, _FRAMED_EVENT_KEY_NAMESPACE, run_id, f"s:{send_id}")


RUN_END_MARK_PREFIX = "$end:"


def run_end_mark_id(run_id: str) -> str:
    """The ``_id`` of the mark a run's end leaves among the steps, before the run's own
    write (``store._ended``): never a step's (those are UUIDs), in no run's listing (it
    names no run), and found by ``_id`` in the write that inserts a step run in place."""
    return RUN_END_MARK_PREFIX + run_id


#: The first character of every run id pikku derives (a child run's) and of no run id a
#: caller may choose: ``start`` refuses it (``validate.check_run_id``), so no caller can
#: create a run under the id a parent's child will take.
DERIVED_RUN_ID_PREFIX = "@"


def child_run_id(parent_run_id: str, step_name: str) -> str:
    """The run id of the child workflow started by step ``step_name`` of a parent run:
    ``@`` and a UUID derived from the parent's run id and the step's name. Callers cannot
    start a run under it (see ``DERIVED_RUN_ID_PREFIX``)."""
    return DERIVED_RUN_ID_PREFIX + legacy_child_run_id(parent_run_id, step_name)


def legacy_child_run_id(parent_run_id: str, step_name: str) -> str:
    """The child run id versions before issue 22 derived (the UUID alone, which a caller
    could take first). Nothing derives it any more: a parent step that recorded one keeps
    it (the step holds its child's id), so a run in flight across the upgrade still finds
    its child."""
    return _derived(CHILD_NAMESPACE, _FRAMED_CHILD_NAMESPACE, parent_run_id, step_name)


#: What a schedule's name may hold: it is part of the run id of each of its ticks.
SCHEDULE_NAME_CHARS = "ASCII letters, digits, '_', '.' and '-'"
_SCHEDULE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}")
_SCHEDULED_RUN_ID = re.compile(
    r"@([A-Za-z0-9_.\-]{1,100})@(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z")


def is_schedule_name(name: object) -> bool:
    return isinstance(name, str) and _SCHEDULE_NAME.fullmatch(name) is not None


def scheduled_run_id(schedule: str, tick_ms: int) -> str:
    """The run id of the run a schedule's tick starts: ``@<schedule>@<tick, ISO 8601 UTC
    with milliseconds>``, e.g. ``@nightly-report@2026-12-03T02:00:00.000Z``.

    The tick decides it, so every worker that fires the tick, and a worker that fires it
    again after a crash, creates the same run (``create_run`` is idempotent by id): one
    run per tick. It starts with ``DERIVED_RUN_ID_PREFIX``, so no caller can take it first,
    and it is readable in ``pikku runs``. A schedule name holds none of ``@`` or ``:``
    (``is_schedule_name``), so the id splits one way only, and no child run id (``@`` and
    a UUID) has this form."""
    when = datetime.fromtimestamp(tick_ms / 1000, tz=UTC)
    return (f"{DERIVED_RUN_ID_PREFIX}{schedule}@{when:%Y-%m-%dT%H:%M:%S}."
            f"{tick_ms % 1000:03d}Z")


def scheduled_tick(run_id: str) -> tuple[str, int] | None:
    """The schedule and tick (epoch ms) a run id was derived from (``scheduled_run_id``);
    ``None`` for any other run id."""
    found = _SCHEDULED_RUN_ID.fullmatch(run_id)
    if found is None:
        return None
    when = datetime.strptime(found.group(2), "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=UTC)
    return found.group(1), round(when.timestamp() * 1000)


def scheduled_for(run_id: str) -> datetime | None:
    """The tick a run id was derived from, an aware UTC datetime (``wf.scheduled_for``)."""
    tick = scheduled_tick(run_id)
    return None if tick is None else datetime.fromtimestamp(tick[1] / 1000, tz=UTC)


# --- Redis (logical keys; RedisLeaseService prefixes them) ---------------------------


def run_lease_key(run_id: str) -> str:
    """The run lease: one orchestrator advances a run at a time (contract invariant 7)."""
    return f"workflow-run:{run_id}"


def step_lease_key(run_id: str, step_name: str) -> str:
    """The step lease held by the worker running the step body. It ends with the step's
    fixed-length invocation id, never the raw step name, so no two steps of any two runs can
    share it however their run ids and names are spelled (``workflow-step:a:b:c`` would)."""
    return f"workflow-step:{run_id}:{invocation_id(run_id, step_name)}"


REAPER_LEASE_KEY = "workflow-reaper"

# Physical Redis layout of one lease (see pikku_celery/leases/redis.py):
#   <prefix>:lease:{<logical key>}        hash {holder, token} with a PEXPIRE
#   <prefix>:lease-token:{<logical key>}  integer counter, never deleted; expires after a
#                                         month (at least) without a grant or renewal
#   <prefix>:lease-marks:{<logical key>}  set of marks left for the holder (run leases)
#   <prefix>:lease-watch:{<logical key>}  flag: a watch is armed for the current holder
LEASE_HASH_FMT = "{prefix}:lease:{{{key}}}"
LEASE_TOKEN_FMT = "{prefix}:lease-token:{{{key}}}"
LEASE_MARKS_FMT = "{prefix}:lease-marks:{{{key}}}"
LEASE_WATCH_FMT = "{prefix}:lease-watch:{{{key}}}"
# The pub/sub channel of a key's announcements (``LeaseService.announce``): not a key.
LEASE_DONE_FMT = "{prefix}:lease-done:{{{key}}}"
# What a holder that released the key left for the next grant (``release_or_take_marks``'s
# ``note``): taken by that grant, else gone after ``LEASE_NOTE_TTL_MS``.
LEASE_NOTE_FMT = "{prefix}:lease-note:{{{key}}}"
LEASE_NOTE_TTL_MS = 60_000

# --- MongoDB collections ---------------------------------------------------------------

RUNS = "workflow_runs"
STEPS = "workflow_steps"
HISTORY = "workflow_step_history"  # written by earlier versions only, read for their runs
VERSIONS = "workflow_versions"
EVENTS = "workflow_events"
SCHEDULES = "workflow_schedules"
SLOTS = "workflow_slots"  # concurrency slot groups (``store._slots``)
RESULTS = "celery_task_results"
DEFAULT_DATABASE = "pikku"


class RunField:
    """Fields of a ``workflow_runs`` document (``_id`` is the run id)."""

    ID = "_id"
    RUN = "run_id"  # a copy of _id, the listing's tie-break: indexable beside other fields
    WORKFLOW = "workflow"
    STATUS = "status"
    INPUT = "input"
    OUTPUT = "output"
    ERROR = "error"
    VERSION = "version"
    PARENT_RUN = "parent_run_id"
    PARENT_STEP = "parent_step_name"
    CANCEL_REASON = "cancel_reason"
    CREATED = "created_ms"
    UPDATED = "updated_ms"
    STATE = "state"  # the run state map (graph nodes' shared values)
    STATE_VERSION = "state_version"  # how many writes the state map has had
    STATE_WRITERS = "state_writers"  # who made each write, in order: write N is [N - 1]
    EVENTS_SENT = "events_sent"  # how many events were sent to the run: the last ``seq``
    # The ``_id`` of the event given the last ``seq`` (whose own document may not carry it
    # yet): written with the counter, in one guarded write (``store.mongo.events``).
    EVENT_PENDING = "event_pending"
    SCHEDULE = "schedule"  # the schedule whose tick started the run (absent otherwise)
    SCHEDULED = "scheduled_ms"  # that tick
    SLOT = "slot"  # its concurrency slot group (absent for a workflow without a limit)
    FORKED_FROM = "forked_from"  # the run a fork copied it from (absent otherwise)
    LINEAGE = "lineage"  # its forks and retries: [{op, at, by, from_step, run_id}, ...]
    REOPEN = "reopen_on_admit"  # a retry owes a reopen: its admission (queued), or itself


class StepField:
    """Fields of a ``workflow_steps`` document (``_id`` is the step's invocation id)."""

    ID = "_id"
    RUN = "run_id"
    NAME = "step_name"
    FUNCTION = "function"
    DATA = "data"
    STATUS = "status"
    ATTEMPT = "attempt"
    MAX_ATTEMPTS = "max_attempts"
    RETRY_DELAY = "retry_delay_ms"
    # False: an error in the body is not tried again, only a lost worker's attempt is (a
    # step that said nothing of retries: issue 36). Absent: true (documents from before).
    ERRORS_RETRIED = "errors_retried"
    # What the running attempt said of its progress (``ctx.progress``), and when; cleared
    # by the claim of each attempt.
    PROGRESS = "progress"
    PROGRESS_AT = "progress_ms"
    RESULT = "result"
    ERROR = "error"
    LEASE = "lease_expires_ms"
    DUE = "due_ms"
    STARTED = "started_ms"
    WORKER = "worker"
    TASK_ID = "task_id"  # the Celery task id of the delivery that claimed the attempt
    CHILD_RUN = "child_run_id"
    ON_ERROR = "on_error"
    # The history of the step: one entry per attempt, keyed by the attempt number as a
    # string ("1", "2", ...), each with the ``HistoryField`` fields STATUS, ERROR, STARTED,
    # ENDED, WORKER and TASK_ID. Written by the same write that changes the step.
    ATTEMPTS = "attempts"
    # The run-lease token of the pass that recorded the step (tokens rise with every pass,
    # so a pass finds the steps recorded since its own with ``seq > token``).
    SEQ = "seq"
    FORKED_FROM = "forked_from"  # a step a fork copied: the run it was copied from
    CREATED = "created_ms"
    UPDATED = "updated_ms"


class HistoryField:
    """Fields of one history entry: an entry of a step's ``attempts`` (which holds
    STATUS, ERROR, STARTED, ENDED, WORKER and TASK_ID), or a ``workflow_step_history``
    document written by an earlier version (``_id`` is ``<step id>:<attempt>``)."""

    ID = "_id"
    STEP = "step_id"
    RUN = "run_id"
    NAME = "step_name"
    ATTEMPT = "attempt"
    STATUS = "status"
    RESULT = "result"
    ERROR = "error"
    STARTED = "started_ms"
    ENDED = "ended_ms"
    WORKER = "worker"
    TASK_ID = "task_id"
    # The step's max_attempts while this attempt ran, written into the last attempt before a
    # retry gives a new budget (the attempts after it ran under the step's current one).
    MAX_ATTEMPTS = "max_attempts"


class VersionField:
    """Fields of a ``workflow_versions`` document (``_id`` is ``<workflow>:<version>``)."""

    ID = "_id"
    WORKFLOW = "workflow"
    VERSION = "version"
    SOURCE = "source"
    CREATED = "created_ms"


class EventField:
    """Fields of a ``workflow_events`` document (``_id``: ``keyed_event_id`` or
    ``sent_event_id``)."""

    ID = "_id"
    RUN = "run_id"
    NAME = "name"
    SEQ = "seq"  # its place in the run's order; null until its send has a place for it
    SEND = "send_id"  # the call that kept it (a key's repeats are other calls)
    PAYLOAD = "payload"
    SIZE = "size"  # the payload's size in bytes as JSON (absent on events kept before it)
    KEY = "key"
    SENT = "sent_ms"
    # When the reaper should wake the run should the sender stop between its write and its
    # wake-up (null once the sender woke it).
    WAKE = "wake_ms"


class ScheduleField:
    """Fields of a ``workflow_schedules`` document (``_id`` is the schedule's name)."""

    ID = "_id"
    WORKFLOW = "workflow"
    CRON = "cron"  # a cron expression, or null
    EVERY = "every_ms"  # an interval in ms (ticks are its multiples since the epoch), or null
    TZ = "tz"  # the time zone the cron expression is read in
    DATA = "data"  # each run's input
    CATCH_UP = "catch_up"  # "latest", "all" or "none"
    PAUSED = "paused"
    NEXT = "next_ms"  # the next tick not yet started
    LAST = "last_ms"  # the latest tick fired (null before the first)
    CREATED = "created_ms"
    UPDATED = "updated_ms"
