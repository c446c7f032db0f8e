"""Leases: fenced, renewable ownership of a key (step leases, run leases)."""

from pikku_celery.leases.base import Lease, LeaseService
from pikku_celery.leases.hold import HeldLease, hold_lease
from pikku_celery.leases.memory import InMemoryLeaseService
from pikku_celery.leases.outage import RedisUnreachableError
from pikku_celery.leases.redis import RedisLeaseService

__all__ = [
    "HeldLease",
    "InMemoryLeaseService",
    "Lease",
    "LeaseService",
    "RedisLeaseService",
    "RedisUnreachableError",
    "hold_lease",
]
