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
