"""Fork a run: a new run of the same workflow and input that replays the steps the source
recorded before a step, and runs the rest afresh (``pikku.fork``).

What a fork promises (issue 31, contract §6 and §7.6):

- **It only creates.** The new run's document names its source (``forked_from``) and the
  fork (its first ``lineage`` entry: the step forked from, who, when, whether decisions
  were kept), written by the insert that creates it. A repeat of the same fork (same
  source, same step, same ``keep_decisions``, same new run id) finds that run and returns
  it; any other run under that id is a ``WorkflowRunConflictError`` and nothing is
  written into it. Copying steps into a run that already existed once let a caller
  overwrite another tenant's live run with its own results (defect 5).
- **It asks decisions again.** Approvals (``__approval:``) and event waits (``__event:``)
  of the source are not copied unless ``keep_decisions``: the new run waits for its own
  approval and its own event. Copying someone's approval into a run its forker starts
  re-ran a payment nobody approved for that run (defect 6).
- **Copied steps come first.** They are written after the run's insert and before the
  run can be woken (by its admission to a concurrency slot, or by this call), so no pass
  runs a step afresh that the fork was to replay. Should the fork stop between the two
  (a crash, a store error), the run's first pass copies them (``copy_missing``, from
  what the run's document says of its fork) before it replays anything: the reaper's
  stalled-run sweep wakes such a run, and it would otherwise run every step afresh."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pikku_celery.engine.reads import get_run
from pikku_celery.model.errors import InvalidInputError, WorkflowRunConflictError
from pikku_celery.model.records import LINEAGE_FORK, STEP_SUCCEEDED, StepState, WorkflowRun
from pikku_celery.model.validate import check_by
from pikku_celery.store._docs import lineage_entry
from pikku_celery.store.base import WorkflowStore

if TYPE_CHECKING:
    from pikku_celery.engine.runs import Runs

log = logging.getLogger("pikku_celery")

#: The replayed names of decided gates: an approval, and an event wait (the event it took).
DECISION_PREFIXES = ("__approval:", "__event:")


def is_decision(step_name: str) -> bool:
    """Whether ``step_name`` is a gate a fork asks again unless ``keep_decisions``."""
    return step_name.startswith(DECISION_PREFIXES)


def replayed(run_id: str, steps: Sequence[StepState], from_step: str, *,
             keep_decisions: bool = False) -> list[StepState]:
    """The steps of ``steps`` (run ``run_id``'s, in the order recorded) a fork from
    ``from_step`` copies: those recorded before it that succeeded, decided gates only with
    ``keep_decisions``. ``InvalidInputError`` naming the run's steps when none is
    ``from_step``."""
    names = [s.step_name for s in steps]
    if from_step not in names:
        shown = ", ".join(repr(n) for n in names[:20]) + (", ..." if len(names) > 20 else "")
        raise InvalidInputError(f"run {run_id} recorded no step {from_step!r} to fork "
                                f"from; its steps: {shown or 'none'}")
    return [s for s in steps[:names.index(from_step)]
            if s.status == STEP_SUCCEEDED and (keep_decisions or not is_decision(s.step_name))]


def kept_approvals(run_id: str, steps: Sequence[StepState], from_step: str) -> list[str]:
    """The approvals (their names, as ``pikku.approve`` takes them) a fork from
    ``from_step`` with ``keep_decisions`` copies: what the JSON API authorizes as
    ``approve``, one gate at a time."""
    return [str((s.data or {}).get("approval", s.step_name))
            for s in replayed(run_id, steps, from_step, keep_decisions=True)
            if s.step_name.startswith(DECISION_PREFIXES[0]) and isinstance(s.data, dict)]


def same_fork(run: WorkflowRun, source_run_id: str, from_step: str,
              keep_decisions: bool) -> bool:
    """Whether ``run`` is the run a fork of ``source_run_id`` from ``from_step`` made."""
    if run.forked_from != source_run_id or not run.lineage:
        return False
    made = run.lineage[0]
    return (made.op == LINEAGE_FORK and made.run_id == source_run_id
            and made.from_step == from_step and made.keep_decisions == keep_decisions)


def copy_missing(store: WorkflowStore, run: WorkflowRun, now_ms: int) -> int:
    """Copy into ``run``, a fork that recorded no step yet, the steps its fork replays (its
    document names the source, the step and ``keep_decisions``: ``forked_from`` and its
    first ``lineage`` entry); a step it has already is kept. For the run's first pass, in
    case the fork stopped between the run's insert and its copy. Nothing for a run that is
    not a fork, or whose source no longer has the step (purged): it then runs afresh."""
    made = run.lineage[0] if run.lineage else None
    if (run.forked_from is None or made is None or made.op != LINEAGE_FORK
            or made.from_step is None):
        return 0
    try:
        kept = replayed(run.forked_from, store.list_steps(run.forked_from), made.from_step,
                        keep_decisions=made.keep_decisions)
    except InvalidInputError:
        return 0
    copied = store.insert_replayed_steps(run.run_id, kept, now_ms,
                                         source_run_id=run.forked_from)
    if copied:
        log.warning("pikku: fork %s of run %s found without its copy: %d step(s) copied by "
                    "its first pass", run.run_id, run.forked_from, copied)
    return copied


class Forks:
    """``pikku.fork`` over the run lifecycle ``runs`` (its store, clock and dispatcher, as
    the engine replaces them)."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs

    def fork(self, run_id: str, from_step: str, new_run_id: str | None = None, *,
             keep_decisions: bool = False, by: str | None = None) -> str:
        """A new run of ``run_id``'s workflow and input that replays the steps it
        recorded before ``from_step`` (those that succeeded: their results are copied;
        approvals and event waits only with ``keep_decisions``) and runs the rest afresh,
        ``from_step`` included. ``new_run_id``: its id; the same fork repeated returns
        it, another run under it is ``WorkflowRunConflictError``. ``by``: who forks, kept
        in the new run's lineage. Returns the new run's id."""
        if not isinstance(keep_decisions, bool):
            raise InvalidInputError(f"keep_decisions must be True or False, got "
                                    f"{keep_decisions!r}")
        check_by(by)
        runs, store = self.runs, self.runs.store
        source = get_run(store, run_id)
        kept = replayed(run_id, store.list_steps(run_id), from_step,
                        keep_decisions=keep_decisions)
        entry = lineage_entry(LINEAGE_FORK, runs.now_ms(), by=by, from_step=from_step,
                              run_id=run_id, keep_decisions=keep_decisions)

        def copy_steps(run: WorkflowRun) -> None:
            store.insert_replayed_steps(run.run_id, kept, runs.now_ms(),
                                        source_run_id=run_id)

        run, created = runs.create_run(
            source.workflow, source.input,
            run_id=new_run_id if new_run_id is not None else str(uuid.uuid4()),
            forked=(run_id, entry), on_created=copy_steps)
        if not created:
            if not same_fork(run, run_id, from_step, keep_decisions):
                raise WorkflowRunConflictError(
                    run.run_id, f"it is not the fork of run {run_id} from step "
                                f"{from_step!r}{' keeping decisions' if keep_decisions else ''}")
            # The same fork again: finish its copy, in case the first call stopped between
            # the run's insert and the copy (a step the run has already is kept).
            copy_steps(run)
        if not run.is_terminal:
            runs.dispatcher.wake_run(run.run_id)
        log.info("pikku: run %s forked from %s at step %r (%d step(s) replayed%s)", run.run_id,
                 run_id, from_step, len(kept), ", decisions kept" if keep_decisions else "")
        return run.run_id

