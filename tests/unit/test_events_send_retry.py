"""A send is one event per call, key or no key (issue 31: the full chaos profile kept one
event twice when an unkeyed send failed during a primary restart although its write had
landed, and its caller sent it again).

``pikku.send_event`` names its event by the call's own id and tries its store writes
again after a transient error (``events.SEND_DEADLINE_S``): a write that landed before
its answer was lost keeps the event once. Past the deadline it raises
``WorkflowEventNotSentError``, saying whether the event may have been kept. The faults
are injected here: a store whose first send lands and then raises ``AutoReconnect``
(memory and the real ``mongod``), and on ``mongod`` each of the send's own writes landing
and then failing, or a server never reached. A wake that fails after the event was kept
does not fail the send (the reaper wakes the run: ``test_events_wake_order``). The web
API answers 503 and ``pikku send`` one line, each saying whether it may have been kept."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from pymongo.errors import AutoReconnect, NotPrimaryError, ServerSelectionTimeoutError

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    MongoWorkflowStore,
    PikkuCelery,
    WorkflowEventNotSentError,
)
from pikku_celery.contrib._api import handle
from pikku_celery.engine import events as events_module
from pikku_celery.model.keys import EventField as E
from pikku_celery.model.keys import RunField as R
from tests.conftest import pooled_database
from tests.unit.test_cli import one_line_error, run_cli
from tests.unit.test_engine import Recorder
from tests.unit.test_engine_fencing import FakeClock


def _pikku(store: Any) -> PikkuCelery:
    pikku = PikkuCelery(Celery(f"send-{uuid.uuid4().hex[:6]}", broker="memory://"),
                        store=store, leases=InMemoryLeaseService(clock_ms=FakeClock()),
                        worker_reaper=False)
    pikku.engine.dispatcher = Recorder()

    @pikku.workflow("awaits_payment")
    def awaits_payment(wf: Any, data: Any) -> Any:
        return wf.wait_for_event("paid")

    return pikku


@pytest.fixture(params=["memory", "mongod"])
def pikku(request: pytest.FixtureRequest) -> Iterator[PikkuCelery]:
    if request.param == "memory":
        yield _pikku(InMemoryWorkflowStore())
        return
    with pooled_database(request.getfixturevalue("mongo_server")) as db:
        yield _pikku(MongoWorkflowStore(db))


@pytest.fixture
def mongo_pikku(mongo_server: Any) -> Iterator[PikkuCelery]:
    with pooled_database(mongo_server) as db:
        yield _pikku(MongoWorkflowStore(db))


@pytest.fixture
def short_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events_module, "SEND_DEADLINE_S", 0.3)


def _waiting(pikku: PikkuCelery) -> str:
    run_id = pikku.start("awaits_payment", None)
    pikku.engine.advance(run_id, Recorder())
    assert pikku.get_run(run_id).status == "suspended"
    return run_id


def _takes_it(pikku: PikkuCelery, run_id: str, payload: Any) -> None:
    """The run's wait takes the event, once: the run ends with its payload."""
    pikku.engine.advance(run_id, Recorder())
    run = pikku.get_run(run_id)
    assert (run.status, run.output) == ("completed", payload)


class LandsThenFails:
    """The engine's store, whose first ``send_event`` writes and then raises ``error``
    (its answer lost: a primary restart); ``fails`` sends raise it without writing."""

    def __init__(self, store: Any, error: Exception, *, lands: bool = True,
                 fails: int = 1) -> None:
        self.store, self.error, self.lands, self.fails = store, error, lands, fails
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def send_event(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > self.fails:
            return self.store.send_event(*args, **kwargs)
        if self.lands:
            self.store.send_event(*args, **kwargs)
        raise self.error


def test_a_send_whose_write_landed_before_its_error_keeps_one_event(
        pikku: PikkuCelery) -> None:
    run_id = _waiting(pikku)
    faulty = LandsThenFails(pikku.engine.store, AutoReconnect("primary stepped down"))
    pikku.engine.store = faulty
    event = pikku.send_event(run_id, "paid", {"amount": 12})
    assert faulty.calls == 2  # tried again, and the second try found the first's event
    assert [(e.seq, e.payload) for e in pikku.list_events(run_id)] == [(1, {"amount": 12})]
    assert event == pikku.list_events(run_id)[0]
    _takes_it(pikku, run_id, {"amount": 12})


def test_two_calls_are_two_events_and_a_key_is_one(pikku: PikkuCelery) -> None:
    run_id = _waiting(pikku)
    pikku.send_event(run_id, "note", 1)
    pikku.send_event(run_id, "note", 1)  # another call: another event
    pikku.engine.store = LandsThenFails(pikku.engine.store, NotPrimaryError("election"))
    pikku.send_event(run_id, "note", 2, key="k")
    pikku.send_event(run_id, "note", 3, key="k")  # a repeat of the key: the first stands
    assert [(e.seq, e.payload) for e in pikku.list_events(run_id)] == [(1, 1), (2, 1),
                                                                       (3, 2)]


def test_past_its_deadline_a_send_says_its_event_may_have_been_kept(
        pikku: PikkuCelery, short_deadline: None) -> None:
    run_id = _waiting(pikku)
    # Every try lands, and every answer is lost: the caller cannot know, and is told so.
    pikku.engine.store = LandsThenFails(pikku.engine.store, AutoReconnect("no primary"),
                                        fails=10**6)
    with pytest.raises(WorkflowEventNotSentError, match=r"it may have been kept") as info:
        pikku.send_event(run_id, "paid", {"amount": 12})
    assert info.value.may_be_kept and info.value.run_id == run_id
    # Kept once, however many tries landed.
    assert [e.payload for e in pikku.list_events(run_id)] == [{"amount": 12}]


# --- MongoDB: each of the send's writes failing ----------------------------------------------


class FailsOnce:
    """A collection whose first ``method`` call matching ``when`` raises ``error``, after
    it ran (``lands``) or without running (the command never reached a server)."""

    def __init__(self, collection: Any, method: str, when: Callable[[Any, Any], bool],
                 error: Exception, *, lands: bool = True, times: int = 1) -> None:
        self.collection, self.method, self.when = collection, method, when
        self.error, self.lands, self.left = error, lands, times

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.collection, name)
        if name != self.method:
            return real

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.left <= 0 or not self.when(*args[:2]):
                return real(*args, **kwargs)
            self.left -= 1
            if self.lands:
                real(*args, **kwargs)
            raise self.error
        return call


def _is_insert(doc: Any, _: Any = None) -> bool:
    return True


def _is_counter(query: Any, update: Any) -> bool:
    return R.EVENTS_SENT in update.get("$set", {})


def _is_place(query: Any, update: Any) -> bool:
    return E.SEQ in update.get("$set", {})


@pytest.mark.parametrize(("collection", "method", "when"), [
    ("_events", "insert_one", _is_insert),  # the placeless document
    ("_runs", "update_one", _is_counter),  # the write that keeps the event
    ("_events", "update_one", _is_place),  # the event's seq on its document
], ids=["insert", "counter", "place"])
def test_each_write_of_a_send_landing_then_failing_keeps_one_event(
        mongo_pikku: PikkuCelery, collection: str, method: str,
        when: Callable[[Any, Any], bool]) -> None:
    pikku = mongo_pikku
    run_id = _waiting(pikku)
    store = pikku.engine.store
    setattr(store, collection, FailsOnce(getattr(store, collection), method, when,
                                         AutoReconnect("connection closed")))
    pikku.send_event(run_id, "paid", {"amount": 12})
    assert [(e.seq, e.payload) for e in pikku.list_events(run_id)] == [(1, {"amount": 12})]
    assert store._events.count_documents({}) == 1  # no second document either
    _takes_it(pikku, run_id, {"amount": 12})


def test_a_send_that_never_reached_a_server_says_nothing_was_kept(
        mongo_pikku: PikkuCelery, short_deadline: None) -> None:
    pikku = mongo_pikku
    run_id = _waiting(pikku)
    store = pikku.engine.store
    store._runs = FailsOnce(store._runs, "update_one", _is_counter,
                            ServerSelectionTimeoutError("no primary"), lands=False,
                            times=10**6)
    with pytest.raises(WorkflowEventNotSentError, match=r"nothing was kept") as info:
        pikku.send_event(run_id, "paid", {"amount": 12})
    assert not info.value.may_be_kept
    assert pikku.list_events(run_id) == []
    store._runs = store._runs.collection
    pikku.send_event(run_id, "paid", {"amount": 13})  # sent again: delivered once
    _takes_it(pikku, run_id, {"amount": 13})


def test_a_send_whose_counter_write_had_no_answer_may_have_kept_it(
        mongo_pikku: PikkuCelery, short_deadline: None) -> None:
    pikku = mongo_pikku
    run_id = _waiting(pikku)
    store = pikku.engine.store
    store._runs = FailsOnce(store._runs, "update_one", _is_counter,
                            AutoReconnect("connection closed"), lands=False, times=10**6)
    with pytest.raises(WorkflowEventNotSentError, match=r"it may have been kept"):
        pikku.send_event(run_id, "paid", {"amount": 12})
    assert pikku.list_events(run_id) == []  # it was not, but the sender could not know


# --- what the caller is told -------------------------------------------------------------------


def test_a_wake_that_fails_after_the_event_was_kept_does_not_fail_the_send(
        pikku: PikkuCelery) -> None:
    run_id = _waiting(pikku)

    class WakeFails(Recorder):
        def wake_run(self, run_id: str, countdown_s: float = 0.0,
                     step_name: str | None = None) -> None:
            raise ConnectionError("broker down")

    pikku.engine.dispatcher = WakeFails()
    event = pikku.send_event(run_id, "paid", 5)  # kept: an error would have it sent twice
    assert pikku.list_events(run_id) == [event]
    assert pikku.engine.store.find_event_wakes(10**15, 10) == [event]  # the reaper's


def test_the_api_answers_503_with_whether_the_event_may_have_been_kept() -> None:
    def send() -> Any:
        raise WorkflowEventNotSentError("r-1", "paid", True, "the store kept failing")
    status, body = handle(send)
    assert status == 503
    assert body == {"error": "WorkflowEventNotSentError", "may_be_kept": True,
                    "message": "event 'paid' for run r-1 not sent (it may have been kept): "
                               "the store kept failing"}


def test_pikku_send_says_in_one_line_whether_the_event_may_have_been_kept(
        short_deadline: None) -> None:
    pikku = _pikku(InMemoryWorkflowStore())
    run_id = _waiting(pikku)
    pikku.engine.store = LandsThenFails(pikku.engine.store, AutoReconnect("no primary"),
                                        lands=False, fails=10**6)
    line = one_line_error(run_cli(pikku, "send", run_id, "paid", '{"amount": 12}'))
    assert line.startswith(f"Error: WorkflowEventNotSentError: event 'paid' for run {run_id} "
                           "not sent (it may have been kept): the store kept failing for "
                           "0.3 s; last: AutoReconnect"), line
