"""Every Redis key and every MongoDB collection and field name the library writes.

Kept in one module so a schema change is one diff, and so tests and operators can find
what to inspect. Redis keys here are *logical*: the lease service adds its ``key_prefix``
(default ``pikku``) in front of each, so two apps on one Redis never collide.
"""

from __future__ import annotations

# --- Redis (logical keys; RedisLeaseService prefixes them) ---------------------------


def run_lease_key(run_id: str) -> str:
    """The run lease: one orchestrator advances a run at a time (contract invariant 7)."""
    return f"workflow-run:{run_id}"


def step_lease_key(run_id: str, step_name: str) -> str:
    """The step lease held by the worker running the step body."""
    return f"workflow-step:{run_id}:{step_name}"


REAPER_LEASE_KEY = "workflow-reaper"

# Physical Redis layout of one lease (see pikku_celery/leases/redis.py):
#   <prefix>:lease:{<logical key>}        hash {holder, token} with a PEXPIRE
#   <prefix>:lease-token:{<logical key>}  integer counter, never deleted
LEASE_HASH_FMT = "{prefix}:lease:{{{key}}}"
LEASE_TOKEN_FMT = "{prefix}:lease-token:{{{key}}}"

# --- MongoDB collections ---------------------------------------------------------------

RUNS = "workflow_runs"
STEPS = "workflow_steps"
HISTORY = "workflow_step_history"
VERSIONS = "workflow_versions"
RESULTS = "celery_task_results"
DEFAULT_DATABASE = "pikku"


class RunField:
    """Fields of a ``workflow_runs`` document (``_id`` is the run id)."""

    ID = "_id"
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
    RESULT = "result"
    ERROR = "error"
    LEASE = "lease_expires_ms"
    DUE = "due_ms"
    STARTED = "started_ms"
    WORKER = "worker"
    CHILD_RUN = "child_run_id"
    ON_ERROR = "on_error"
    CREATED = "created_ms"
    UPDATED = "updated_ms"


class HistoryField:
    """Fields of a ``workflow_step_history`` document (``_id`` is ``<step id>:<attempt>``)."""

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


class VersionField:
    """Fields of a ``workflow_versions`` document (``_id`` is ``<workflow>:<version>``)."""

    ID = "_id"
    WORKFLOW = "workflow"
    VERSION = "version"
    SOURCE = "source"
    CREATED = "created_ms"
