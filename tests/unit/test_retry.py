"""``pikku.retry`` (issue 25 item 2), driven as workers would run it (in-memory store and
leases; ``tests.unit.test_in_place.Worker`` delivers every message): a run that failed
after a bug runs again from where it stopped once the bug is fixed; a cancelled run runs on;
a failed child run is retried with its parent; a run in any other status is refused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pikku_celery.model.errors import WorkflowRunNotFoundError
from tests.unit.test_in_place import _app


def test_a_failed_run_runs_again_from_where_it_stopped() -> None:
    pikku, _, worker = _app()
    fixed = {"yet": False}
    ran: list[str] = []

    @pikku.step(name="rt.first")
    def first(data: Any) -> str:
        ran.append("first")
        return "one"

    @pikku.step(name="rt.second", retries=0)
    def second(data: Any) -> str:
        ran.append("second")
        if not fixed["yet"]:
            raise RuntimeError("the bug")
        return f"{data} two"

    @pikku.workflow("rt.flow")
    def flow(wf: Any, data: Any) -> str:
        return str(wf.do("b", second, wf.do("a", first, data)))

    run_id = pikku.start("rt.flow", None)
    worker.drain()
    assert pikku.get_run(run_id).status == "failed"
    assert ran == ["first", "second"]  # its one attempt spent
    fixed["yet"] = True
    assert pikku.retry(run_id)
    worker.drain()
    run = pikku.get_run(run_id)
    assert (run.status, run.output, run.error) == ("completed", "one two", None)
    assert ran == ["first", "second", "second"]  # a is replayed, not run again
    history = [(h.step_name, h.attempt, h.status) for h in pikku.get_history(run_id)]
    assert history == [("a", 1, "succeeded"), ("b", 1, "failed"), ("b", 2, "succeeded")]
    assert not pikku.retry(run_id)  # completed: nothing to retry


def test_a_cancelled_run_runs_on_after_a_retry() -> None:
    pikku, _, worker = _app()

    @pikku.step(name="rt.echo")
    def echo(data: Any) -> Any:
        return data

    @pikku.workflow("rt.pair")
    def pair(wf: Any, data: Any) -> list[Any]:
        return [wf.do("a", echo, 1), wf.do("b", echo, 2)]

    run_id = pikku.start("rt.pair", None)
    assert pikku.cancel(run_id, "by mistake")  # before any worker took it
    worker.drain()
    assert pikku.get_run(run_id).status == "cancelled"
    assert pikku.retry(run_id)
    worker.drain()
    assert pikku.get_run(run_id).output == [1, 2]


def test_a_failed_child_is_retried_with_its_parent() -> None:
    pikku, _, worker = _app()
    fixed = {"yet": False}

    @pikku.step(name="rt.inner", retries=0)
    def inner(data: Any) -> str:
        if not fixed["yet"]:
            raise RuntimeError("inner bug")
        return "inner ok"

    @pikku.workflow("rt.child")
    def child(wf: Any, data: Any) -> str:
        return str(wf.do("x", inner, data))

    @pikku.workflow("rt.parent")
    def parent(wf: Any, data: Any) -> str:
        return f"parent got {wf.child('kid', 'rt.child', data)}"

    run_id = pikku.start("rt.parent", None)
    worker.drain()
    assert pikku.get_run(run_id).status == "failed"
    kid = next(s for s in pikku.get_steps(run_id) if s.step_name == "kid")
    assert kid.child_run_id and pikku.get_run(kid.child_run_id).status == "failed"
    fixed["yet"] = True
    assert pikku.retry(run_id)
    worker.drain()
    assert pikku.get_run(kid.child_run_id).status == "completed"
    assert pikku.get_run(run_id).output == "parent got inner ok"


def test_retrying_a_running_or_unknown_run() -> None:
    pikku, _, _ = _app()
    pikku.workflow("rt.idle")(lambda wf, data: wf.sleep("nap", "1h"))
    run_id = pikku.start("rt.idle", None)
    assert not pikku.retry(run_id)
    with pytest.raises(WorkflowRunNotFoundError):
        pikku.retry("no-such-run")


def test_a_fork_replays_the_steps_before_its_step_and_runs_the_rest() -> None:
    pikku, _, worker = _app()
    ran: list[str] = []

    @pikku.step(name="rt.work")
    def work(name: str) -> str:
        ran.append(name)
        return f"{name} done"

    @pikku.workflow("rt.three")
    def three(wf: Any, data: Any) -> list[str]:
        return [wf.do("a", work, "a"), wf.do("b", work, "b"), wf.do("c", work, "c")]

    source = pikku.start("rt.three", None)
    worker.drain()
    assert ran == ["a", "b", "c"]
    forked = pikku.fork(source, from_step="b", new_run_id="forked-1")
    assert forked == "forked-1"
    worker.drain()
    assert pikku.get_run(forked).output == ["a done", "b done", "c done"]
    assert ran == ["a", "b", "c", "b", "c"]  # a was replayed from the copy
    assert pikku.fork(source, from_step="b", new_run_id="forked-1") == "forked-1"  # same run
    worker.drain()
    assert ran == ["a", "b", "c", "b", "c"]
    with pytest.raises(Exception, match="recorded no step 'z' to fork from; its steps: 'a'"):
        pikku.fork(source, from_step="z")


MongoApp = tuple[Any, Any, Callable[[], None]]


@pytest.fixture
def mongo_app(mongo_server: Any) -> Iterator[MongoApp]:
    """pikku on the real mongod (a database of its own, dropped after) with in-memory
    leases, its messages recorded; ``deliver`` runs the steps sent since it last ran."""
    import uuid

    from celery import Celery

    from pikku_celery import InMemoryLeaseService, MongoWorkflowStore, PikkuCelery
    from tests.conftest import mongo_database
    from tests.unit.test_engine import Recorder

    db, client = mongo_database("mongod", mongo_server)
    store = MongoWorkflowStore(db)
    pikku = PikkuCelery(Celery(f"rt-{uuid.uuid4().hex[:6]}", broker="memory://"),
                        store=store, leases=InMemoryLeaseService(), worker_reaper=False)
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    delivered = [0]

    def deliver() -> None:
        while delivered[0] < len(recorder.steps):
            function, rid, step_name = recorder.steps[delivered[0]]
            delivered[0] += 1
            pikku.engine.execute_step(pikku.registry.steps[function], rid, step_name)

    yield pikku, store, deliver
    client.drop_database(db.name)


def _retry_cut_short(mongo_app: MongoApp, monkeypatch: pytest.MonkeyPatch
                     ) -> tuple[Any, str, Callable[[], None]]:
    """A run failed by a bug, the bug fixed, then a retry an election interrupted after its
    first write: the run is live, its failed step not reopened."""
    pikku, store, deliver = mongo_app
    fixed = {"yet": False}

    @pikku.step(name="rt.cut", retries=0)
    def cut(data: Any) -> str:
        if not fixed["yet"]:
            raise RuntimeError("the bug")
        return "done"

    @pikku.workflow("rt.cutflow")
    def cutflow(wf: Any, data: Any) -> str:
        return str(wf.do("only", cut, data))

    run_id = pikku.start("rt.cutflow", None)
    pikku.engine.advance(run_id)
    deliver()
    assert pikku.get_run(run_id).status == "failed"
    fixed["yet"] = True
    reopen = store._reopen_steps

    def election(run_id: str, now_ms: int) -> Any:
        raise TimeoutError("an election interrupted the call after its first write")
    monkeypatch.setattr(store, "_reopen_steps", election)
    with pytest.raises(TimeoutError):
        pikku.retry(run_id)
    monkeypatch.setattr(store, "_reopen_steps", reopen)
    assert pikku.get_run(run_id).status == "running"  # live, its step still failed
    return pikku, run_id, deliver


def test_a_retry_an_election_cut_short_is_finished_by_calling_it_again(
        mongo_app: MongoApp, monkeypatch: pytest.MonkeyPatch) -> None:
    """On MongoDB a retry is several writes, the run made live first. An election that
    interrupted the call after that write (the chaos harness's full profile with
    partitions) left the run live with its failed step not reopened: calling again, as an
    application should after pymongo's error, returned False, and the run failed again with
    the stored error. Calling again now finishes the retry."""
    pikku, run_id, deliver = _retry_cut_short(mongo_app, monkeypatch)

    assert pikku.retry(run_id)  # called again: the retry is finished
    pikku.engine.advance(run_id)
    deliver()
    run = pikku.get_run(run_id)
    assert (run.status, run.output) == ("completed", "done")
    assert not pikku.retry(run_id)


@pytest.mark.parametrize("ended", ["failed", "cancelled"])
def test_a_pass_between_a_retrys_two_writes_finishes_the_retry(
        mongo_app: MongoApp, monkeypatch: pytest.MonkeyPatch, ended: str) -> None:
    """Chaos, full profile (seed 20261210): a pass ran between a retry's first write (the
    run live) and its reopen of the steps, replayed the step the cancel had failed as the
    run's outcome, ran its compensation and failed the run again. A pass that finds the
    reopen owed now finishes it before it replays; so does one after a retry cut short
    there, with nobody calling the retry again."""
    pikku, store, deliver = mongo_app
    fixed = {"yet": False}
    compensated: list[Any] = []

    @pikku.step(name="rt.undo")
    def undo(data: Any) -> None:
        compensated.append(data)

    # Cancelled: its first attempt failed with a retry due in an hour, and the cancel's
    # fence failed it for good with the cancel's error (as in the chaos run).
    @pikku.step(name="rt.between", retries=0 if ended == "failed" else 1, retry_delay="1h")
    def between(data: Any) -> str:
        if not fixed["yet"]:
            raise RuntimeError("the bug")
        return "done"

    @pikku.workflow("rt.betweenflow")
    def betweenflow(wf: Any, data: Any) -> str:
        return str(wf.do("only", between, data, on_error=undo))

    run_id = pikku.start("rt.betweenflow", None)
    pikku.engine.advance(run_id)
    deliver()
    if ended == "cancelled":
        assert pikku.cancel(run_id, "by mistake")
    compensated.clear()
    assert pikku.get_run(run_id).status == ended
    fixed["yet"] = True
    reopen = store._reopen_steps

    def a_pass_lands_first(rid: str, now_ms: int) -> Any:
        monkeypatch.setattr(store, "_reopen_steps", reopen)  # once: the pass reopens too
        pikku.engine.advance(rid)  # a wake already queued, a timer, the sweep
        return reopen(rid, now_ms)
    monkeypatch.setattr(store, "_reopen_steps", a_pass_lands_first)
    assert pikku.retry(run_id)
    monkeypatch.setattr(store, "_reopen_steps", reopen)
    pikku.engine.advance(run_id)
    deliver()
    run = pikku.get_run(run_id)
    assert (run.status, run.output) == ("completed", "done"), run.error
    assert compensated == []


def test_a_retry_cut_short_is_finished_by_the_next_pass(
        mongo_app: MongoApp, monkeypatch: pytest.MonkeyPatch) -> None:
    pikku, run_id, deliver = _retry_cut_short(mongo_app, monkeypatch)
    assert pikku.engine.advance(run_id) != "failed"  # the next pass finishes the reopen
    deliver()
    pikku.engine.advance(run_id)
    run = pikku.get_run(run_id)
    assert (run.status, run.output) == ("completed", "done"), run.error
