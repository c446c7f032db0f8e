"""Engine behaviour through inline runs (the same code path as workers, minus the broker):
replay, fan-out, sleeps, children, compensation, cancellation, versions, run leases, the
read API and bad input. Numbers refer to upstream scenarios (upstream-semantics.md §7)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    InvalidInputError,
    LeaseLostError,
    LeaseTakenError,
    PikkuCelery,
    WorkflowNotFoundError,
    WorkflowRunNotFoundError,
    WorkflowStepSupersededError,
)
from pikku_celery.leases.base import Lease
from pikku_celery.model import keys
from pikku_celery.worker.tasks import internal_task
from tests.support.threads import ThreadsJoined


class Recorder:
    """A dispatcher that records what the engine asked for instead of sending messages."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, str, str]] = []
        self.wakes: list[tuple[str, float]] = []
        self.woken_for: list[str | None] = []  # the step each wake named, if any
        self.timers: list[tuple[str, str, int]] = []

    def dispatch_step(self, function: str, run_id: str, step_name: str) -> None:
        self.steps.append((function, run_id, step_name))

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        self.wakes.append((run_id, countdown_s))
        self.woken_for.append(step_name)

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        self.timers.append((run_id, step_name, due_ms))


@pytest.fixture
def pikku() -> Iterator[PikkuCelery]:
    app = Celery(f"test-{id(object())}", broker="memory://")
    yield PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                      worker_reaper=False)


def steps_of(pikku: PikkuCelery, run_id: str) -> dict[str, Any]:
    return {s.step_name: s for s in pikku.get_steps(run_id)}


def test_a_workflow_runs_inline_with_fan_out_sleep_child_and_loops(pikku: PikkuCelery) -> None:
    @pikku.step()
    def add(data: dict[str, int]) -> int:
        return data["a"] + data["b"]

    @pikku.workflow()
    def double(wf: Any, n: int) -> int:
        return int(wf.do("double", add, {"a": n, "b": n}))

    @pikku.workflow()
    def main(wf: Any, data: Any) -> dict[str, Any]:
        first = wf.do("sum", add, {"a": 1, "b": 2})
        left, right = wf.gather(wf.call("left", add, {"a": first, "b": 1}),
                                wf.call("right", add, {"a": first, "b": 2}))
        wf.sleep("nap", "20ms")
        loop = [wf.do("loop", add, {"a": i, "b": 0}) for i in range(3)]
        child = wf.child("kid", double, 21)
        return {"first": first, "left": left, "right": right, "loop": loop, "child": child}

    run_id = pikku.start(main, None, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "completed"
    assert run.output == {"first": 3, "left": 4, "right": 5, "loop": [0, 1, 2], "child": 42}
    names = set(steps_of(pikku, run_id))
    assert {"loop", "loop#2", "loop#3", "nap", "kid"} <= names  # 45: name#N per reach
    invocation_ids = {s.invocation_id for s in pikku.get_steps(run_id)}
    assert len(invocation_ids) == len(names)
    child_run = pikku.get_run(steps_of(pikku, run_id)["kid"].child_run_id)
    assert child_run.status == "completed" and child_run.parent_run_id == run_id


def test_39_retries_until_success_and_history_has_every_attempt(pikku: PikkuCelery) -> None:
    calls: list[int] = []

    @pikku.step(retries=3, retry_delay="1ms", bind=True)
    def flaky(ctx: Any, data: Any) -> str:
        calls.append(ctx.attempt)
        if ctx.attempt < 3:
            raise ConnectionError(f"try {ctx.attempt}")
        return "ok"

    @pikku.workflow()
    def wf_flaky(wf: Any, data: Any) -> Any:
        return wf.do("flaky", flaky)

    run_id = pikku.start(wf_flaky, None, inline=True)
    assert pikku.get_run(run_id).output == "ok"
    assert calls == [1, 2, 3]
    history = pikku.get_history(run_id)
    assert [(h.attempt, h.status) for h in history] == [(1, "failed"), (2, "failed"),
                                                         (3, "succeeded")]
    assert history[0].error is not None and history[0].error["message"] == "try 1"


def test_max_attempts_is_retries_plus_one_and_compensation_runs_once(pikku: PikkuCelery) -> None:
    runs: list[int] = []
    compensations: list[Any] = []

    @pikku.step(retries=2, retry_delay=0)
    def fails(data: Any) -> None:
        runs.append(1)
        raise ValueError("declined")

    @pikku.step()
    def undo(data: Any) -> str:
        compensations.append(data)
        return "undone"

    @pikku.workflow()
    def saga(wf: Any, data: Any) -> Any:
        return wf.do("charge", fails, {"amount": 5}, on_error=undo)

    run_id = pikku.start(saga, None, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "failed"
    assert run.error is not None and "declined" in run.error["message"]
    assert len(runs) == 3  # retries + 1
    assert len(compensations) == 1
    assert compensations[0]["data"] == {"amount": 5}
    assert compensations[0]["error"]["message"] == "declined"


def test_a_failed_step_with_attempts_left_pauses_the_run(pikku: PikkuCelery) -> None:
    """Upstream failed the whole run here if anything else woke the orchestrator."""
    recorder = Recorder()
    pikku.engine.dispatcher = recorder

    @pikku.step(retries=2, retry_delay="1h")
    def flaky(data: Any) -> None:
        raise ConnectionError("later")

    @pikku.workflow()
    def patient(wf: Any, data: Any) -> Any:
        return wf.do("flaky", flaky)

    run_id = pikku.start(patient, None)
    pikku.engine.advance(run_id)
    definition = pikku.registry.steps[flaky.name]
    pikku.engine.execute_step(definition, run_id, "flaky")
    assert pikku.engine.advance(run_id) == "waiting"  # a sibling's completion woke it
    assert pikku.get_run(run_id).status == "running"
    step = steps_of(pikku, run_id)["flaky"]
    assert step.status == "failed" and step.due_at is not None
    assert recorder.timers and recorder.timers[-1][:2] == (run_id, "flaky")


def test_12_a_run_leased_elsewhere_is_marked_for_its_holder_without_running_the_body(
        pikku: PikkuCelery) -> None:
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    ran: list[int] = []

    @pikku.workflow()
    def body(wf: Any, data: Any) -> None:
        ran.append(1)

    run_id = pikku.start(body, None)
    recorder.wakes.clear()
    held = pikku.engine.leases.acquire(keys.run_lease_key(run_id), "someone", 60_000)
    assert held is not None
    with pytest.raises(LeaseTakenError):
        pikku.engine.advance(run_id, step_name="s")
    # The message is done with: no retry spent, nothing re-sent ...
    assert internal_task(pikku.app, "orchestrate").run(run_id) == "marked"
    assert ran == [] and pikku.get_run(run_id).status == "running"
    # ... but one watch per grant: should the holder die, the run is looked at again once
    # its lease has lapsed.
    [(woken, countdown)] = recorder.wakes
    assert woken == run_id and 60 < countdown <= 62
    # The holder, handing the lease back, takes the marks and passes again instead.
    leases = pikku.engine.leases
    assert leases.release_or_take_marks(held, 60_000) == ("$all", "s")
    assert leases.release_or_take_marks(held, 60_000) == ()
    assert pikku.engine.advance(run_id) == "completed" and ran == [1]


def test_41_a_settled_runs_redelivered_wake_replays_nothing(pikku: PikkuCelery) -> None:
    calls: list[int] = []

    @pikku.workflow()
    def quick(wf: Any, data: Any) -> int:
        calls.append(1)
        return 1

    run_id = pikku.start(quick, None, inline=True)
    assert pikku.engine.advance(run_id) == "completed"
    assert calls == [1]  # the redelivery found the run ended and replayed nothing
    assert pikku.engine.leases.get(keys.run_lease_key(run_id)) is None  # and let go


class RefusingLeases(InMemoryLeaseService):
    """Grants leases but refuses every renewal and hand-back: the lease is lost once held."""

    def refresh(self, lease: Lease, ttl_ms: int) -> Lease | None:
        return None

    def release_or_take_marks(self, lease: Lease, ttl_ms: int, note: bytes | None = None,
                              *, announce: bool = False) -> tuple[str, ...] | None:
        return None

    def refresh_many(self, leases: Any) -> list[Lease | None]:
        return [None for _ in leases]


def test_11_an_inline_run_that_lost_its_lease_keeps_its_outcome() -> None:
    app = Celery("refusing", broker="memory://")
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=RefusingLeases(),
                        worker_reaper=False)

    @pikku.workflow()
    def done(wf: Any, data: Any) -> str:
        return "written"

    with pytest.raises(LeaseLostError):
        pikku.start(done, None, inline=True, run_id="r-11")
    run = pikku.get_run("r-11")
    assert run.status == "completed" and run.output == "written"


def test_start_with_a_run_id_is_idempotent(pikku: PikkuCelery) -> None:
    count: list[int] = []

    @pikku.step()
    def once(data: Any) -> int:
        count.append(1)
        return len(count)

    @pikku.workflow()
    def idem(wf: Any, data: Any) -> Any:
        return wf.do("once", once)

    first = pikku.start(idem, {"a": [1, 2]}, run_id="fixed", inline=True)
    second = pikku.start(idem, {"a": (1, 2)}, run_id="fixed", inline=True)  # stored equal
    assert first == second == "fixed"
    assert count == [1]
    assert pikku.get_run("fixed").input == {"a": [1, 2]}
    assert len(pikku.list_runs(workflow="idem")) == 1


def test_changed_step_order_under_a_running_run_fails_it_clearly(pikku: PikkuCelery) -> None:
    recorder = Recorder()
    pikku.engine.dispatcher = recorder

    @pikku.step()
    def a(data: Any) -> str:
        return "a"

    @pikku.step()
    def b(data: Any) -> str:
        return "b"

    version = {"first": a}

    @pikku.workflow()
    def evolving(wf: Any, data: Any) -> Any:
        return wf.do("first", version["first"])

    run_id = pikku.start(evolving, None)
    pikku.engine.advance(run_id)  # records step "first" as function a, in flight
    assert pikku.get_run(run_id).version == evolving.pikku_workflow.version  # type: ignore[attr-defined]
    version["first"] = b  # a deploy changed what the workflow reaches at "first"
    assert pikku.engine.advance(run_id) == "failed"
    error = pikku.get_run(run_id).error
    assert error is not None and error["type"] == "WorkflowReplayError"
    assert "code changed under a running run" in error["message"]


def test_cancel_fences_an_in_flight_step_and_tells_its_body(pikku: PikkuCelery) -> None:
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    started, release = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    @pikku.step(bind=True, lease="300ms")
    def long(ctx: Any, data: Any) -> str:
        started.set()
        release.wait(5)
        seen["lost_after_cancel"] = ctx.wait_lost(2.0)
        return "late"

    @pikku.workflow()
    def cancellable(wf: Any, data: Any) -> Any:
        return wf.do("long", long)

    run_id = pikku.start(cancellable, None)
    pikku.engine.advance(run_id)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            pikku.engine.execute_step(pikku.registry.steps[long.name], run_id, "long")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    assert started.wait(5)
    assert pikku.cancel(run_id, "customer asked")
    release.set()
    thread.join(10)
    assert seen["lost_after_cancel"] is True
    assert len(errors) == 1 and isinstance(errors[0], WorkflowStepSupersededError)
    run = pikku.get_run(run_id)
    assert run.status == "cancelled" and run.cancel_reason == "customer asked"
    assert steps_of(pikku, run_id)["long"].result is None
    assert not pikku.cancel(run_id)  # already settled


def test_cancel_reaches_child_runs(pikku: PikkuCelery) -> None:
    recorder = Recorder()
    pikku.engine.dispatcher = recorder

    @pikku.step()
    def never(data: Any) -> None:
        return None

    @pikku.workflow()
    def kid(wf: Any, data: Any) -> Any:
        return wf.do("never", never)

    @pikku.workflow()
    def parent(wf: Any, data: Any) -> Any:
        return wf.child("kid", kid)

    run_id = pikku.start(parent, None)
    pikku.engine.advance(run_id)
    child_id = steps_of(pikku, run_id)["kid"].child_run_id
    assert child_id and pikku.get_run(child_id).status == "running"
    pikku.cancel(run_id)
    assert pikku.get_run(child_id).status == "cancelled"


def test_read_api_and_bad_input(pikku: PikkuCelery) -> None:
    with pytest.raises(WorkflowNotFoundError, match="nope"):
        pikku.start("nope", None)
    with pytest.raises(WorkflowRunNotFoundError):
        pikku.get_run("missing")
    with pytest.raises(WorkflowRunNotFoundError):
        pikku.get_history("missing")
    with pytest.raises(InvalidInputError, match="retries"):
        pikku.step(retries=-1)(lambda data: data)
    with pytest.raises(ValueError, match="soon"):
        pikku.step(retry_delay="soon")(lambda data: data)
    with pytest.raises(InvalidInputError, match="malformed"):
        internal_task(pikku.app, "orchestrate").run(5)

    @pikku.workflow()
    def sleepy(wf: Any, data: Any) -> None:
        wf.sleep("nap", "whenever")

    run_id = pikku.start(sleepy, None, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "failed" and run.error is not None
    assert "whenever" in run.error["message"]
    assert pikku.get_steps(run_id) == []  # refused before any write

    @pikku.step()
    def anything(data: Any) -> None:
        return None

    @pikku.workflow()
    def bad_data(wf: Any, data: Any) -> None:
        wf.do("x", anything, {"$where": "1"})

    run_id = pikku.start(bad_data, None, inline=True)
    error = pikku.get_run(run_id).error
    assert error is not None and "$where" in error["message"]
    assert pikku.get_steps(run_id) == []


def test_wait_returns_terminal_runs_and_times_out_otherwise(pikku: PikkuCelery) -> None:
    pikku.engine.dispatcher = Recorder()

    @pikku.step()
    def slow(data: Any) -> None:
        return None

    @pikku.workflow()
    def waits(wf: Any, data: Any) -> Any:
        return wf.do("slow", slow)

    run_id = pikku.start(waits, None)
    with pytest.raises(TimeoutError, match=run_id):
        pikku.wait(run_id, 0.05)
    pikku.cancel(run_id)
    assert pikku.wait(run_id, 1).status == "cancelled"


def test_continue_in_place_replays_in_the_worker_instead_of_sending_a_wake() -> None:
    app = Celery("in-place", broker="memory://")
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        continue_in_place=True, worker_reaper=False)
    recorder = Recorder()
    pikku.engine.dispatcher = recorder

    @pikku.step()
    def one(data: Any) -> int:
        return 1

    @pikku.workflow()
    def two_steps(wf: Any, data: Any) -> int:
        return int(wf.do("a", one)) + int(wf.do("b", one))

    run_id = pikku.start(two_steps, None)
    pikku.engine.advance(run_id)
    recorder.wakes.clear()
    definition = pikku.registry.steps[one.name]
    pikku.engine.execute_step(definition, run_id, "a")
    assert recorder.wakes == []  # no orchestrator message: the worker replayed the run
    assert [s[2] for s in recorder.steps] == ["a", "b"]
    # With the run lease held elsewhere, the worker leaves the holder a mark naming its step
    # (no message: the holder passes again before it lets go), and arms the one watch of
    # that grant, which looks at the run again should the holder die first.
    held = pikku.engine.leases.acquire(keys.run_lease_key(run_id), "other", 60_000)
    assert held is not None
    pikku.engine.execute_step(definition, run_id, "b")
    assert [countdown > 60 for _, countdown in recorder.wakes] == [True]
    assert pikku.engine.leases.release_or_take_marks(held, 60_000) == ("b",)
    assert pikku.engine.leases.release_or_take_marks(held, 60_000) == ()  # released
    assert pikku.engine.advance(run_id, step_name="b") == "completed"
    assert pikku.get_run(run_id).output == 2


def test_suspend_records_the_run_and_resume_continues_it(pikku: PikkuCelery) -> None:
    from pikku_celery.worker.inline import run_inline

    @pikku.step()
    def record(data: Any) -> Any:
        return data

    @pikku.workflow()
    def approval(wf: Any, data: Any) -> Any:
        before = wf.do("before", record, 1)
        wf.suspend("manager approval")
        return [before, wf.do("after", record, 2)]

    run_id = pikku.start(approval, None, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "suspended"
    assert pikku.engine.advance(run_id) == "waiting"  # replay after suspension is safe
    assert pikku.get_run(run_id).status == "suspended"
    assert "after" not in steps_of(pikku, run_id)
    pikku.engine.dispatcher = Recorder()
    assert pikku.resume(run_id)
    assert not pikku.resume(run_id)  # only a suspended run resumes
    assert run_inline(pikku.engine, run_id).output == [1, 2]
    assert pikku.reap() == {"events": 0, "slots": 0, "lapsed": 0, "due": 0, "stalled": 0}


# --- review findings --------------------------------------------------------------------


def test_a_cancel_landing_during_a_pass_fences_what_the_pass_created(pikku: PikkuCelery) -> None:
    recorder = Recorder()
    pikku.engine.dispatcher = recorder

    @pikku.step()
    def charge(data: Any) -> str:
        return "charged"

    @pikku.workflow()
    def racing(wf: Any, data: Any) -> Any:
        pikku.cancel(wf.run_id, "customer")  # lands after the pass read the steps
        return wf.do("charge", charge)

    run_id = pikku.start(racing, None)
    pikku.engine.advance(run_id)
    assert pikku.get_run(run_id).status == "cancelled"
    step = steps_of(pikku, run_id)["charge"]
    assert step.status == "failed" and step.error is not None
    outcome = pikku.engine.execute_step(pikku.registry.steps[charge.name], run_id, "charge")
    assert outcome.kind == "not_claimed"


class FlakyInsertStore(InMemoryWorkflowStore):
    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def insert_step(self, step: Any, now_ms: int) -> Any:
        if self.down:
            raise ConnectionError("mongodb unreachable")
        return super().insert_step(step, now_ms)

    def insert_steps(self, steps: Any, now_ms: int, *, seq: int = 0) -> Any:
        if self.down:
            raise ConnectionError("mongodb unreachable")
        return super().insert_steps(steps, now_ms, seq=seq)


def test_an_infrastructure_error_in_a_pass_leaves_the_run_retryable() -> None:
    store = FlakyInsertStore()
    pikku = PikkuCelery(Celery("flaky-store", broker="memory://"), store=store,
                        leases=InMemoryLeaseService(), worker_reaper=False)
    pikku.engine.dispatcher = Recorder()

    @pikku.step()
    def one(data: Any) -> int:
        return 1

    @pikku.workflow()
    def needs_db(wf: Any, data: Any) -> Any:
        try:
            return wf.do("one", one)
        except Exception:  # a body catching errors cannot turn an outage into a failure
            return "swallowed"

    run_id = pikku.start(needs_db, None)
    store.down = True
    with pytest.raises(ConnectionError):
        pikku.engine.advance(run_id)
    assert pikku.get_run(run_id).status == "running"
    store.down = False
    assert pikku.engine.advance(run_id) == "dispatched"  # "one" sent now


def test_a_child_whose_parent_missed_the_news_is_reported_again(pikku: PikkuCelery) -> None:
    recorder = Recorder()
    pikku.engine.dispatcher = recorder

    @pikku.workflow()
    def kid(wf: Any, data: Any) -> int:
        return 7

    @pikku.workflow()
    def parent(wf: Any, data: Any) -> Any:
        return wf.child("kid", kid)

    run_id = pikku.start(parent, None)
    pikku.engine.advance(run_id)
    child_id = steps_of(pikku, run_id)["kid"].child_run_id
    # The child ends, but the process dies before the parent is told.
    assert pikku.engine.store.transition_run(child_id, ["running"], "completed", 1, output=7)
    recorder.wakes.clear()
    assert pikku.engine.advance(child_id) == "completed"  # a redelivered child message
    assert steps_of(pikku, run_id)["kid"].result == 7
    assert recorder.wakes == [(run_id, 0.0)]


def test_steps_left_behind_by_a_finished_run_are_fenced(pikku: PikkuCelery) -> None:
    pikku.engine.dispatcher = Recorder()

    @pikku.step()
    def never_waited(data: Any) -> None:
        return None

    @pikku.workflow()
    def leaves_work(wf: Any, data: Any) -> str:
        wf.call("orphan", never_waited)
        return "done"

    run_id = pikku.start(leaves_work, None)
    assert pikku.engine.advance(run_id) == "completed"
    orphan = steps_of(pikku, run_id)["orphan"]
    assert orphan.status == "failed" and orphan.error["type"] == "WorkflowRunEnded"
    assert pikku.reap() == {"events": 0, "slots": 0, "lapsed": 0, "due": 0, "stalled": 0}


def test_resume_racing_a_suspending_pass_leaves_the_run_resumable(pikku: PikkuCelery) -> None:
    from pikku_celery.worker.inline import run_inline

    @pikku.workflow()
    def gate(wf: Any, data: Any) -> str:
        wf.suspend("approval")
        return "through"

    pikku.engine.dispatcher = Recorder()
    run_id = pikku.start(gate, None)
    assert not pikku.resume(run_id)  # still running: nothing to resume, no gate opened
    pikku.engine.advance(run_id)
    assert pikku.get_run(run_id).status == "suspended"
    assert pikku.resume(run_id)
    assert run_inline(pikku.engine, run_id).output == "through"


def test_a_suspend_in_a_loop_suspends_every_time(pikku: PikkuCelery) -> None:
    from pikku_celery.worker.inline import run_inline

    @pikku.workflow()
    def reviews(wf: Any, data: Any) -> int:
        for _ in range(2):
            wf.suspend("review")
        return 2

    run_id = pikku.start(reviews, None, inline=True)
    pikku.engine.dispatcher = Recorder()
    assert pikku.resume(run_id)
    assert run_inline(pikku.engine, run_id).status == "suspended"  # the second round waits
    assert pikku.resume(run_id)
    assert run_inline(pikku.engine, run_id).status == "completed"


def test_public_reads_refuse_operator_ids(pikku: PikkuCelery) -> None:
    for call in (lambda: pikku.get_run({"$gt": ""}), lambda: pikku.cancel({"$gt": ""}),
                 lambda: pikku.resume({"$gt": ""}), lambda: pikku.get_steps({"$gt": ""})):
        with pytest.raises(InvalidInputError, match="run id"):
            call()
    run_id = pikku.start(pikku.workflow("noop")(lambda wf, data: wf.sleep("s", "1h")), None)
    with pytest.raises(InvalidInputError, match="reason"):
        pikku.cancel(run_id, {"why": 1})  # type: ignore[arg-type]
    assert pikku.get_run(run_id).status == "running"  # refused before any write


def test_55_concurrent_passes_on_one_run_never_overlap(pikku: PikkuCelery) -> None:
    """Seven orchestrators arrive while a pass is inside the workflow body (held there by
    an event, not a sleep): every one is turned away, and none runs the body meanwhile."""
    pikku.engine.dispatcher = Recorder()
    inside: list[int] = []
    overlaps: list[int] = []
    entered, release = threading.Event(), threading.Event()

    @pikku.workflow()
    def contended(wf: Any, data: Any) -> None:
        if inside:
            overlaps.append(1)
        inside.append(1)
        entered.set()
        release.wait(30)
        inside.pop()
        wf.sleep("wait", "1h")

    run_id = pikku.start(contended, None)
    outcomes: list[str] = []

    def orchestrate() -> None:
        try:
            outcomes.append(pikku.engine.advance(run_id))
        except LeaseTakenError:
            outcomes.append("taken")

    with ThreadsJoined() as threads:
        threads.start(orchestrate)
        assert entered.wait(30), "the first pass never reached the body"
        contenders = ThreadsJoined()
        with contenders:
            for _ in range(7):
                contenders.start(orchestrate)
        release.set()
    assert overlaps == []
    assert sorted(outcomes) == ["taken"] * 7 + ["waiting"]  # on the sleep's timer


def test_58_a_poisoned_shard_does_not_rerun_its_healthy_siblings(pikku: PikkuCelery) -> None:
    runs: dict[int, int] = {}

    @pikku.step(retries=1, retry_delay=0)
    def shard(n: int) -> int:
        runs[n] = runs.get(n, 0) + 1
        if n == 3:
            raise ValueError("poisoned shard")
        return n * n

    @pikku.workflow()
    def fan_out(wf: Any, data: Any) -> Any:
        return wf.gather(*[wf.call(f"shard-{n}", shard, n) for n in range(5)])

    run_id = pikku.start(fan_out, None, inline=True)
    run = pikku.get_run(run_id)
    assert run.status == "failed" and "poisoned shard" in run.error["message"]
    assert runs == {0: 1, 1: 1, 2: 1, 3: 2, 4: 1}  # the poisoned one used both attempts
    assert all(s.status == "succeeded" for s in pikku.get_steps(run_id)
               if s.step_name != "shard-3")


def test_no_retry_for_fails_the_step_at_the_first_such_error(pikku: PikkuCelery) -> None:
    class Declined(Exception):
        pass

    calls: list[int] = []

    @pikku.step(retries=5, retry_delay=0, no_retry_for=(Declined,))
    def charge(data: Any) -> None:
        calls.append(1)
        raise Declined("card declined")

    @pikku.workflow()
    def pay(wf: Any, data: Any) -> Any:
        return wf.do("charge", charge)

    run_id = pikku.start(pay, None, inline=True)
    assert pikku.get_run(run_id).status == "failed"
    assert calls == [1]
    with pytest.raises(InvalidInputError, match="no_retry_for"):
        pikku.step(no_retry_for=("ValueError",))(lambda data: data)  # type: ignore[arg-type]


def test_the_run_lease_lasts_run_lease_not_a_thousand_times_more(pikku: PikkuCelery) -> None:
    """Regression (found by the demo in CI): the pass held the run lease with a TTL in
    milliseconds read as seconds, so a worker killed mid-pass stranded its run for 8 hours."""
    seen: list[int] = []

    @pikku.workflow()
    def looks(wf: Any, data: Any) -> None:
        lease = pikku.engine.leases.get(keys.run_lease_key(wf.run_id))
        assert lease is not None
        seen.append(lease.expires_at_ms - lease.granted_at_ms)

    pikku.start(looks, None, inline=True)
    assert seen and 0 < seen[0] <= pikku.engine.settings.run_lease_ms
