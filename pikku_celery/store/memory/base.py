"""What every concern of the in-memory store shares: the documents and the one lock.

Each concern (``runs``, ``steps``, ``gates``, ``retention``, ``listing``) is a class on
``MemoryStoreBase``; ``InMemoryWorkflowStore`` combines them. Every public method takes the
lock for its whole call; the helpers here expect it held."""

from __future__ import annotations

import threading
from typing import Any

from pikku_celery.model.keys import StepField as S

Doc = dict[str, Any]


class MemoryStoreBase:
    """The state every concern of ``InMemoryWorkflowStore`` works on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, Doc] = {}
        self._steps: dict[str, Doc] = {}  # each with its history (``attempts``)
        self._versions: dict[str, Doc] = {}
        self._events: dict[str, Doc] = {}
        self._slots: dict[str, Doc] = {}  # concurrency slot groups (``store._slots``)
        self._schedules: dict[str, Doc] = {}

    def _run_steps(self, run_id: str) -> list[Doc]:
        docs = [d for d in self._steps.values() if d[S.RUN] == run_id]
        docs.sort(key=lambda d: (d[S.CREATED], d[S.NAME]))
        return docs
