"""The claim layer around every step execution: claim, hold, settle, all fenced.

No Celery here: the Celery task adapter (``tasks.py``) and inline runs both call it.

Order of one execution, and why:
1. Acquire the step's Redis lease (``workflow-step:<run>:<step>``). A duplicate delivery of a
   step that a live worker holds stops here, without touching MongoDB. The grant also
   returns the Redis server's time, the one clock lease deadlines use.
2. Claim in the store: one guarded write that checks status, attempt and lapse, grants the
   store lease and, for a reclaim, advances the attempt. The store is the authority; the
   Redis lease is a cheap gate in front of it.
3. Run the body while the process heartbeat renews both leases, fenced.
4. Settle with a fenced write; a superseded attempt's write raises
   ``WorkflowStepSupersededError`` and changes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from pikku_celery.engine.heartbeat import Heartbeat, HeldStep
from pikku_celery.leases.base import Lease, LeaseService
from pikku_celery.model import keys
from pikku_celery.model.clock import Clock
from pikku_celery.model.errors import (
    InvalidInputError,
    LeaseLostError,
    WorkflowStepFunctionMismatchError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.records import StepState
from pikku_celery.model.redaction import mask_secrets
from pikku_celery.model.validate import as_stored, check_step_document
from pikku_celery.model.views import settled_for_good
from pikku_celery.store._concerns import deadline
from pikku_celery.store.base import NewClaim, NewStep, WorkflowStore

if TYPE_CHECKING:
    from pymongo.client_session import ClientSession

    from pikku_celery.workflow.definitions import StepDefinition

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10


class StepContext:
    """What a step body sees with ``bind=True``.

    ``invocation_id`` is the same for every attempt of the step: pass it to external
    systems as the idempotency key. The body is never interrupted; a long body should call
    ``check()`` (or read ``lease_lost``) between units of work and stop early when its
    lease was lost, because its outcome will be refused.
    """

    def __init__(self, state: StepState, held: HeldStep | None,
                 session: ClientSession | None = None,
                 report: Callable[[Any], None] | None = None) -> None:
        #: A transactional step's MongoDB session, in the transaction its settle commits
        #: in (``None`` for any other step, and in the test kit): write with
        #: ``session=ctx.session`` on a collection of the store's client.
        self.session = session
        self.run_id = state.run_id
        self.step_name = state.step_name
        self.attempt = state.attempt
        self.max_attempts = state.max_attempts
        self.invocation_id = state.invocation_id
        self._held = held
        self._report = report

    def progress(self, meta: Any) -> None:
        """Record how far the body has got, as Celery's ``update_state(state="PROGRESS",
        meta=...)`` does: plain JSON of at most 16 KiB (``InvalidInputError`` otherwise),
        shown by ``pikku show``, the API and the dashboard while the step runs, cleared when
        another attempt starts. Fenced like every write of the attempt: once it is
        superseded or cancelled this raises ``WorkflowStepSupersededError``, and the body
        should stop (its result would be refused too)."""
        if self._report is not None:
            self._report(meta)

    @property
    def lease_lost(self) -> bool:
        """Lost, or unconfirmed past its deadline: a renewal stuck in a slow call (the
        heartbeat waits on MongoDB) does not keep a body running on a lapsed lease."""
        held = self._held
        return held is not None and (held.lost.is_set()
                                     or time.monotonic() >= held.held_until)

    def check(self) -> None:
        """Raise ``LeaseLostError`` if this attempt lost its lease (superseded, cancelled,
        or unconfirmed past its deadline)."""
        if self.lease_lost:
            raise LeaseLostError(keys.step_lease_key(self.run_id, self.step_name))

    def wait_lost(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``, waking early if the lease is lost; returns lost."""
        if self._held is None:
            time.sleep(timeout_s)
            return False
        held = self._held
        until = time.monotonic() + timeout_s
        while not self.lease_lost:
            left = until - time.monotonic()
            if left <= 0:
                return False
            # Wake at the lease's unconfirmed deadline too: a stuck renewal sets no event.
            if held.lost.wait(min(left, max(0.01, held.held_until - time.monotonic()))):
                return True
        return True


@dataclass
class Claimed:
    state: StepState
    held: HeldStep


@dataclass
class Succeeded:
    """A claimed attempt whose body succeeded, its result checked storable (``stored``: as
    the store will hold it) but not written yet: its settle waits to travel with the next
    step's claim (``Claimer.settle_then_claim``). Its lease is still held and renewed."""

    claimed: Claimed
    result: Any
    stored: Any

    def settled(self, now_ms: int) -> StepState:
        """The step as its settle writes it, at ``now_ms``."""
        return dataclasses.replace(
            self.claimed.state, status="succeeded", result=self.stored, error=None,
            lease_expires_at=None, due_at=None,
            updated_at=datetime.fromtimestamp(now_ms / 1000, tz=UTC))


@dataclass
class NotClaimed:
    wake_run: bool = False


MAX_MESSAGE_CHARS = 4000
MAX_TAGGED_FUNCTION = 400  # longer function names are not written into lease holders


def _function_tag(function: str | None) -> str:
    return function or ""


def _holder(function: str | None) -> str:
    """A fresh holder for a step lease, naming the function it claims with (``<random>:
    <function>``): a later message for the step can be told from a forgery by the lease
    alone. An overlong name is left out (the store still checks every claim)."""
    tag = _function_tag(function)
    if len(tag) > MAX_TAGGED_FUNCTION:
        return uuid.uuid4().hex
    return f"{uuid.uuid4().hex}:{tag}"


def serialize_error(exc: BaseException) -> dict[str, Any]:
    """The stored form of a step or run error: type, message and a bounded traceback, with
    credentials masked (``pikku_celery.model.redaction``; the engine applies the user's hook when
    it records the error). Masked before they are cut to size: a cut can split a URL."""
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        message = str(exc)
    except Exception:  # an exception whose __str__ raises must still fail its attempt
        tb = "".join(traceback.format_tb(exc.__traceback__))
        message = f"<unprintable {type(exc).__name__}>"
    message, tb = mask_secrets(message), mask_secrets(tb)
    if len(message) > MAX_MESSAGE_CHARS:  # an error must always be storable
        message = message[:MAX_MESSAGE_CHARS] + f"... [{len(message)} characters]"
    return {"type": type(exc).__name__, "message": message, "traceback": tb[-4000:]}


def call_body(claimer: Claimer, definition: StepDefinition, claim: Claimed) -> Any:
    """Run the claimed attempt's body (with its ``StepContext`` when bound)."""
    try:
        if definition.bind:
            return definition.fn(StepContext(claim.state, claim.held,
                                              report=claimer.progress_of(claim.state)),
                                 claim.state.data)
        return definition.fn(claim.state.data)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # SystemExit & co: let the lease lapse
            claimer.heartbeat.remove(claim.held)
        raise


class Claimer:
    """Claims, holds and settles step attempts for one process."""

    def __init__(self, store: WorkflowStore, leases: LeaseService, clock: Clock,
                 heartbeat: Heartbeat, *, host: str | Callable[[], str] | None = None) -> None:
        self.store = store
        self.leases = leases
        self.clock = clock
        self.heartbeat = heartbeat
        self.host = host

    def progress_of(self, state: StepState) -> Callable[[Any], None]:
        """What ``StepContext.progress`` of the attempt ``state`` writes with."""
        def report(meta: Any) -> None:
            self.store.record_progress(state.run_id, state.step_name, state.attempt, meta,
                                       self.clock.now_ms())
        return report

    @property
    def worker(self) -> str | None:
        """``<host>:<pid>`` of the process claiming now (a prefork child, not its parent):
        ``host`` is a name, or a callable asked at each claim (a worker's Celery node name,
        ``w1@host``, learnt when it starts). The pid is what follows the last ``:``."""
        host = self.host() if callable(self.host) else self.host
        return None if host is None else f"{host}:{os.getpid()}"

    def claim(self, run_id: str, step_name: str, function: str | None,
              lease_ms: int, *, task_id: str | None = None,
              holding: list[HeldStep] | None = None,
              expected: object = None) -> Claimed | NotClaimed:
        """Claim the step (see the module docstring); ``expected``: the step as its message
        says it was recorded (``store.claim_step``). ``holding``: the caller's list, given
        the held attempt *before* the heartbeat renews it, so a caller whose ``finally``
        removes what it holds covers an exception landing anywhere after ``heartbeat.add``
        (an asynchronous one included), not only once this call has returned."""
        key = keys.step_lease_key(run_id, step_name)
        sent = time.monotonic()
        lease = self.leases.acquire(key, _holder(function), lease_ms)
        if lease is None:
            # A live worker holds it, or the step settled (its lease is left to lapse): a
            # duplicate delivery. A message naming another function is refused all the
            # same, from the function the holder claimed with (which its store claim
            # checked), without touching the store.
            self._refuse_another_function(run_id, step_name, key, function)
            return NotClaimed()
        self.clock.observe(lease.granted_at_ms, sent)
        try:
            # Within the lease it would grant: a claim stuck on a primary that stopped
            # answering would hold the worker slot until pymongo gives the node up. A claim
            # that timed out and landed all the same lapses, and the step is claimed again.
            with deadline(lease_ms / 1000):
                outcome = self.store.claim_step(run_id, step_name, function,
                                                lease.granted_at_ms, lease_ms,
                                                worker=self.worker, task_id=task_id,
                                                expected=expected)
        except BaseException:
            self.leases.release(lease)
            raise
        if outcome.state is None:
            self.leases.release(lease)
            return NotClaimed(wake_run=outcome.wake_run)
        return self._hold(outcome.state, lease_ms, lease, sent, holding)

    def claim_new(self, step: NewStep, lease_ms: int, *, seq: int,
                  holding: list[HeldStep], task_id: str | None = None
                  ) -> Claimed | NewClaim | None:
        """Record ``step`` already claimed by its first attempt, for a pass that runs it at
        once (``store.claim_new_step``): the step lease first, as for any claim, then one
        insert (and the run read after it). ``NewClaim`` when nothing was claimed (the step
        existed, or the run has ended); ``None`` when the step lease is held, which no new
        step's can be unless a forged message got there first: the caller records the step
        the usual way and lets the claims decide. ``holding`` as for ``claim``."""
        assert step.function is not None
        key = keys.step_lease_key(step.run_id, step.step_name)
        sent = time.monotonic()
        lease = self.leases.acquire(key, _holder(step.function), lease_ms)
        if lease is None:
            return None
        self.clock.observe(lease.granted_at_ms, sent)
        try:
            with deadline(lease_ms / 1000):
                outcome = self.store.claim_new_step(step, lease.granted_at_ms, lease_ms,
                                                    seq=seq, worker=self.worker,
                                                    task_id=task_id)
        except BaseException:
            self.leases.release(lease)
            raise
        if outcome.state is None or not outcome.created:
            self.leases.release(lease)
            return outcome
        return self._hold(outcome.state, lease_ms, lease, sent, holding)

    def _hold(self, state: StepState, lease_ms: int, lease: Lease, sent: float,
              holding: list[HeldStep] | None) -> Claimed:
        held = HeldStep(state.run_id, state.step_name, state.attempt, lease_ms, lease,
                        held_until=sent + lease_ms / 1000)
        if holding is not None:
            holding.append(held)
        try:
            self.heartbeat.add(held)
        except BaseException:
            # ``add`` registers the step before it starts its thread: a thread that cannot
            # start must not leave the step registered with no caller to remove it.
            self.heartbeat.remove(held)
            raise
        return Claimed(state, held)

    def _refuse_another_function(self, run_id: str, step_name: str, key: str,
                                 function: str | None) -> None:
        current = self.leases.get(key)
        if current is None or ":" not in current.holder:
            return
        claimed_as = current.holder.split(":", 1)[1]
        if claimed_as != _function_tag(function):
            raise WorkflowStepFunctionMismatchError(run_id, step_name, claimed_as or None,
                                                    function)

    def succeed(self, claimed: Claimed, result: Any) -> StepState:
        """Record the result; ``WorkflowStepSupersededError`` if the attempt lost the step,
        ``InvalidInputError`` (nothing written) if it can never be stored."""
        succeeded = self.checked(claimed, result)
        return self._settle(claimed, lambda now: self.store.set_result(
            claimed.state.run_id, claimed.state.step_name, claimed.state.attempt, result, now,
            claimed_data=claimed.state.data),
            landed=lambda s: s.status == "succeeded" and s.result == succeeded.stored)

    def checked(self, claimed: Claimed, result: Any) -> Succeeded:
        """``result`` checked storable, its settle not written yet; ``InvalidInputError``
        if it can never be stored. Either way the attempt stays held (its lease renewed)
        until its outcome is written: the caller records the failure (``fail``), and a check
        of a large result, then that write, must not outlast the lease unrenewed (another
        worker would claim the step meanwhile, and its failure be refused)."""
        check_step_document(claimed.state.step_name, claimed.state.data, result=result)
        return Succeeded(claimed, result, as_stored(result))

    def settle_then_claim(self, succeeded: Succeeded, step: NewStep, lease_ms: int, *,
                          seq: int, holding: list[HeldStep], task_id: str | None = None
                          ) -> Claimed | NewClaim | None:
        """Write ``succeeded``'s result and claim ``step`` (``claim_new``) in one round trip
        (``store.settle_and_claim_new``); returns what ``claim_new`` would return for
        ``step``. ``WorkflowStepSupersededError`` when the attempt lost its step (nothing
        written). Should the write fail otherwise, the settle is made alone, as ``succeed``
        makes it, and the step is left to be recorded as usual (``None``)."""
        claimed = succeeded.claimed
        held = claimed.held
        sent = time.monotonic()
        try:
            lease = self.leases.acquire(keys.step_lease_key(step.run_id, step.step_name),
                                        _holder(step.function), lease_ms)
        except Exception:
            lease = None  # Redis cannot gate the next step: settle alone, send it as usual
        if lease is None:
            self.succeed(claimed, succeeded.result)
            return None
        self.clock.observe(lease.granted_at_ms, sent)
        held.settling = True  # a beat racing the write must not call the refusal a loss
        try:
            with deadline(held.held_until - time.monotonic()):
                outcome = self.store.settle_and_claim_new(
                    claimed.state.run_id, claimed.state.step_name, claimed.state.attempt,
                    succeeded.result, lease.granted_at_ms, step, lease_ms, seq=seq,
                    worker=self.worker, task_id=task_id)
        except WorkflowStepSupersededError:
            self._release_quietly(lease)
            held.mark_lost("superseded at settle")
            self._let_go(held)
            raise
        except Exception:
            # An outage, or a document refused (this result or the next step's data: the
            # settle alone tells which, and the next step's insert fails on its own).
            self._release_quietly(lease)
            self.succeed(claimed, succeeded.result)
            return None
        self._let_go(held, release=False)  # settled for good: its Redis lease lapses
        if outcome.state is None or not outcome.created:
            self._release_quietly(lease)
            return outcome
        return self._hold(outcome.state, lease_ms, lease, sent, holding)

    def settle_then_insert(self, succeeded: Succeeded, steps: list[NewStep], now_ms: int, *,
                           seq: int, end_mark: bool = False
                           ) -> list[tuple[StepState, bool]] | None:
        """Write ``succeeded``'s result and insert ``steps`` (what the workflow reached with
        it) in one round trip (``store.settle_and_insert_steps``, with the run's end mark
        when ``end_mark``); returns what ``store.insert_steps`` would.
        ``WorkflowStepSupersededError`` when the attempt lost its step (nothing written).
        Should the write fail otherwise, the settle is made alone, as ``succeed`` makes it,
        and ``None`` says the steps are still to insert (and the mark still to write)."""
        claimed = succeeded.claimed
        held = claimed.held
        held.settling = True  # a beat racing the write must not call the refusal a loss
        try:
            with deadline(held.held_until - time.monotonic()):
                recorded = self.store.settle_and_insert_steps(
                    claimed.state.run_id, claimed.state.step_name, claimed.state.attempt,
                    succeeded.result, now_ms, steps, seq=seq, end_mark=end_mark)
        except WorkflowStepSupersededError:
            held.mark_lost("superseded at settle")
            self._let_go(held)
            raise
        except Exception:
            # An outage, or a document refused (this result or a step's data: the settle
            # alone tells which, and the steps' insert fails on its own).
            self.succeed(claimed, succeeded.result)
            return None
        self._let_go(held, release=False)  # settled for good: its Redis lease lapses
        return recorded

    def _release_quietly(self, lease: Lease) -> None:
        with contextlib.suppress(Exception):  # unreleased, it lapses
            self.leases.release(lease)

    def fail(self, claimed: Claimed, error: dict[str, Any], retry_delay_ms: int, *,
             final: bool = False) -> StepState:
        """Record the failure; with attempts left (and not ``final``) the next is due after
        the delay."""
        def write(now: int) -> StepState:
            return self.store.set_error(
                claimed.state.run_id, claimed.state.step_name, claimed.state.attempt, error,
                now, retry_at_ms=now + retry_delay_ms, final=final,
                claimed_data=claimed.state.data)
        # An error too large to store raises here with the attempt still held: the caller
        # records a smaller one at once (``execution._record_failure``).
        check_step_document(claimed.state.step_name, claimed.state.data, error=error)
        stored = as_stored(error)
        return self._settle(claimed, write,
                            landed=lambda s: s.status == "failed" and s.error == stored)

    def _settle(self, claimed: Claimed, write: Any,
                landed: Callable[[StepState], bool]) -> StepState:
        """The fenced write, retried while MongoDB is unreachable, and recognising a write
        that landed but whose reply was lost.

        Retries end at the deadline the lease had when the settle began: the heartbeat
        keeps renewing meanwhile (an outage shorter than the lease must not cost the
        attempt), but it must not move the end of the retries, or a write that can never
        succeed would hold the step, and the worker slot, forever. A write the store calls
        impossible (``InvalidInputError``: a document MongoDB refuses) is not retried."""
        held = claimed.held
        held.settling = True  # a beat racing the write must not call the refusal a loss
        deadline_s = held.held_until
        delay_s = 0.1
        release = True
        try:
            while True:
                try:
                    # Each try ends by the lease's deadline (a stalled primary must not
                    # hold the worker); a try that timed out is retried like an outage.
                    with deadline(deadline_s - time.monotonic()):
                        state: StepState = write(self.clock.now_ms())
                    # Settled for good, the step can never be claimed again: its Redis
                    # lease is left to lapse by itself (a Redis command saved per step; a
                    # duplicate delivery meanwhile stops at it, as it would at the store).
                    # A retry to come needs it free.
                    release = not settled_for_good(state)
                    return state
                except WorkflowStepSupersededError:
                    # Refused: this attempt lost the step, or an earlier write of this
                    # same outcome landed unseen (its reply lost, in this call or in an
                    # earlier one that gave up: a pass's combined write, a settle made
                    # again after the pass failed). Only the store can tell which.
                    recorded = self._landed(claimed, landed)
                    if recorded is not None:
                        return recorded
                    held.mark_lost("superseded at settle")
                    raise
                except (InvalidInputError, LeaseLostError):
                    raise
                except Exception:
                    if held.lost.is_set() or time.monotonic() + delay_s >= deadline_s:
                        raise
                    time.sleep(delay_s)
                    delay_s = min(delay_s * 2, 2.0)
        finally:
            self._let_go(held, release=release)

    def _let_go(self, held: HeldStep, *, release: bool = True) -> None:
        """Stop renewing ``held`` and (with ``release``) free its Redis lease; the store
        lease is left to the settle that follows (or to lapse, for the reaper)."""
        self.heartbeat.remove(held)
        if release:
            # A failed release is harmless: the lease lapses by itself.
            with contextlib.suppress(Exception):
                self.leases.release(held.lease)

    def _landed(self, claimed: Claimed, landed: Callable[[StepState], bool]
                ) -> StepState | None:
        """After a write was refused: did an earlier try of it land after all? Compared
        with the value as stored (a tuple comes back a list)."""
        with deadline(claimed.held.held_until - time.monotonic()):
            state = self.store.get_step(claimed.state.run_id, claimed.state.step_name)
        if state is not None and state.attempt == claimed.state.attempt and landed(state):
            return state
        return None
