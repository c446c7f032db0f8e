"""pikku-celery: durable, fenced workflows for Celery.

Every step outcome is recorded once, by the attempt that currently owns the step; a late or
redelivered task's write is refused with ``WorkflowStepSupersededError``.
"""

from pikku_celery.app import PikkuCelery, get_pikku
from pikku_celery.engine.claims import StepContext
from pikku_celery.leases import (
    InMemoryLeaseService,
    Lease,
    LeaseService,
    RedisLeaseService,
    hold_lease,
)
from pikku_celery.leases.outage import RedisUnreachableError
from pikku_celery.model.errors import (
    InvalidInputError,
    LeaseLostError,
    LeaseTakenError,
    PikkuConfigurationError,
    PikkuError,
    WorkflowApprovalError,
    WorkflowCancelledError,
    WorkflowEventError,
    WorkflowEventLimitError,
    WorkflowEventNotSentError,
    WorkflowNotFoundError,
    WorkflowReplayError,
    WorkflowRunConflictError,
    WorkflowRunFailedError,
    WorkflowRunNotFoundError,
    WorkflowStepFunctionMismatchError,
    WorkflowStepLeaseExpiredError,
    WorkflowStepNotFoundError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.records import (
    QueuedReason,
    StepAttempt,
    StepState,
    WorkflowEvent,
    WorkflowRun,
    WorkflowSchedule,
)
from pikku_celery.store.base import WorkflowStore
from pikku_celery.store.memory import InMemoryWorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from pikku_celery.store.mongo.errors import MongoUnreachableError
from pikku_celery.worker.shared import shared_schedule, shared_step, shared_workflow
from pikku_celery.worker.tasks import internal_task_names
from pikku_celery.workflow._graph_rounds import with_state
from pikku_celery.workflow.replay import WorkflowContext
from pikku_celery.workflow.typed import Step, Workflow

__all__ = [
    "InMemoryLeaseService",
    "InMemoryWorkflowStore",
    "InvalidInputError",
    "Lease",
    "LeaseLostError",
    "LeaseService",
    "LeaseTakenError",
    "MongoUnreachableError",
    "MongoWorkflowStore",
    "PikkuCelery",
    "PikkuConfigurationError",
    "PikkuError",
    "QueuedReason",
    "RedisLeaseService",
    "RedisUnreachableError",
    "Step",
    "StepAttempt",
    "StepContext",
    "StepState",
    "Workflow",
    "WorkflowApprovalError",
    "WorkflowCancelledError",
    "WorkflowContext",
    "WorkflowEvent",
    "WorkflowEventError",
    "WorkflowEventLimitError",
    "WorkflowEventNotSentError",
    "WorkflowNotFoundError",
    "WorkflowReplayError",
    "WorkflowRun",
    "WorkflowRunConflictError",
    "WorkflowRunFailedError",
    "WorkflowRunNotFoundError",
    "WorkflowSchedule",
    "WorkflowStepFunctionMismatchError",
    "WorkflowStepLeaseExpiredError",
    "WorkflowStepNotFoundError",
    "WorkflowStepSupersededError",
    "WorkflowStore",
    "get_pikku",
    "hold_lease",
    "internal_task_names",
    "shared_schedule",
    "shared_step",
    "shared_workflow",
    "with_state",
]
