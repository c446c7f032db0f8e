"""The workflow store contract.

A store keeps runs, steps, one history entry per step attempt, and workflow versions (and
the events sent to runs, ``EventStore``, and schedules, ``store._schedules.ScheduleStore``,
parts of the contract of their own that ``WorkflowStore`` extends). The step document is
the authority on a step, and it holds the step's history: every write that
changes a step writes the entry of the attempt it starts or ends in the same atomic write,
so no crash can leave an attempt without its entry. Readers still take the current attempt
from the step itself, and report an earlier attempt that has no entry (a document written
otherwise) as one that lost its lease.

Every method that *decides* something (a claim, a fenced write, a guarded transition) is one
atomic compare-and-set on the step or run; none reads and then writes unguarded. Callers pass
``now_ms`` from the lease service's clock (the Redis server's ``TIME``), so lease deadlines
are written and compared on one clock whatever the worker's own clock says.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.records import (
    RUN_TERMINAL,
    STEP_PENDING,
    StepAttempt,
    StepState,
    WorkflowRun,
)
from pikku_celery.model.trace_context import check_trace
from pikku_celery.model.validate import check_name
from pikku_celery.store._event_store import EventStore
from pikku_celery.store._schedules import ScheduleStore
from pikku_celery.store._slots import SlotStore

# ``set_result``/``set_error`` without the claimed data: the store reads it back.
NOT_GIVEN: Any = type("NotGiven", (), {"__repr__": lambda self: "NOT_GIVEN"})()


@dataclass(frozen=True)
class NewRun:
    run_id: str
    workflow: str
    input: Any
    version: str | None = None
    parent_run_id: str | None = None
    parent_step_name: str | None = None
    # The schedule whose tick starts the run, and that tick (epoch ms): ``pikku.schedule``.
    schedule: str | None = None
    scheduled_ms: int | None = None
    # A limited workflow's slot group: the run is created ``queued`` in it (``concurrency``).
    slot: str | None = None
    # A fork's source run and its lineage entry (``forks``): written in the insert that
    # creates the run, so a repeat of the fork recognizes its own run exactly.
    forked_from: str | None = None
    lineage: tuple[Mapping[str, Any], ...] = ()
    # The trace context of whoever creates the run (``WorkflowRun.trace``), checked here:
    # a W3C traceparent and tracestate, nothing else, bounded.
    trace: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "trace", check_trace(self.trace))


@dataclass(frozen=True)
class NewStep:
    """A step as the orchestrator first records it.

    ``status`` is ``pending`` (a message is on its way), ``scheduled`` (due at ``due_ms``:
    a sleep or a delayed start) or ``running`` with ``child_run_id`` set (parked on a child
    run: no lease, never reclaimed, settled when the child ends).
    """

    run_id: str
    step_name: str
    function: str | None
    data: Any = None
    max_attempts: int = 1
    retry_delay_ms: int = 0
    status: str = "pending"
    due_ms: int | None = None
    child_run_id: str | None = None
    on_error: str | None = None
    errors_retried: bool = True  # ``StepState.errors_retried``


@dataclass(frozen=True)
class ClaimResult:
    """What a claim did. ``state`` is the claimed step, or ``None`` for "not yours".

    ``wake_run`` is set when the claim failed the step for a lapsed lease with no attempts
    left: the caller must wake the run's orchestrator so it can fail or compensate.
    """

    state: StepState | None
    wake_run: bool = False
    run_status: str | None = None  # the run's end, when the claim found the run ended


@dataclass(frozen=True)
class NewClaim:
    """What ``claim_new_step`` did: ``state`` is the step claimed (``created``), the step
    someone recorded first (not ``created``: nothing was written), or ``None`` when the
    insert landed on a run that had ended (``run_status``): the attempt it opened is fenced
    at once and no body may run."""

    state: StepState | None
    created: bool
    run_status: str | None = None


@dataclass(frozen=True)
class RunRead:
    """What ``read_run`` found: the run (``None`` when not asked for, or unknown) and the
    steps asked for that exist, in no particular order."""

    run: WorkflowRun | None
    steps: list[StepState]


@runtime_checkable
class ForkStore(Protocol):
    """The runs a fork made (``pikku_celery.engine.forks``): listed from the run they name."""

    def list_forks(self, run_id: str, limit: int = 50) -> list[WorkflowRun]:
        """The runs forked from ``run_id`` (``WorkflowRun.forked_from``), oldest first, at
        most ``limit`` (1 to 1000): a run's page links to its forks as a fork's links to
        its source."""
        ...


@runtime_checkable
class EndStore(Protocol):
    """A run's end and its undoing: the end's fence of the steps it left unsettled, and
    a retry that brings an ended run back (``store._ended``, ``store._retry``)."""

    def cancel_steps(self, run_id: str, error: dict[str, Any], now_ms: int, *,
                     while_ended: bool = False) -> int:
        """Fence every unsettled step of an ended run (cancelled, or completed/failed with
        steps left behind): fail it with ``error`` and spend its attempts, so in-flight
        writes and renewals of its attempt are refused (its body is told at its next
        heartbeat). Callers write the run's end *first*: a step claimed after this read
        its steps fences itself (``claim_step``). Each step is one write guarded on what
        was read: a step that settled since keeps its outcome.

        ``while_ended``: each write is also guarded on the end still standing (MongoDB:
        the end's mark, in the same ordered command; the in-memory store: the run's
        status, under its lock). A retry that revived the run between the end and its
        fence removed the mark before it reopened a step, so the fence never fails for
        good what the retry reopened (issue 31, defect 4). The engine always passes it."""
        ...

    def retry_run(self, run_id: str, now_ms: int, *, queued: bool = False,
                  by: str | None = None) -> list[StepState] | None:
        """Bring a ``failed`` or ``cancelled`` run back to ``running`` (its output, error and
        cancel reason cleared, the retry appended to its ``lineage`` with ``by``), then
        remove MongoDB's end mark, then reopen every step its end left failed for good
        (``store._retry``): the run goes live *before* any of its steps can be claimed
        again, and the mark goes before any step is reopened, so a fence of the end that
        lands later refuses itself (``cancel_steps(while_ended=True)``, ``store._ended``).
        Returns the steps reopened; ``None`` (nothing written) when the run is not failed
        or cancelled.

        ``queued``: a run of a limited workflow goes back to ``queued`` instead, holding
        no slot and with its steps left as they are: its admission (``admit_run``)
        reopens them. A slot is never taken for a run that is not live, so no sweep can
        see it held by an ended run and give it back (issue 31, defect 3)."""
        ...

    def resume_retry(self, run_id: str, now_ms: int) -> list[StepState] | None:
        """Finish a ``retry_run`` cut short after its first write (the run ``running``
        again, its steps not all reopened: an election interrupted the call): remove the
        end mark and reopen what is still failed for good, as ``retry_run`` does, then
        forget that a reopen was owed. Returns the steps reopened now; ``None`` (nothing
        written) when no retry of this run was left half-done. A store whose
        ``retry_run`` is one atomic step never leaves one."""
        ...

    def admit_run(self, run_id: str, now_ms: int) -> list[StepState] | None:
        """Move a ``queued`` run to ``running`` (its admission, once a slot is held for it)
        and, for a run a retry queued, reopen its steps as ``retry_run`` does. Returns the
        steps reopened (none for a run never started); ``None`` (nothing written) when the
        run is not queued (cancelled meanwhile, or admitted by another)."""
        ...


class HandOffStore(Protocol):
    """What a pass writes for a step whose settle it carries (``engine.passes``): the
    settle goes with the pass's first write, in one round trip."""

    def claim_new_step(self, step: NewStep, now_ms: int, lease_ms: int, *, seq: int = 0,
                       worker: str | None = None, task_id: str | None = None) -> NewClaim:
        """Insert a ``pending`` step already claimed by its first attempt: the document a
        first claim of the pending step would leave (running, attempt 1, the lease and the
        attempt's history entry), in one insert. For a pass that runs the step it records
        at once (``passes``), so the step costs no message and no separate claim. Like a
        claim that won, it checks the run *after* its write and fences the attempt when the
        run has ended (the Dekker pair with ``cancel_steps``; MongoDB checks for the mark a
        run's end leaves first, in the insert's own command: ``store._ended``). A step that
        exists already is
        returned as it is, unchanged (``created`` false). The caller holds the run."""
        ...

    def settle_and_claim_new(self, run_id: str, step_name: str, attempt: int, result: Any,
                             now_ms: int, step: NewStep, lease_ms: int, *, seq: int = 0,
                             worker: str | None = None, task_id: str | None = None
                             ) -> NewClaim:
        """``set_result`` of ``step_name``'s attempt ``attempt`` and ``claim_new_step`` of
        ``step`` (the step the workflow reached with that result), in one round trip, the
        insert only once the result is recorded. ``WorkflowStepSupersededError`` when the
        attempt no longer owns its step: then nothing is written. For a pass running steps
        in place: a step's settle and the next step's claim, one command. ``worker`` and
        ``task_id`` are recorded with the new step's attempt, as ``claim_new_step``'s."""
        ...

    def settle_and_insert_steps(self, run_id: str, step_name: str, attempt: int, result: Any,
                                now_ms: int, steps: Sequence[NewStep], *, seq: int = 0,
                                end_mark: bool = False) -> list[tuple[StepState, bool]]:
        """``set_result`` then ``insert_steps`` of what the workflow reached with that result,
        in one round trip: what ``insert_steps`` returns. ``WorkflowStepSupersededError``
        (nothing written) when the attempt no longer owns its step. The caller holds the
        run. ``end_mark``: the pass ends the run next, and the mark its end leaves among the
        steps (``store._ended``) is written by this command too, after the settle; the end
        is then written with ``transition_run(..., marked=True)``."""
        ...


@runtime_checkable
class WorkflowStore(EventStore, ScheduleStore, SlotStore, ForkStore, EndStore, HandOffStore,
                    Protocol):
    # --- runs -------------------------------------------------------------------------

    def create_run(self, run: NewRun, now_ms: int) -> tuple[WorkflowRun, bool]:
        """Insert a ``running`` run; idempotent by ``run_id``. Returns ``(run, created)``.
        Atomic (insert with a unique id). A different workflow under an existing id raises
        ``WorkflowRunConflictError`` and changes nothing."""
        ...

    def get_run(self, run_id: str) -> WorkflowRun | None: ...

    def transition_run(
        self,
        run_id: str,
        from_statuses: Iterable[str],
        to_status: str,
        now_ms: int,
        *,
        output: Any = None,
        error: dict[str, Any] | None = None,
        cancel_reason: str | None = None,
        marked: bool = False,
    ) -> bool:
        """Move a run from one of ``from_statuses`` to ``to_status``; one guarded write.
        Returns ``False`` (and writes nothing) if the run was in another status. An end
        leaves its mark among the steps first (``store._ended``), unless ``marked``: the
        caller's last settle wrote it (``settle_and_insert_steps``'s ``end_mark``)."""
        ...

    def touch_run(self, run_id: str, now_ms: int) -> str | None:
        """Record that a pass looked at the run (for the stalled-run sweep) and return its
        status as of that write (``None`` for an unknown run): one round trip."""
        ...

    def write_run_state(self, run_id: str, writer: str, values: Mapping[str, Any],
                        version: int, now_ms: int) -> WorkflowRun | None:
        """Merge ``values`` into the run's state map as write ``version + 1``, made by
        ``writer``, if the map is still at ``version``: one compare-and-set, so a write is
        neither lost nor applied twice by two passes. Returns the run as written, or
        ``None`` (nothing written) for an unknown run or a state past ``version``. Bad keys
        or a map over ``MAX_STATE_BYTES`` raise ``InvalidInputError`` and write nothing."""
        ...

    def list_runs(
        self,
        *,
        workflow: str | None = None,
        status: str | None = None,
        limit: int = 50,
        created_before_ms: int | None = None,
        before_run_id: str | None = None,
        match: RunMatch | None = None,
    ) -> list[WorkflowRun]:
        """Newest first (by creation time, then id), at most ``limit`` (1 to 1000); the next
        page starts after ``(created_before_ms, before_run_id)`` of the last run seen.
        ``match`` keeps only the runs whose input has those values (``check_run_match``):
        part of the query, so a page holds ``limit`` matching runs."""
        ...

    # --- steps ------------------------------------------------------------------------

    def insert_step(self, step: NewStep, now_ms: int) -> tuple[StepState, bool]:
        """Insert a step; idempotent under a concurrent insert of the same
        ``(run_id, step_name)`` (the loser reads the winner's). Returns ``(state, created)``."""
        ...

    def insert_steps(self, steps: Sequence[NewStep], now_ms: int, *, seq: int = 0
                     ) -> list[tuple[StepState, bool]]:
        """Insert the steps a pass recorded, in one round trip (and one more to read those
        that already existed): ``(state, created)`` for each, in order, as ``insert_step``
        returns them. ``seq`` is the run-lease token of the pass (see ``read_run``). The
        caller holds the run, so the run is not looked up."""
        ...

    def insert_replayed_steps(self, run_id: str, steps: Sequence[StepState], now_ms: int,
                              *, source_run_id: str) -> int:
        """Record ``steps``, succeeded steps of run ``source_run_id``, as succeeded steps of
        ``run_id`` with the same results (a fork replays them: ``store._retry``); a step
        ``run_id`` has already is kept as it is. Returns how many were inserted."""
        ...

    def read_run(self, run_id: str, *, run: bool = True, input: bool = True,
                 all_steps: bool = False, step_names: Collection[str] = (),
                 recorded_after: int | None = None) -> RunRead:
        """What a pass reads, in one round trip (none when it asks for nothing): the run
        when ``run`` (without its input when ``input`` is false), and every step of it
        (``all_steps``), or the steps named in ``step_names`` together with the steps
        recorded by passes holding a run-lease token above ``recorded_after``."""
        ...

    def get_step(self, run_id: str, step_name: str) -> StepState | None: ...

    def list_steps(self, run_id: str) -> list[StepState]:
        """Every step of the run in creation order; one read."""
        ...

    def claim_step(
        self, run_id: str, step_name: str, function: str | None, now_ms: int, lease_ms: int,
        worker: str | None = None, task_id: str | None = None, *, expected: object = None,
    ) -> ClaimResult:
        """Claim the step for execution: one guarded write (contract invariants 2, 3, 6, 8).
        ``worker`` and ``task_id`` (the Celery task id of the delivery) are recorded with
        the attempt and copied into its history entry.

        - ``function`` differs from the recorded one: ``WorkflowStepFunctionMismatchError``
          before any write;
        - ``pending``, or ``scheduled`` and due: first claim, attempt unchanged;
        - ``failed`` with attempts left and its retry due, or ``running`` with a lapsed lease
          and attempts left: reclaim as attempt + 1, in the same write that grants the lease;
        - ``running`` with a lapsed lease and no attempts left: fail it with
          ``WorkflowStepLeaseExpiredError`` and return ``wake_run=True``;
        - anything else (live lease, settled, spent, not due, lost race): ``state=None``.
        Unknown run or step: ``WorkflowStepNotFoundError``.

        A claim that won reads the run *after* its write; when the run has ended
        (completed, failed, cancelled) it fences the attempt it just started, as
        ``cancel_steps`` would (failed for good with the run's end as its error), and
        returns ``state=None``: no body runs for an ended run. With ``cancel_steps``, which
        runs after the run's end was written, this is a Dekker pair: a claim landing
        between the fence's read of the steps and its write is seen by one side or the
        other, never by neither (see ``pikku_celery.store._ended``). ``expected``: the step
        as its message says it was recorded (``store._claim_hint``, untrusted), which may
        spare a store the read; the outcome is the same."""
        ...

    def set_result(
        self, run_id: str, step_name: str, attempt: int, result: Any, now_ms: int, *,
        claimed_data: Any = NOT_GIVEN
    ) -> StepState:
        """Record success, fenced to ``attempt`` of a ``running`` step; otherwise raise
        ``WorkflowStepSupersededError`` and change nothing. ``claimed_data``: the step's
        data as the attempt's claim returned it (a step's data never changes once
        recorded): a store may leave it out of what it reads back and return it instead,
        so a large step's data is not moved again by every settle."""
        ...

    def set_error(
        self,
        run_id: str,
        step_name: str,
        attempt: int,
        error: dict[str, Any],
        now_ms: int,
        *,
        retry_at_ms: int | None = None,
        final: bool = False,
        claimed_data: Any = NOT_GIVEN,
    ) -> StepState:
        """Record failure of ``attempt``, fenced like ``set_result`` (``claimed_data``
        too). ``retry_at_ms`` is when the next attempt may be claimed (ignored when no
        attempts are left); ``final`` fails the step for good whatever attempts are left."""
        ...

    def renew_leases(
        self, held: Sequence[tuple[str, str, int]], now_ms: int, lease_ms: int
    ) -> set[tuple[str, str]]:
        """Extend the lease of each ``(run_id, step_name, attempt)`` still running under that
        attempt; a constant number of round trips however many. Returns the
        ``(run_id, step_name)`` pairs whose renewal was refused (superseded or settled)."""
        ...

    def release_lease(self, run_id: str, step_name: str, attempt: int) -> bool:
        """Clear the lease of a running step (it waits on a child); fenced, ``False`` if not
        the current attempt."""
        ...

    def record_progress(self, run_id: str, step_name: str, attempt: int, progress: Any,
                        now_ms: int) -> None:
        """Record what running ``attempt`` says of its progress (``StepContext.progress``);
        fenced: ``WorkflowStepSupersededError`` when it is not the running attempt."""
        ...

    def settle_waiting_step(
        self,
        run_id: str,
        step_name: str,
        now_ms: int,
        *,
        result: Any = None,
        error: dict[str, Any] | None = None,
        child_run_id: str | None = None,
        gate: bool = False,
        by: str | None = None,
        wake_check_ms: int | None = None,
    ) -> bool:
        """Settle a step nobody claims: a due sleep (``scheduled`` with ``due_ms <= now``), a
        step parked on ``child_run_id``, or with ``gate`` a ``scheduled`` step that is never
        due by itself (a suspension gate) or not due yet (an approval before its expiry:
        the expiry, settling it as due, and a decision, settling it as a gate, exclude each
        other on the one clock). One guarded write; ``False`` if it no longer waits (already
        settled, not yet due, expired, another child). ``by`` (who decided an approval) is
        recorded as the attempt's ``worker`` in the history.

        ``wake_check_ms`` stays in the settled step's due time: a gate is settled before
        its run moves out of ``suspended`` (another write), and a writer that dies between
        the two would leave the run suspended behind an open gate; the reaper finds the
        check due (``find_due_steps``), takes the run back and wakes it, and ends the check
        (``clear_wake_check``)."""
        ...

    def clear_wake_check(self, run_id: str, step_name: str, due_ms: int) -> bool:
        """End a settled gate's wake check (the reaper has taken its run back); guarded on
        the check being the one read, so a newer one is kept."""
        ...

    # --- history ----------------------------------------------------------------------

    def get_history(self, run_id: str) -> list[StepAttempt]:
        """One entry per attempt of every step, ordered by step creation then attempt; the
        current attempt always reflects the step document."""
        ...

    # --- versions ---------------------------------------------------------------------

    def record_version(self, workflow: str, version: str, source: str, now_ms: int) -> bool:
        """Record a workflow definition; the first writer wins. ``True`` if this call wrote."""
        ...

    def get_version(self, workflow: str, version: str) -> dict[str, Any] | None: ...

    # --- sweeps (each bounded by ``limit``) -------------------------------------------

    # The sweeps below (``find_lapsed_steps``, ``find_due_steps``, ``find_unsettled_steps``)
    # may leave out each step's ``data``, ``progress`` and attempts' history:
    # the reaper reads none of them, and sweeps from every worker every interval must not
    # carry a large step's body around (``MongoWorkflowStore`` leaves them out).

    def find_lapsed_steps(self, now_ms: int, limit: int,
                          after: tuple[int, str] | None = None) -> list[StepState]:
        """``running`` steps whose lease deadline has passed (parked steps have none), in
        ``(lease deadline, invocation id)`` order, starting after ``after`` when given."""
        ...

    def find_due_steps(self, now_ms: int, dispatched_before_ms: int, limit: int,
                       after: tuple[int, str] | None = None) -> list[StepState]:
        """Steps that should be running but nobody picked up: ``pending`` since before
        ``dispatched_before_ms``, ``scheduled`` or retryable ``failed`` whose due time passed,
        and settled gates whose wake check is due (``succeeded``, see
        ``settle_waiting_step``); in ``due_sweep_key`` order (a pending step by when it was
        dispatched, any other by when it fell due), starting after ``after`` (a step's
        key) when given."""
        ...

    def find_stalled_runs(self, idle_since_ms: int, limit: int) -> list[WorkflowRun]:
        """``running`` runs no pass has touched since ``idle_since_ms``."""
        ...

    def touch_runs(self, run_ids: Collection[str], now_ms: int) -> None:
        """``touch_run`` for many runs in one write (the stalled-run sweep's)."""
        ...

    def find_unsettled_steps(self, run_ids: Collection[str]) -> list[StepState]:
        """The steps of ``run_ids`` not settled for good (pending, scheduled, running, or
        failed with a retry due): what the stalled-run sweep looks at, in one query
        however many runs it found."""
        ...

    # --- retention and counts (operators' tools) ----------------------------------------

    def count_runs(self, *, status: str, workflow: str | None = None,
                   updated_before_ms: int | None = None, limit: int = 10_000,
                   match: RunMatch | None = None) -> int:
        """How many runs have ``status`` (and ``workflow``, or else a last update before
        ``updated_before_ms``: not both), counting at most ``limit``: an index-served
        count that stops there, so a dashboard's counts cost the same with millions of
        runs. ``match`` as for ``list_runs`` (index the fields it names)."""
        ...

    def purge_runs(self, ended_before_ms: int, *, statuses: Iterable[str] = RUN_TERMINAL,
                   limit: int = 500) -> list[str]:
        """Delete up to ``limit`` ended runs whose status is in ``statuses`` (ended ones
        only: a live status is refused) and whose last update is before
        ``ended_before_ms``, with their steps and history; returns the ids deleted.

        A batch's steps and history go first, then its runs, with an ended status in the
        delete's own filter. An ended run never changes status again, and no new run can
        take its id while it exists, so the steps deleted are its own; a crash between the
        two deletes leaves ended runs that the next purge finds again."""
        ...


#: ``list_runs``' and ``count_runs``' ``match``: ``{"input.owner": "ann"}`` keeps the runs
#: whose input has ``owner`` equal to ``"ann"`` (a web caller's "my runs").
RunMatch = Mapping[str, "str | int | float | bool | None"]
MATCH_ROOT = "input"
MAX_MATCH_FIELDS = 8
_MATCH_VALUES = (str, int, float, bool, type(None))


def check_run_match(match: Mapping[str, Any] | None) -> dict[str, Any]:
    """``match`` as a store queries it. Each key is ``"input"`` and one or more ``.name``
    segments (each a name ``check_name`` takes: no leading ``$``, no NUL); each value a
    ``str``, ``int``, ``float``, ``bool`` or ``None``, compared for equality as MongoDB
    compares (a list in the input matches when one of its items is equal). Never a
    document or a list: nothing in a value can be read as a query operator. At most
    ``MAX_MATCH_FIELDS`` keys. Anything else is ``InvalidInputError``."""
    if match is None:
        return {}
    if not isinstance(match, Mapping) or len(match) > MAX_MATCH_FIELDS:
        raise InvalidInputError(f"a run match must be a mapping of at most "
                                f"{MAX_MATCH_FIELDS} fields, got {type(match).__name__}")
    checked: dict[str, Any] = {}
    for key, value in match.items():
        parts = key.split(".") if isinstance(key, str) else []
        if len(parts) < 2 or parts[0] != MATCH_ROOT:
            raise InvalidInputError(f"a run match names fields of the run's input, as "
                                    f"'input.owner'; got {key!r}")
        for part in parts[1:]:
            check_name("a run match's field name", part)
        if not isinstance(value, _MATCH_VALUES):
            raise InvalidInputError(f"a run match's value must be a string, number, boolean "
                                    f"or None; {key!r} is a {type(value).__name__}")
        checked[key] = value
    return checked


def run_matches(run_input: Any, match: Mapping[str, Any]) -> bool:
    """Whether a run whose input is ``run_input`` has every value of a checked ``match``,
    as MongoDB's equality reads a dotted path (through lists, on any of their items): the
    in-memory stores' ``match``."""
    return all(_path_has(run_input, key.split(".")[1:], value) for key, value in match.items())


def _path_has(value: Any, path: list[str], wanted: Any) -> bool:
    if not path:
        return _equal(value, wanted) or (
            isinstance(value, list) and any(_equal(item, wanted) for item in value))
    if isinstance(value, list):
        return any(_path_has(item, path, wanted) for item in value if isinstance(item, Mapping))
    if isinstance(value, Mapping) and path[0] in value:
        return _path_has(value[path[0]], path[1:], wanted)
    return wanted is None  # a missing field equals null, as in MongoDB


def _equal(stored: Any, wanted: Any) -> bool:
    # BSON's rules, not Python's: True is not 1; 1 is 1.0; a string is no number.
    if isinstance(stored, bool) or isinstance(wanted, bool):
        return type(stored) is type(wanted) and stored == wanted
    numbers = (int, float)
    if isinstance(stored, numbers) and isinstance(wanted, numbers):
        return stored == wanted
    return type(stored) is type(wanted) and bool(stored == wanted)


def due_sweep_key(step: StepState) -> tuple[int, str]:
    """Where ``step`` stands in ``find_due_steps``' order (what its ``after`` takes): a
    ``pending`` step by when it was dispatched (``updated_at``), any other by when it fell
    due (``due_at``), then by invocation id. Each part is what an index orders, so the
    MongoDB store reads each page in order instead of sorting the backlog in memory."""
    pending = step.status == STEP_PENDING or step.due_at is None
    when = step.updated_at if pending else step.due_at
    assert when is not None
    return round(when.timestamp() * 1000), step.invocation_id
