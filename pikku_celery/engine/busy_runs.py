"""Which runs this process found held by another pass a moment ago.

A delivered step hands its settle to the pass after it (``execution._run_claimed``). When
another pass holds the run, that settle has to land before the mark that tells the holder
about it, so the call costs a mark, the settle, and the mark again (``passes._take``). The
calls of a gather settle in turn while one pass holds the run: once a call of this process
has found the run held, the next ones write their settle first and leave one mark. A guess
that turns out wrong costs nothing but the settle's ride on the pass's first write (the
settle is written alone, then the lease taken as usual): correctness never depends on it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

#: How long a run found held counts as probably still held: a gather's calls settle
#: within a fraction of this of each other while they come in.
BUSY_FOR_S = 1.0
#: Runs remembered at most (the oldest forgotten first): a guess per run, a few bytes each.
MAX_RUNS = 1024


class BusyRuns:
    """The runs found held recently, by when; thread-safe (a worker's pool threads share
    the engine). ``clock``: seconds, monotonic (a test's fake clock)."""

    def __init__(self, busy_for_s: float = BUSY_FOR_S, max_runs: int = MAX_RUNS, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._busy_for_s = busy_for_s
        self._max_runs = max_runs
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, float] = OrderedDict()

    def found_held(self, run_id: str) -> None:
        with self._lock:
            self._seen[run_id] = self._clock()
            self._seen.move_to_end(run_id)
            while len(self._seen) > self._max_runs:
                self._seen.popitem(last=False)

    def found_free(self, run_id: str) -> None:
        with self._lock:
            self._seen.pop(run_id, None)

    def likely_held(self, run_id: str) -> bool:
        with self._lock:
            seen = self._seen.get(run_id)
        return seen is not None and self._clock() - seen < self._busy_for_s
