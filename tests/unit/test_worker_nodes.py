"""The worker recorded with each attempt is the Celery node name a worker was started with
(``celery worker -n w1@%h``) and the process that ran it, ``w1@host:1234`` (issue 36); the
host name when no worker of the app started in this process. The pid stays what follows
the last ``:``. ``tests/integration/test_celery_workers.py`` checks it on real workers."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from celery import Celery, signals

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery


class FakeWorker:
    """What ``worker_init`` sends: the ``WorkController`` (its app, node name and pool)."""

    def __init__(self, app: Celery, hostname: str) -> None:
        self.app, self.hostname, self.pool_cls, self.options = app, hostname, "solo", {}


def _pikku() -> PikkuCelery:
    pikku = PikkuCelery(Celery(f"nodes-{uuid.uuid4().hex[:8]}", broker="memory://",
                               set_as_current=False),
                        store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)

    @pikku.step(name=f"{pikku.app.main}.echo")
    def echo(data: Any) -> Any:
        return data

    @pikku.workflow("echoing")
    def echoing(wf: Any, data: Any) -> Any:
        return wf.do("echo", echo, data)

    return pikku


def _workers(pikku: PikkuCelery) -> list[str | None]:
    run_id = pikku.start("echoing", 1, inline=True)
    return [attempt.worker for attempt in pikku.get_history(run_id)]


def test_an_attempt_names_the_node_its_worker_was_started_as() -> None:
    pikku, other = _pikku(), _pikku()
    assert _workers(pikku) == [f"{socket.gethostname()}:{os.getpid()}"]  # no worker yet
    worker = FakeWorker(pikku.app, "w1@box.example")
    signals.worker_init.send(sender=worker)
    try:
        found = _workers(pikku)  # the engine was built before the worker started
        assert found == [f"w1@box.example:{os.getpid()}"], found
        host, _, pid = str(found[0]).rpartition(":")
        assert (host, int(pid)) == ("w1@box.example", os.getpid())
        # Per app: another app's attempts in this process are not this worker's.
        assert _workers(other) == [f"{socket.gethostname()}:{os.getpid()}"]
    finally:
        pikku.routing._on_worker_shutdown(sender=worker)
    assert _workers(pikku) == [f"{socket.gethostname()}:{os.getpid()}"]
