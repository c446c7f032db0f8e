"""Orchestration passes, reported: ``pass_started`` and ``pass_finished`` around every
``Passes.advance``, whoever calls it (the orchestrate task, a settle continuing in place, the
inline driver). The tools that watch a run (a trace's pass span, the pass-duration metric)
need a pass's start and end in the thread that runs it, with the steps it runs in place
reported in between; the passes themselves stay free of reporting."""

from __future__ import annotations

import time

from pikku_celery.engine.passes import Passes
from pikku_celery.engine.protocols import Dispatcher, Emit, PendingSettle, no_emit
from pikku_celery.model.errors import LeaseLostError, LeaseTakenError
from pikku_celery.model.records import RUN_TERMINAL, StepState
from pikku_celery.model.views import ALL

#: ``pass_finished``'s ``outcome``: the run ended, waits on something, another pass held its
#: run lease (this one left a mark and did nothing), the lease was lost mid-pass, or an
#: error escaped the pass.
ENDED, WAITING, BUSY, LOST, ERROR = "ended", "waiting", "busy", "lost", "error"


class ObservedPasses:
    """``Passes.advance`` with its report; the engine's ``Advancer``."""

    def __init__(self, passes: Passes, emit: Emit) -> None:
        self.passes = passes
        self.emit = emit

    def advance(self, run_id: str, dispatcher: Dispatcher, *, mark: str = ALL,
                settled: StepState | None = None,
                pending: PendingSettle | None = None) -> str:
        emit = self.emit
        if emit is no_emit:  # nothing listens: not even a clock read
            return self.passes.advance(run_id, dispatcher, mark=mark, settled=settled,
                                       pending=pending)
        started = time.monotonic()
        views = self.passes.views  # the run's workflow, when a pass here has seen the run
        emit("pass_started", "pass", run_id=run_id, mark=mark,
             workflow=views.workflow_of(run_id))
        outcome = ERROR
        failure: Exception | None = None
        try:
            status = self.passes.advance(run_id, dispatcher, mark=mark, settled=settled,
                                         pending=pending)
            outcome = ENDED if status in RUN_TERMINAL else WAITING
            return status
        except LeaseTakenError:
            outcome = BUSY
            raise
        except LeaseLostError as exc:
            outcome, failure = LOST, exc
            raise
        except Exception as exc:  # what ended the pass: a MongoDB or Redis error counts
            failure = exc
            raise
        finally:
            emit("pass_finished", "pass", run_id=run_id, outcome=outcome,
                 duration=time.monotonic() - started, workflow=views.workflow_of(run_id),
                 exception=failure)
