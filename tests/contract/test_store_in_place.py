"""``claim_new_step``: the insert of a step a pass runs in place is the step's first claim.

On every store: the step is written exactly as a first claim of the pending step would leave
it (so everything after it, settles, renewals, the reaper, history, cannot tell the two
apart); a step that exists is returned untouched; and the insert is one side of the Dekker
pair with a run's end: landing on an ended run, it fences its own attempt and claims nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pikku_celery.model.errors import WorkflowStepSupersededError
from pikku_celery.model.records import RUN_CANCELLED, RUN_RUNNING, STEP_FAILED, STEP_RUNNING
from pikku_celery.store.base import NewStep, WorkflowStore
from tests.contract.test_store import FN, KINDS, LEASE, T0, _make_store, add_step, new_run


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    yield from _make_store(request)


def _step(run_id: str, name: str = "charge") -> NewStep:
    return NewStep(run_id=run_id, step_name=name, function=FN, data={"amount": 3},
                   max_attempts=3)


def test_the_insert_leaves_what_a_first_claim_leaves(store: WorkflowStore) -> None:
    run_id = new_run(store)
    got = store.claim_new_step(_step(run_id, "in-place"), T0, LEASE, seq=7, worker="w:1")
    # The same step recorded pending and claimed the usual way, for comparison.
    store.insert_steps([_step(run_id, "claimed")], T0, seq=7)
    usual = store.claim_step(run_id, "claimed", FN, T0, LEASE, worker="w:1").state
    assert got.created and got.run_status is None and got.state is not None and usual
    fields = ("status", "attempt", "max_attempts", "lease_expires_at", "data", "function",
              "result", "error", "due_at", "updated_at", "task_id", "retry_delay_ms")
    assert {f: getattr(got.state, f) for f in fields} == {f: getattr(usual, f) for f in fields}
    assert got.state.status == STEP_RUNNING and got.state.attempt == 1
    stored = store.get_step(run_id, "in-place")
    assert stored is not None and stored.status == STEP_RUNNING
    # Its history holds attempt 1, opened by the insert, as a claim opens it.
    history = [h for h in store.get_history(run_id) if h.step_name == "in-place"]
    assert [(h.attempt, h.status, h.worker) for h in history] == [(1, STEP_RUNNING, "w:1")]
    # A later pass reading what passes after token 6 recorded finds it.
    read = store.read_run(run_id, run=False, recorded_after=6)
    assert "in-place" in {s.step_name for s in read.steps}


def test_the_claimed_insert_settles_and_is_fenced_like_a_claim(store: WorkflowStore) -> None:
    run_id = new_run(store)
    claimed = store.claim_new_step(_step(run_id), T0, LEASE).state
    assert claimed is not None
    # A second claim of it finds a live lease: nothing.
    assert store.claim_step(run_id, "charge", FN, T0 + 1, LEASE).state is None
    # Once the lease lapsed the reaper's reclaim takes attempt 2, and attempt 1's settle is
    # refused.
    again = store.claim_step(run_id, "charge", FN, T0 + LEASE + 1, LEASE).state
    assert again is not None and again.attempt == 2
    with pytest.raises(WorkflowStepSupersededError):
        store.set_result(run_id, "charge", 1, "late", T0 + LEASE + 2)
    settled = store.set_result(run_id, "charge", 2, "ok", T0 + LEASE + 3)
    assert (settled.status, settled.result) == ("succeeded", "ok")


def test_an_existing_step_is_returned_untouched(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)  # recorded pending by a pass whose view the caller lacks
    before = store.get_step(run_id, "charge")
    got = store.claim_new_step(_step(run_id), T0 + 5, LEASE, worker="w:2")
    after = store.get_step(run_id, "charge")
    assert not got.created and got.state is not None and got.state.status == "pending"
    assert before == after


def test_an_insert_on_an_ended_run_fences_its_own_attempt(store: WorkflowStore) -> None:
    run_id = new_run(store)
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_CANCELLED, T0 + 1) is not None
    got = store.claim_new_step(_step(run_id), T0 + 2, LEASE, worker="w:3")
    assert got.created and got.state is None and got.run_status == RUN_CANCELLED
    fenced = store.get_step(run_id, "charge")
    assert fenced is not None and fenced.status == STEP_FAILED and fenced.due_at is None
    assert fenced.lease_expires_at is None
    assert fenced.error is not None and fenced.error["type"] == "WorkflowCancelledError"
    # A body that ran anyway could record nothing.
    with pytest.raises(WorkflowStepSupersededError):
        store.set_result(run_id, "charge", 1, "late", T0 + 3)


def test_only_a_pending_function_step_is_inserted_claimed(store: WorkflowStore) -> None:
    run_id = new_run(store)
    sleep = NewStep(run_id=run_id, step_name="nap", function=None, status="scheduled",
                    due_ms=T0 + 10)
    with pytest.raises(ValueError, match="nap"):
        store.claim_new_step(sleep, T0, LEASE)
    assert store.get_step(run_id, "nap") is None


def test_a_refused_end_leaves_the_run_live_for_steps_run_in_place(
        store: WorkflowStore) -> None:
    """A transition to an end that is refused (the run was not in the statuses it names)
    may leave the end's mark behind (MongoDB writes it first): a step inserted claimed
    after it reads the run, finds it live, and is claimed."""
    run_id = new_run(store)
    assert not store.transition_run(run_id, ["suspended"], "failed", T0 + 1)
    got = store.claim_new_step(_step(run_id), T0 + 2, LEASE)
    assert got.created and got.state is not None and got.state.status == STEP_RUNNING
    assert store.get_run(run_id).status == RUN_RUNNING  # type: ignore[union-attr]


def test_an_end_racing_the_insert_fences_the_step_it_reads(store: WorkflowStore) -> None:
    """The other order of the pair: the step inserted before the run's end is running
    when the end's fence reads the steps, and the fence takes it."""
    run_id = new_run(store)
    claimed = store.claim_new_step(_step(run_id), T0, LEASE).state
    assert claimed is not None
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_CANCELLED, T0 + 1)
    assert store.cancel_steps(run_id, {"type": "WorkflowCancelledError", "message": "x"},
                              T0 + 2) == 1
    with pytest.raises(WorkflowStepSupersededError):
        store.set_result(run_id, "charge", 1, "late", T0 + 3)


# --- a step's settle and the next step's claim, one command ----------------------------------


def test_the_settle_and_the_next_claim_land_together(store: WorkflowStore) -> None:
    run_id = new_run(store)
    first = store.claim_new_step(_step(run_id, "a"), T0, LEASE, worker="w").state
    assert first is not None
    got = store.settle_and_claim_new(run_id, "a", 1, {"ok": 1}, T0 + 5, _step(run_id, "b"),
                                     LEASE, seq=3, worker="w")
    assert got.created and got.state is not None and got.state.status == STEP_RUNNING
    settled = store.get_step(run_id, "a")
    assert settled is not None and (settled.status, settled.result) == ("succeeded", {"ok": 1})
    assert settled.lease_expires_at is None
    history = {(h.step_name, h.attempt): h.status for h in store.get_history(run_id)}
    assert history == {("a", 1): "succeeded", ("b", 1): STEP_RUNNING}


def test_a_superseded_settle_writes_nothing_and_claims_nothing(store: WorkflowStore) -> None:
    run_id = new_run(store)
    assert store.claim_new_step(_step(run_id, "a"), T0, LEASE).state is not None
    again = store.claim_step(run_id, "a", FN, T0 + LEASE + 1, LEASE).state  # the reaper's
    assert again is not None and again.attempt == 2
    before = store.get_step(run_id, "a")
    with pytest.raises(WorkflowStepSupersededError) as refused:
        store.settle_and_claim_new(run_id, "a", 1, "late", T0 + LEASE + 2, _step(run_id, "b"),
                                   LEASE)
    assert refused.value.current_attempt == 2
    assert store.get_step(run_id, "a") == before
    assert store.get_step(run_id, "b") is None


def test_the_settle_lands_when_the_next_step_exists(store: WorkflowStore) -> None:
    run_id = new_run(store)
    assert store.claim_new_step(_step(run_id, "a"), T0, LEASE).state is not None
    add_step(store, run_id, "b")  # recorded by a pass whose view the caller lacks
    got = store.settle_and_claim_new(run_id, "a", 1, 7, T0 + 1, _step(run_id, "b"), LEASE)
    assert not got.created and got.state is not None and got.state.status == "pending"
    assert store.get_step(run_id, "a").status == "succeeded"  # type: ignore[union-attr]


def test_the_next_claim_on_an_ended_run_fences_itself(store: WorkflowStore) -> None:
    run_id = new_run(store)
    assert store.claim_new_step(_step(run_id, "a"), T0, LEASE).state is not None
    # The run ended; its fence of the steps has not run yet.
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_CANCELLED, T0 + 1)
    got = store.settle_and_claim_new(run_id, "a", 1, 7, T0 + 2, _step(run_id, "b"), LEASE)
    assert got.created and got.state is None and got.run_status == RUN_CANCELLED
    fenced = store.get_step(run_id, "b")
    assert fenced is not None and fenced.status == STEP_FAILED
