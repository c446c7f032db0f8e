"""What a settle and a claim send back. A step's data is written once, when the step is
recorded, and its attempts' history only grows; an attempt has its data from its claim. A
reply that carries them again moves a large step's data twice per attempt (the claim, then
the settle) and a retried step's whole history with every write: on a slow link an 8 MiB
step's settle outlasted its lease (docs/reliability.md, seed 20261206). A settle told the
data its claim returned leaves it out of MongoDB's reply and gives it back from there; no
reply carries the history. What the calls return is unchanged, on every store."""

from __future__ import annotations

from typing import Any

import pytest

from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import STEP_FAILED, STEP_SUCCEEDED, StepState
from pikku_celery.store.base import WorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.contract.test_store import FN, LEASE, T0, add_step, new_run

DATA = {"order": 7, "blob": "x" * 200_000, "lines": [[1, 2], {"sku": "a"}]}
ERROR = {"type": "ValueError", "message": "declined"}


class _Replies:
    """The step collection, recording every document a ``find_one_and_update`` returns."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.replies: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def find_one_and_update(self, *args: Any, **kwargs: Any) -> Any:
        doc = self._real.find_one_and_update(*args, **kwargs)
        if doc is not None:
            self.replies.append(dict(doc))  # as it came, before the store adds to it
        return doc


def _claimed(store: WorkflowStore, run_id: str, at: int = T0) -> StepState:
    state = store.claim_step(run_id, "charge", FN, at, LEASE).state
    assert state is not None
    return state


def _retried_once(store: WorkflowStore) -> tuple[str, StepState]:
    """A step with a large data whose first attempt failed and second is claimed: its
    history has two entries."""
    run_id = new_run(store)
    add_step(store, run_id, data=DATA, retries=3)
    first = _claimed(store, run_id)
    store.set_error(run_id, "charge", first.attempt, ERROR, T0 + 1, retry_at_ms=T0 + 2)
    return run_id, _claimed(store, run_id, T0 + 3)


@pytest.mark.parametrize("outcome", ["result", "error", "final error"])
def test_a_settle_told_its_data_returns_what_one_not_told_returns(
        store: WorkflowStore, outcome: str) -> None:
    """On every store: the same state back (data included) whether or not the settle was
    told the data its claim returned."""
    got = []
    for told in (False, True):
        run_id, claimed = _retried_once(store)
        data = {"claimed_data": claimed.data} if told else {}
        if outcome == "result":
            state = store.set_result(run_id, "charge", claimed.attempt, {"ok": (1, 2)},
                                     T0 + 4, **data)
        else:
            state = store.set_error(run_id, "charge", claimed.attempt, ERROR, T0 + 4,
                                    retry_at_ms=T0 + 5, final=outcome == "final error",
                                    **data)
        assert state.data == DATA
        assert state == store.get_step(run_id, "charge")
        got.append((state.status, state.result, state.error, state.due_at, state.attempt))
    assert got[0] == got[1]
    assert got[0][0] == (STEP_SUCCEEDED if outcome == "result" else STEP_FAILED)


@pytest.mark.parametrize("outcome", ["result", "error"])
def test_mongodb_leaves_the_data_and_the_history_out_of_a_settles_reply(
        mongo_store: MongoWorkflowStore, outcome: str) -> None:
    run_id, claimed = _retried_once(mongo_store)
    steps = _Replies(mongo_store._steps)
    mongo_store._steps = steps
    if outcome == "result":
        state = mongo_store.set_result(run_id, "charge", claimed.attempt, 1, T0 + 4,
                                       claimed_data=claimed.data)
    else:
        state = mongo_store.set_error(run_id, "charge", claimed.attempt, ERROR, T0 + 4,
                                      retry_at_ms=T0 + 5, claimed_data=claimed.data)
    (reply,) = steps.replies
    assert S.DATA not in reply and S.ATTEMPTS not in reply, sorted(reply)
    assert state.data == DATA  # given back from the claim's


def test_mongodb_leaves_the_history_out_of_a_claims_reply(
        mongo_store: MongoWorkflowStore) -> None:
    """A claim returns the data (the body's input), never the history."""
    run_id, _ = _retried_once(mongo_store)
    steps = _Replies(mongo_store._steps)
    mongo_store._steps = steps
    state = mongo_store.claim_step(run_id, "charge", FN, T0 + 3 + LEASE + 1, LEASE).state
    assert state is not None and state.data == DATA and state.attempt == 3
    assert steps.replies and all(S.ATTEMPTS not in reply for reply in steps.replies)
    assert len(mongo_store.get_history(run_id)) == 3  # the history itself is all there


def test_a_settle_not_told_its_data_still_returns_it_from_mongodb(
        mongo_store: MongoWorkflowStore) -> None:
    """Callers that do not pass the data (the public store API as before) lose nothing."""
    run_id, claimed = _retried_once(mongo_store)
    state = mongo_store.set_result(run_id, "charge", claimed.attempt, 1, T0 + 4)
    assert state.data == DATA


def test_a_failed_attempts_settle_moves_no_data_back_on_mongodb(
        mongo_store: MongoWorkflowStore) -> None:
    """Through the engine: a step whose body raises, as the oversized step's attempts end
    (its result refused, a short error recorded). Its claim returns the data, its
    failure's write does not, and the run fails with the error."""
    from celery import Celery

    from pikku_celery import InMemoryLeaseService, PikkuCelery
    from pikku_celery.worker.inline import InlineDispatcher

    steps = _Replies(mongo_store._steps)
    mongo_store._steps = steps
    pikku = PikkuCelery(Celery("settle-replies", broker="memory://"), worker_reaper=False)
    engine = pikku.make_engine(store=mongo_store, leases=InMemoryLeaseService())

    @pikku.step(name="replies.refuse")
    def refuse(data: Any) -> Any:
        raise ValueError("declined")

    @pikku.workflow("replies.flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("refuse", refuse, DATA)

    dispatcher = InlineDispatcher(engine)
    engine.dispatcher = dispatcher
    run_id = engine.create_run("replies.flow", None)[0].run_id
    dispatcher.wake_run(run_id)
    for _ in range(20):
        if not dispatcher.do_next():
            break
    assert engine.get_run(run_id).status == "failed"
    failed = [r for r in steps.replies if r.get(S.STATUS) == STEP_FAILED]
    assert failed and all(S.DATA not in r for r in failed), [sorted(r) for r in failed]
    assert engine.get_steps(run_id)[0].data == DATA  # stored whole all the same
