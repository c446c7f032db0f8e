"""The harness's calls into the library, made as an application makes them."""

from __future__ import annotations

import time
from typing import Any


def as_a_client(call: Any, patience_s: float = 60.0) -> Any:
    """The harness's own reads and starts, as an application would make them: a MongoDB
    restart (one of the faults) makes a call fail for a few seconds, an election can
    interrupt a write pymongo then labels retryable; retry it. Starts are
    given their run id, so a retried start is idempotent. A run the harness started may also
    read as missing for a moment just after an election (seen once, seed 20261203, right
    after a step-down: the new primary's majority snapshot can trail the old primary's
    acknowledged writes until it learns the commit point); that is retried and printed."""
    from pymongo.errors import ConnectionFailure, PyMongoError

    from pikku_celery.model.errors import WorkflowRunNotFoundError

    deadline = time.monotonic() + patience_s
    while True:
        try:
            return call()
        except PyMongoError as exc:
            # No primary yet, or a write an election interrupted after pymongo's own retry
            # failed too (seen with --netns, seed 20261206: a start during
            # partition_primary ended with InterruptedDueToReplStateChange).
            if not call_again(exc) or time.monotonic() > deadline:
                raise
            if not isinstance(exc, ConnectionFailure):
                print(f"chaos: {type(exc).__name__} ({exc}), retryable: again", flush=True)
            time.sleep(0.5)
        except WorkflowRunNotFoundError as exc:
            if time.monotonic() > deadline:
                raise
            print(f"chaos: {exc} (a run the harness started): read again", flush=True)
            time.sleep(0.5)


def call_again(exc: BaseException) -> bool:
    """An error an application calls again after (docs/guide/replica-sets.md): no primary
    reachable yet, or a write an election interrupted, which the server labels
    retryable."""
    from pymongo.errors import ConnectionFailure, PyMongoError

    return isinstance(exc, ConnectionFailure) or (
        isinstance(exc, PyMongoError) and exc.has_error_label("RetryableWriteError"))


def now_ms() -> int:
    return int(time.time() * 1000)
