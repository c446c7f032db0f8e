"""The claim layer under infrastructure faults: a settle retried through an outage, a write
that landed but whose reply was lost, and a heartbeat racing a settle."""

from __future__ import annotations

import time
from typing import Any

import pytest

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore
from pikku_celery.engine.claims import Claimed, Claimer, NotClaimed
from pikku_celery.engine.heartbeat import Heartbeat
from pikku_celery.model import keys
from pikku_celery.model.clock import ServerClock
from pikku_celery.model.errors import (
    LeaseLostError,
    WorkflowStepFunctionMismatchError,
    WorkflowStepSupersededError,
)
from pikku_celery.store.base import NewRun, NewStep


class Outage(InMemoryWorkflowStore):
    """``set_result`` fails ``fail`` times: before writing, or (``lose_reply``) after."""

    def __init__(self, fail: int, lose_reply: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.lose_reply = lose_reply

    def set_result(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail > 0:
            self.fail -= 1
            if self.lose_reply:
                super().set_result(*args, **kwargs)
            raise ConnectionError("mongodb unreachable")
        return super().set_result(*args, **kwargs)


def _claimed(store: InMemoryWorkflowStore) -> tuple[Claimer, Claimed]:
    leases = InMemoryLeaseService()
    clock = ServerClock(leases)
    claimer = Claimer(store, leases, clock, Heartbeat(store, leases, clock), host="test")
    store.create_run(NewRun("run", "wf", None), leases.now_ms())
    store.insert_step(NewStep(run_id="run", step_name="s", function="f", max_attempts=2),
                      leases.now_ms())
    claimed = claimer.claim("run", "s", "f", 30_000)
    assert isinstance(claimed, Claimed)
    return claimer, claimed


def test_a_settle_is_retried_through_a_short_outage() -> None:
    store = Outage(fail=2)
    claimer, claimed = _claimed(store)
    state = claimer.succeed(claimed, "done")
    assert state.status == "succeeded" and state.result == "done"
    assert claimer.heartbeat.held() == []


def test_a_write_that_landed_with_its_reply_lost_counts_as_recorded() -> None:
    store = Outage(fail=1, lose_reply=True)
    claimer, claimed = _claimed(store)
    state = claimer.succeed(claimed, "done")
    assert state.status == "succeeded" and state.attempt == 1


def test_a_settle_made_again_after_one_that_gave_up_takes_its_landed_write() -> None:
    """Partition test, netem: a pass's settle landed with its reply lost, its retries gave up
    at the lease's deadline, and the settle was made again (the delivery writing what its
    pass left unwritten). The store refuses the new write, as the step is settled already:
    that must read as this attempt's outcome, not as the attempt superseded."""
    store = Outage(fail=10**6, lose_reply=True)
    claimer, claimed = _claimed(store)
    claimed.held.held_until = 0.0  # no time for a second try: the first call gives up
    with pytest.raises(ConnectionError):
        claimer.succeed(claimed, "done")
    store.fail = 0
    claimed.held.held_until = time.monotonic() + 30
    state = claimer.succeed(claimed, "done")
    assert (state.status, state.attempt, state.result) == ("succeeded", 1, "done")
    assert not claimed.held.lost.is_set()


def test_an_outage_longer_than_the_lease_gives_the_attempt_up() -> None:
    store = Outage(fail=10**6)
    claimer, claimed = _claimed(store)
    claimed.held.held_until = 0.0  # the last confirmed deadline has passed
    with pytest.raises(ConnectionError):
        claimer.succeed(claimed, "done")
    assert claimer.heartbeat.held() == []


def test_a_beat_racing_a_settle_neither_regrabs_the_lease_nor_calls_it_lost() -> None:
    store = InMemoryWorkflowStore()
    claimer, claimed = _claimed(store)
    snapshot = claimer.heartbeat.held()  # a beat took its snapshot before the settle
    claimer.succeed(claimed, "done")
    claimer.heartbeat.beat(snapshot)
    left = claimer.leases.get(keys.step_lease_key("run", "s"))
    # Settled for good, the step keeps the grant it ran under until it lapses: the beat
    # took no new one.
    assert left is not None and (left.holder, left.token) == (
        claimed.held.lease.holder, claimed.held.lease.token)
    assert not claimed.held.lost.is_set()


def test_a_settled_steps_lease_is_left_to_lapse_a_retrying_ones_is_freed() -> None:
    store = InMemoryWorkflowStore()
    claimer, claimed = _claimed(store)
    key = keys.step_lease_key("run", "s")
    claimer.fail(claimed, {"type": "Boom", "message": "retry me"}, 0)
    assert claimer.leases.get(key) is None  # the next attempt must be able to claim it
    retried = claimer.claim("run", "s", "f", 30_000)
    assert isinstance(retried, Claimed) and retried.state.attempt == 2
    claimer.succeed(retried, "done")
    # Nothing can claim a settled step again: one Redis command saved, and a duplicate
    # delivery meanwhile stops at the lease, as it would at the store.
    assert claimer.leases.get(key) is not None
    assert claimer.claim("run", "s", "f", 30_000) == NotClaimed()


def test_the_worker_is_the_claiming_process() -> None:
    import os

    store = InMemoryWorkflowStore()
    claimer, claimed = _claimed(store)
    claimer.succeed(claimed, "done")
    assert [h.worker for h in store.get_history("run")] == [f"test:{os.getpid()}"]


# --- issue 13: mutants of the claim layer that no test noticed -----------------------------


class CountingStore(InMemoryWorkflowStore):
    """Counts the claims that reach the store."""

    def __init__(self) -> None:
        super().__init__()
        self.claims = 0

    def claim_step(self, *args: Any, **kwargs: Any) -> Any:
        self.claims += 1
        return super().claim_step(*args, **kwargs)


@pytest.mark.parametrize("same_process", [True, False])
def test_a_duplicate_delivery_stops_at_the_redis_gate(same_process: bool) -> None:
    """A second delivery of a step a live worker holds costs no store claim, and it leaves
    the holder's Redis lease alone (holder and token): releasing it would let a third
    delivery through the gate while the first still runs."""
    store = CountingStore()
    claimer, first = _claimed(store)
    if not same_process:  # another worker process: its own claimer, the same services
        claimer = Claimer(store, claimer.leases, claimer.clock,
                          Heartbeat(store, claimer.leases, claimer.clock), host="other")
    key = keys.step_lease_key("run", "s")
    holder = claimer.leases.get(key)
    assert holder is not None and store.claims == 1
    again = claimer.claim("run", "s", "f", 30_000)
    assert isinstance(again, NotClaimed) and not again.wake_run
    assert store.claims == 1, "a duplicate delivery reached the store"
    after = claimer.leases.get(key)
    assert after is not None and (after.holder, after.token) == (holder.holder, holder.token), (
        "the duplicate touched the live holder's Redis lease")
    assert first.held.lease.holder == holder.holder


class ActsOnRetry(InMemoryWorkflowStore):
    """The first settle fails as an outage does, and before the retry another writer acts
    on the step (``meanwhile``): a reclaim, a cancel."""

    def __init__(self) -> None:
        super().__init__()
        self.meanwhile: Any = None

    def _outage(self) -> None:
        act, self.meanwhile = self.meanwhile, None
        if act is not None:
            act()
            raise ConnectionError("mongodb unreachable")

    def set_result(self, *args: Any, **kwargs: Any) -> Any:
        self._outage()
        return super().set_result(*args, **kwargs)

    def set_error(self, *args: Any, **kwargs: Any) -> Any:
        self._outage()
        return super().set_error(*args, **kwargs)


def test_a_retried_settle_never_takes_a_newer_attempts_outcome_for_its_own() -> None:
    """Attempt 1's settle fails (outage); meanwhile its lease lapsed, attempt 2 ran and
    recorded the same result. The retry is refused, and the refusal must stand: attempt 1
    lost the step, it is not "the write that landed"."""
    store = ActsOnRetry()
    claimer, claimed = _claimed(store)
    far = claimer.leases.now_ms() + 10 * 30_000

    def another_worker_runs_attempt_2() -> None:
        state = InMemoryWorkflowStore.claim_step(store, "run", "s", "f", far, 30_000)
        assert state.state is not None and state.state.attempt == 2
        InMemoryWorkflowStore.set_result(store, "run", "s", 2, "done", far + 1)

    store.meanwhile = another_worker_runs_attempt_2
    with pytest.raises(WorkflowStepSupersededError) as info:
        claimer.succeed(claimed, "done")
    assert (info.value.attempt, info.value.current_attempt) == (1, 2)
    assert claimed.held.lost.is_set()


@pytest.mark.parametrize("outcome", ["result", "error"])
def test_a_retried_settle_never_takes_a_cancel_for_its_own_outcome(outcome: str) -> None:
    """Attempt 1's settle fails (outage); meanwhile the run was cancelled, which fails the
    step under the same attempt number. The retry is refused, and the refusal must stand:
    the step's failure is the cancel's, not this attempt's."""
    store = ActsOnRetry()
    claimer, claimed = _claimed(store)
    cancel = {"type": "WorkflowCancelledError", "message": "cancelled"}
    store.meanwhile = lambda: store.cancel_steps("run", cancel, claimer.leases.now_ms())
    with pytest.raises(WorkflowStepSupersededError):
        if outcome == "result":
            claimer.succeed(claimed, "done")
        else:
            claimer.fail(claimed, {"type": "ConnectionError", "message": "card api down"}, 0)
    step = store.get_step("run", "s")
    assert step is not None and (step.status, step.attempt, step.error) == ("failed", 1, cancel)


# --- survivors of ./dev mutate in the claim layer ------------------------------------------


def test_a_bound_body_sees_its_attempt_and_the_stable_invocation_id() -> None:
    from pikku_celery.engine.claims import StepContext

    store = InMemoryWorkflowStore()
    _, claimed = _claimed(store)
    ctx = StepContext(claimed.state, claimed.held)
    assert (ctx.run_id, ctx.step_name, ctx.attempt, ctx.max_attempts) == ("run", "s", 1, 2)
    assert ctx.invocation_id == keys.invocation_id("run", "s") == claimed.state.invocation_id
    assert ctx.wait_lost(0.01) is False and not ctx.lease_lost  # held: a short sleep
    claimed.held.mark_lost("superseded")
    assert ctx.wait_lost(30) is True and ctx.lease_lost  # wakes at once when lost
    with pytest.raises(LeaseLostError):
        ctx.check()
    unheld = StepContext(claimed.state, None)  # a body run with no lease to lose
    assert unheld.wait_lost(0.01) is False and not unheld.lease_lost



def test_a_body_is_told_its_lease_is_lost_once_unconfirmed_past_its_deadline() -> None:
    """A renewal stuck in a slow store call sets no event; the body must still learn its
    lease is gone once the last confirmed deadline passed (another worker may claim it)."""
    import time

    from pikku_celery.engine.claims import StepContext

    store = InMemoryWorkflowStore()
    _, claimed = _claimed(store)
    ctx = StepContext(claimed.state, claimed.held)
    claimed.held.held_until = time.monotonic() + 0.05  # no renewal will confirm it
    assert not ctx.lease_lost
    started = time.monotonic()
    assert ctx.wait_lost(30) is True  # wakes at the deadline, not after 30 s
    assert time.monotonic() - started < 5
    assert ctx.lease_lost
    with pytest.raises(LeaseLostError):
        ctx.check()
    claimed.held.held_until = time.monotonic() + 60  # a renewal confirmed it again
    assert not ctx.lease_lost and ctx.wait_lost(0.01) is False

def test_a_failure_is_due_again_after_its_retry_delay() -> None:
    store = InMemoryWorkflowStore()
    claimer, claimed = _claimed(store)
    before = claimer.leases.now_ms()
    state = claimer.fail(claimed, {"type": "ConnectionError", "message": "later"}, 60_000)
    assert state.status == "failed" and state.due_at is not None
    assert int(state.due_at.timestamp() * 1000) >= before + 59_000  # not at once (clock: ±1 s)
    assert store.claim_step("run", "s", "f", before + 59_000, 30_000).state is None


def test_a_stored_error_names_its_type_message_and_traceback() -> None:
    from pikku_celery.engine.claims import MAX_MESSAGE_CHARS, serialize_error

    try:
        raise ValueError("card declined")
    except ValueError as exc:
        error = serialize_error(exc)
    assert (error["type"], error["message"]) == ("ValueError", "card declined")
    assert error["traceback"].startswith("Traceback") and "ValueError: card declined" in (
        error["traceback"])
    long = serialize_error(RuntimeError("x" * (MAX_MESSAGE_CHARS + 10)))
    assert long["message"] == "x" * MAX_MESSAGE_CHARS + f"... [{MAX_MESSAGE_CHARS + 10} characters]"


class NoStoreClaims(InMemoryWorkflowStore):
    """Fails any claim that reaches it: what is refused must be refused before."""

    armed = False

    def claim_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            raise AssertionError("the claim reached the store")
        return super().claim_step(*args, **kwargs)


@pytest.mark.parametrize("settled", [False, True])
def test_a_message_naming_another_function_is_refused_at_the_held_lease(
        settled: bool) -> None:
    """A step held by a live worker, or settled (its lease left to lapse): a duplicate is
    ignored, a message naming another function is refused (invariant 8), neither touching
    the store."""
    store = NoStoreClaims()
    claimer, claimed = _claimed(store)
    if settled:
        claimer.succeed(claimed, "done")
    store.armed = True
    assert claimer.claim("run", "s", "f", 30_000) == NotClaimed()
    with pytest.raises(WorkflowStepFunctionMismatchError) as raised:
        claimer.claim("run", "s", "forged", 30_000)
    assert (raised.value.expected, raised.value.got) == ("f", "forged")
