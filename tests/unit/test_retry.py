"""``pikku.retry`` (issue 25 item 2), driven as workers would run it (in-memory store and
leases; ``tests.unit.test_in_place.Worker`` delivers every message): a run that failed
after a bug runs again from where it stopped once the bug is fixed; a cancelled run runs on;
a failed child run is retried with its parent; a run in any other status is refused."""

from __future__ import annotations

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


def test_a_retry_an_election_cut_short_is_finished_by_calling_it_again(
        mongo_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On MongoDB a retry is several writes, the run made live first. An election that
    interrupted the call after that write (the chaos harness's full profile with
    partitions) left the run live with its failed step not reopened: calling again, as an
    application should after pymongo's error, returned False, and the run failed again with
    the stored error. Calling again now finishes the retry."""
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
    fixed = {"yet": False}

    @pikku.step(name="rt.cut", retries=0)
    def cut(data: Any) -> str:
        if not fixed["yet"]:
            raise RuntimeError("the bug")
        return "done"

    @pikku.workflow("rt.cutflow")
    def cutflow(wf: Any, data: Any) -> str:
        return str(wf.do("only", cut, data))

    def deliver() -> None:
        sent = 0
        while sent < len(recorder.steps):
            function, rid, step_name = recorder.steps[sent]
            sent += 1
            pikku.engine.execute_step(pikku.registry.steps[function], rid, step_name)

    try:
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

        assert pikku.retry(run_id)  # called again: the retry is finished
        pikku.engine.advance(run_id)
        deliver()
        run = pikku.get_run(run_id)
        assert (run.status, run.output) == ("completed", "done")
        assert not pikku.retry(run_id)
    finally:
        client.drop_database(db.name)
