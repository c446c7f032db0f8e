"""A small in-memory app with a parent workflow that starts one child: what the run-id and
child-id tests (issue 22 items 4 and 11) start runs on."""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery


def make_pikku(store: Any = None, **options: Any) -> PikkuCelery:
    return PikkuCelery(Celery(f"sec-{uuid.uuid4().hex[:8]}", broker="memory://"),
                       store=store if store is not None else InMemoryWorkflowStore(),
                       leases=InMemoryLeaseService(), worker_reaper=False, **options)


def make_family(store: Any = None) -> PikkuCelery:
    """``sec.parent`` runs ``sec.kid`` as its child step ``kid``."""
    pikku = make_pikku(store)

    @pikku.workflow("sec.kid")
    def kid(wf: Any, data: Any) -> Any:
        return {"kid": data}

    @pikku.workflow("sec.parent")
    def parent(wf: Any, data: Any) -> Any:
        return wf.child("kid", "sec.kid", {"n": 1})

    return pikku
