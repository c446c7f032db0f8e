"""A delivered step hands its settle to the pass after it (issue 34 item 1): the pass's first
write carries it (the next steps' insert: ``settle_and_insert_steps``, one command), and
what must hold wherever that goes wrong. In one process on the in-memory store and leases,
every step sent as a message (``in_place_steps=0``), delivered in order by ``Worker``.

- the settle and the next step's insert are one store call; the step's own ``set_result``
  is never called when the pass has something to insert;
- the settle refused (the attempt was superseded while its body ran): the next step, reached
  with the unrecorded result, is never inserted, the delivery raises
  ``WorkflowStepSupersededError``, and the run goes on from the attempt that won;
- another pass holds the run: the settle is written before the mark is left again, so the
  holder cannot read the step unsettled and miss it;
- a gather's calls settling while another pass holds the run: once a call found it held,
  the next calls of the process write their settle first and leave one mark each (not a
  mark, the settle, and the mark again);
- the combined write fails (MongoDB out): the settle is written alone and the next step
  inserted as usual;
- a pass with nothing to write (the run waits on another branch): the settle is written
  alone when the pass ends;
- a settle refused when the pass ends (it wrote nothing after it): the pass replays from the
  store before it hands the run lease on, so neither its view nor its note holds the result
  the store does not.
"""

from __future__ import annotations

from typing import Any

import pytest

from pikku_celery import WorkflowStepSupersededError
from pikku_celery.model import keys
from pikku_celery.model.views import ALL
from pikku_celery.store.memory import InMemoryWorkflowStore
from tests.unit.test_in_place import FAR, _app, stalling_step


def _sending(pikku: Any) -> None:
    pikku.engine.settings = type(pikku.engine.settings)(
        **{**vars(pikku.engine.settings), "in_place_steps": 0})


class _Calls(InMemoryWorkflowStore):
    """The in-memory store, noting the step writes the engine makes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.fail_combined = False

    def set_result(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("set_result")
        return super().set_result(*args, **kwargs)

    def insert_steps(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("insert_steps")
        return super().insert_steps(*args, **kwargs)

    def settle_and_insert_steps(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("settle_and_insert_steps" + ("+end_mark" if kwargs.get("end_mark")
                                                       else ""))
        if self.fail_combined:
            raise ConnectionError("MongoDB out")
        return super().settle_and_insert_steps(*args, **kwargs)

    def transition_run(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("transition_run" + ("(marked)" if kwargs.get("marked") else ""))
        return super().transition_run(*args, **kwargs)


def _chain(pikku: Any, steps: int = 3) -> None:
    @pikku.step(name="hs.inc")
    def inc(n: int) -> int:
        return n + 1

    @pikku.workflow("hs.count")
    def count(wf: Any, n: int) -> int:
        for i in range(steps):
            n = wf.do(f"s{i}", inc, n)
        return n


def _gather(pikku: Any, workflow: str, prefix: str) -> None:
    """``workflow``: a gather of three calls (``<prefix>0``..``<prefix>2``) echoing 0, 1, 2."""

    @pikku.step(name=f"{workflow}.echo")
    def echo(n: int) -> int:
        return n

    @pikku.workflow(workflow)
    def gathered(wf: Any, data: Any) -> int:
        return sum(wf.gather(*[wf.call(f"{prefix}{i}", echo, i) for i in range(3)]))


def test_a_delivered_step_settles_with_the_next_steps_insert() -> None:
    store = _Calls()
    pikku, _, worker = _app(store)
    _sending(pikku)
    _chain(pikku)
    run_id = pikku.start("hs.count", 0)
    worker.drain()
    assert pikku.get_run(run_id).output == 3
    assert worker.sent == ["s0", "s1", "s2"]
    # s0's insert by the first pass; s0 and s1 settle with the next insert; s2, the last,
    # settles with the mark of the run's end, which the end's write then does not repeat.
    assert store.calls == ["insert_steps", "settle_and_insert_steps",
                           "settle_and_insert_steps", "settle_and_insert_steps+end_mark",
                           "transition_run(marked)"], store.calls
    history = [(h.step_name, h.attempt, h.status, h.result)
               for h in pikku.get_history(run_id)]
    assert history == [(f"s{i}", 1, "succeeded", i + 1) for i in range(3)]


def test_a_refused_handed_settle_inserts_nothing_reached_with_its_result() -> None:
    pikku, store, worker = _app()
    _sending(pikku)

    run: dict[str, str] = {}
    first = stalling_step(pikku, store, "hs.first", run)

    @pikku.step(name="hs.second")
    def second(value: str) -> str:
        return f"after {value}"

    @pikku.workflow("hs.pair")
    def pair(wf: Any, tag: str) -> str:
        return str(wf.do("b", second, wf.do("a", first, tag)))

    run_id = run["id"] = pikku.start("hs.pair", "stall", run_id="hs-pair")
    with pytest.raises(WorkflowStepSupersededError):
        worker.drain()
    steps = {s.step_name: s for s in pikku.get_steps(run_id)}
    assert set(steps) == {"a"}, steps  # nothing reached with attempt 1's result
    assert (steps["a"].status, steps["a"].attempt) == ("running", 2)
    store.set_result(run_id, "a", 2, "attempt-2", FAR + 1)
    worker.queue.append(("run", run_id, "a"))
    worker.drain()
    run = pikku.get_run(run_id)
    assert (run.status, run.output) == ("completed", "after attempt-2")


def test_with_the_run_held_elsewhere_the_settle_lands_before_the_mark() -> None:
    """The holder must not find the mark while the step is still running in the store: it
    would read it unsettled, pause, and hand the lease back with nobody left to pass."""
    pikku, store, worker = _app()
    _sending(pikku)
    _chain(pikku, steps=2)
    leases = pikku.engine.leases
    key = keys.run_lease_key("hs-held")
    seen: list[str] = []
    marking = leases.acquire_or_mark

    def acquire_or_mark(k: str, holder: str, ttl_ms: int, mark: str) -> Any:
        if k == key and mark == "s0":
            step = store.get_step("hs-held", "s0")
            assert step is not None
            seen.append(step.status)
            if len(seen) == 1:  # the first try finds the run held by another pass
                held = leases.acquire(k, "another-pass", 60_000)
                assert held is not None
                got = marking(k, holder, ttl_ms, mark)
                leases.release(held)
                return got
        return marking(k, holder, ttl_ms, mark)

    leases.acquire_or_mark = acquire_or_mark  # type: ignore[method-assign]
    run_id = pikku.start("hs.count", 0, run_id="hs-held")
    worker.drain()
    assert seen == ["running", "succeeded"], seen  # the second mark after the settle
    worker.queue.append(("run", run_id, None))  # what the holder's hand-back would wake
    worker.drain()
    assert pikku.get_run(run_id).output == 2


def test_calls_of_a_run_found_held_settle_first_and_mark_once() -> None:
    """Issue 34 item 3: the first call of the gather finds the run held (mark, settle, mark
    again); the next two, in the same process a moment later, settle before their one
    mark, and the holder finds each settled."""
    pikku, store, worker = _app()
    _sending(pikku)

    _gather(pikku, "hs.wide", "c")

    leases = pikku.engine.leases
    key = keys.run_lease_key("hs-wide")
    marks: list[tuple[str, str]] = []
    marking = leases.acquire_or_mark

    def acquire_or_mark(k: str, holder: str, ttl_ms: int, mark: str) -> Any:
        if k == key and mark != ALL:
            step = store.get_step("hs-wide", mark)
            assert step is not None
            marks.append((mark, step.status))
        return marking(k, holder, ttl_ms, mark)

    leases.acquire_or_mark = acquire_or_mark  # type: ignore[method-assign]
    run_id = pikku.start("hs.wide", None, run_id="hs-wide")
    kind, _, _ = worker.queue.popleft()  # the start's pass: it sends the three calls
    assert kind == "run"
    pikku.engine.advance(run_id)
    held = leases.acquire(key, "another-pass", 60_000)  # a pass elsewhere holds the run
    assert held is not None
    steps = [item for item in worker.queue if item[0] == "step"]
    worker.queue.clear()  # the watch a first mark sends is left out: the holder is alive
    for _, _, step_name in steps:
        assert step_name is not None
        pikku.engine.execute_step(pikku.engine.registry.steps["hs.wide.echo"], run_id,
                                  step_name)
    assert marks == [("c0", "running"), ("c0", "succeeded"), ("c1", "succeeded"),
                     ("c2", "succeeded")], marks
    leases.release(held)
    worker.queue.append(("run", run_id, None))  # what the holder's hand-back would wake
    worker.drain()
    assert pikku.get_run(run_id).output == 3
    assert [s.status for s in pikku.engine.get_steps(run_id)] == ["succeeded"] * 3


def test_a_settle_refused_before_the_mark_keeps_the_processs_view() -> None:
    """The settle-first path (the run found held a moment ago) writes the settle before it
    touches the run lease; refused there, it leaves the process's view of the run as it
    was, so the next pass reads what changed, not the whole run again."""
    pikku, store, worker = _app()
    _sending(pikku)

    run: dict[str, str] = {}
    first = stalling_step(pikku, store, "hs.first", run)

    @pikku.workflow("hs.one")
    def one(wf: Any, tag: str) -> str:
        return str(wf.do("a", first, tag))

    run_id = run["id"] = pikku.start("hs.one", "stall", run_id="hs-one")
    kind, _, _ = worker.queue.popleft()
    assert kind == "run"
    pikku.engine.advance(run_id)  # the first pass: this process now has a view of the run
    views = pikku.engine.passes.views
    assert views.workflow_of(run_id) == "hs.one"
    pikku.engine.passes.busy.found_held(run_id)  # as if a call had just found it held
    with pytest.raises(WorkflowStepSupersededError):
        worker.drain()
    assert views.workflow_of(run_id) == "hs.one"  # the view was put back


def test_a_failed_combined_write_settles_alone_and_inserts_as_usual() -> None:
    store = _Calls()
    store.fail_combined = True
    pikku, _, worker = _app(store)
    _sending(pikku)
    _chain(pikku, steps=2)
    run_id = pikku.start("hs.count", 0)
    worker.drain()
    assert pikku.get_run(run_id).output == 2
    # The last settle's write with the end's mark failed too: the settle alone, and the
    # end writes its mark itself.
    assert store.calls == ["insert_steps", "settle_and_insert_steps", "set_result",
                           "insert_steps", "settle_and_insert_steps+end_mark", "set_result",
                           "transition_run"], store.calls


def test_a_pass_with_nothing_to_write_settles_the_step_alone() -> None:
    store = _Calls()
    pikku, _, worker = _app(store)
    _sending(pikku)

    _gather(pikku, "hs.both", "b")

    run_id = pikku.start("hs.both", None)
    worker.drain()
    assert pikku.get_run(run_id).output == 3
    # The first two branches' passes write nothing (the gather still waits): each settles
    # alone. The last branch's pass ends the run: its settle carries the end's mark.
    assert store.calls == ["insert_steps", "set_result", "set_result",
                           "settle_and_insert_steps+end_mark", "transition_run(marked)"
                           ], store.calls


def test_a_settle_refused_at_the_end_of_its_pass_is_in_no_view_or_note() -> None:
    """The settle refused when the pass that carried it ends (the step was taken by another
    attempt): the view went on from attempt 1's result. Before the run lease is handed on
    (with a note of what the view holds), the pass replays from the store, so neither this
    process's view nor the note holds attempt 1's result, and the run goes on from attempt
    2's."""
    pikku, store, worker = _app()
    _sending(pikku)

    @pikku.step(name="hs.left", retries=1)
    def left(tag: str) -> str:
        if tag == "stall":
            assert store.claim_step(run_id, "l", "hs.left", FAR, 60_000).state is not None
        return f"{tag}-1"

    @pikku.step(name="hs.right")
    def right(tag: str) -> str:
        return tag

    @pikku.workflow("hs.pair2")
    def pair2(wf: Any, data: Any) -> str:
        got = wf.gather(wf.call("l", left, "stall"), wf.call("r", right, "r"))
        return "+".join(got)

    run_id = pikku.start("hs.pair2", None)
    with pytest.raises(WorkflowStepSupersededError):
        worker.drain()
    kept = pikku.engine.passes.views._views.get(run_id)  # type: ignore[attr-defined]
    assert kept is None or (kept.steps["l"].status, kept.steps["l"].attempt) == ("running", 2)
    note = pikku.engine.leases._notes.get(keys.run_lease_key(run_id))  # type: ignore[attr-defined]
    assert note is None or b"stall-1" not in note[1]
    store.set_result(run_id, "l", 2, "stall-2", FAR + 1)
    worker.queue.append(("run", run_id, "l"))
    worker.drain()
    run = pikku.get_run(run_id)
    assert (run.status, run.output) == ("completed", "stall-2+r")

