"""Incremental replay (issue 11): what a pass reads, and that it never misses a change.

Two ``PikkuCelery`` instances on one store and one lease service stand for two worker
processes: each keeps its own views. Reads are counted through the store, so a test can
say what a pass read; each of the cases below fails without the handling it names.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from typing import Any

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.leases.base import Lease, LeaseBusy
from pikku_celery.model import keys
from pikku_celery.model.errors import LeaseTakenError
from pikku_celery.store.base import NewStep
from tests.support.threads import ThreadsJoined
from tests.unit.test_engine import Recorder

BLOCK: dict[str, Any] = {}


class CountingStore(InMemoryWorkflowStore):
    """Records what each ``read_run`` asked for and how many steps it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[dict[str, Any]] = []
        self.calls: Counter[str] = Counter()

    def read_run(self, run_id: str, **kw: Any) -> Any:
        read = super().read_run(run_id, **kw)
        self.reads.append({**kw, "returned": sorted(s.step_name for s in read.steps)})
        return read

    def cancel_steps(self, *args: Any, **kw: Any) -> int:
        self.calls["cancel_steps"] += 1
        return super().cancel_steps(*args, **kw)

    def touch_run(self, *args: Any, **kw: Any) -> Any:
        self.calls["touch_run"] += 1
        return super().touch_run(*args, **kw)


class Cluster:
    """``n`` processes (engines with views of their own) sharing a store and leases."""

    def __init__(self, n: int = 2, *, in_place: bool = False) -> None:
        self.store = CountingStore()
        self.leases = InMemoryLeaseService()
        self.processes = [PikkuCelery(Celery(f"p{i}", broker="memory://"), store=self.store,
                                      leases=self.leases, continue_in_place=in_place,
                                      worker_reaper=False) for i in range(n)]
        self.recorders = [Recorder() for _ in range(n)]
        for pikku, recorder in zip(self.processes, self.recorders, strict=True):
            pikku.engine.dispatcher = recorder
            self._declare(pikku)

    @staticmethod
    def _declare(pikku: PikkuCelery) -> None:
        @pikku.step(name="v.add")
        def add(n: int) -> int:
            return n + 1

        @pikku.step(name="v.box")
        def box(n: int) -> dict[str, Any]:
            return {"n": n, "seen": []}

        @pikku.workflow("v.chain")
        def chain(wf: Any, steps: int) -> int:
            n = 0
            for i in range(steps):
                n = wf.do(f"s{i}", add, n)
            return n

        @pikku.workflow("v.mutates")
        def mutates(wf: Any, data: Any) -> Any:
            boxed = wf.do("box", box, 1)
            boxed["seen"].append("changed by the workflow")  # the workflow's own copy
            wf.do("after", add, 0)
            return len(boxed["seen"])

        @pikku.workflow("v.slow")
        def slow(wf: Any, data: Any) -> int:
            if BLOCK.get("wait"):  # a pass that is slow to replay
                BLOCK["entered"].set()
                BLOCK["go"].wait(30)
            return int(wf.do("s1", add, wf.do("s0", add, 0)))

        @pikku.workflow("v.sleeps")
        def sleeps(wf: Any, data: Any) -> int:
            wf.call("later", add, 0)  # recorded, never awaited: left behind at the end
            return int(wf.do("now", add, 0))

    def run_step(self, process: int, run_id: str, step_name: str) -> Any:
        pikku = self.processes[process]
        return pikku.engine.execute_step(pikku.registry.steps["v.add"], run_id, step_name)

    def advance(self, process: int, run_id: str, step_name: str | None = None) -> str:
        return self.processes[process].engine.advance(run_id, step_name=step_name)


def test_a_pass_reads_only_the_step_that_settled() -> None:
    cluster = Cluster(1)
    run_id = cluster.processes[0].start("v.chain", 5)
    cluster.advance(0, run_id)  # the first pass reads the run in full (there is no view)
    assert cluster.store.reads[-1].get("all_steps")
    for i in range(5):
        cluster.run_step(0, run_id, f"s{i}")
        cluster.store.reads.clear()
        status = cluster.advance(0, run_id, f"s{i}")
        assert cluster.store.reads == [{"run": False, "input": False,
                                        "step_names": {f"s{i}"}, "recorded_after": None,
                                        "returned": [f"s{i}"]}]
    assert status == "completed" and cluster.processes[0].get_run(run_id).output == 5


def test_a_view_behind_another_processes_passes_catches_up_from_the_note() -> None:
    """Process 1 advanced the run twice since process 0's view. Its note carries every
    step it put since it began (cumulative, ``engine.handover``), so process 0 reads the
    run's document alone."""
    cluster = Cluster(2)
    run_id = cluster.processes[0].start("v.chain", 4)
    cluster.advance(0, run_id)
    cluster.run_step(0, run_id, "s0")
    cluster.advance(1, run_id, "s0")  # process 1 records s1
    cluster.run_step(1, run_id, "s1")
    cluster.advance(1, run_id, "s1")  # and s2
    cluster.run_step(0, run_id, "s2")
    cluster.store.reads.clear()
    assert cluster.advance(0, run_id, "s2") == "dispatched"  # process 0 records s3
    [read] = cluster.store.reads
    # The run's document and the step the mark names; nothing recorded after the view.
    assert read["run"] and read["recorded_after"] is None and read["returned"] == ["s2"]
    cluster.run_step(0, run_id, "s3")
    assert cluster.advance(1, run_id, "s3") == "completed"
    assert cluster.processes[1].get_run(run_id).output == 4


def test_a_view_behind_another_processes_passes_catches_up() -> None:
    """Process 1 advanced the run twice since process 0's view and its note is lost (Redis
    restarted, or a minute passed): the token says so, and process 0 reads the run, its
    unsettled steps and those recorded after its view."""
    cluster = Cluster(2)
    run_id = cluster.processes[0].start("v.chain", 4)
    cluster.advance(0, run_id)
    cluster.run_step(0, run_id, "s0")
    cluster.advance(1, run_id, "s0")  # process 1 records s1
    cluster.run_step(1, run_id, "s1")
    cluster.advance(1, run_id, "s1")  # and s2
    cluster.run_step(0, run_id, "s2")
    cluster.leases._notes.clear()  # type: ignore[attr-defined]
    cluster.store.reads.clear()
    assert cluster.advance(0, run_id, "s2") == "dispatched"  # process 0 records s3
    [read] = cluster.store.reads
    assert read["run"] and read["recorded_after"] is not None
    assert read["returned"] == ["s0", "s1", "s2"]  # not s0... of a full read: all changed
    cluster.run_step(0, run_id, "s3")
    assert cluster.advance(1, run_id, "s3") == "completed"
    assert cluster.processes[1].get_run(run_id).output == 4
    # Each step recorded once (two processes' clocks may order a millisecond differently).
    assert sorted(s.step_name for s in cluster.processes[0].get_steps(run_id)) == [
        "s0", "s1", "s2", "s3"]


def test_a_token_that_went_backwards_is_a_full_read() -> None:
    """Redis lost its counters (a restart): nothing the view knows can be trusted."""
    cluster = Cluster(1)
    run_id = cluster.processes[0].start("v.chain", 3)
    cluster.advance(0, run_id)
    cluster.run_step(0, run_id, "s0")
    cluster.advance(0, run_id, "s0")
    cluster.leases._tokens.clear()  # what a Redis restart does to the counters
    cluster.run_step(0, run_id, "s1")
    cluster.store.reads.clear()
    cluster.advance(0, run_id, "s1")
    assert cluster.store.reads[0].get("all_steps")


def test_a_pass_that_failed_leaves_no_view_behind() -> None:
    cluster = Cluster(1)
    run_id = cluster.processes[0].start("v.chain", 3)
    cluster.advance(0, run_id)
    cluster.run_step(0, run_id, "s0")
    original = cluster.store.insert_steps

    def down(*args: Any, **kw: Any) -> Any:
        raise ConnectionError("mongodb unreachable")

    cluster.store.insert_steps = down  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        cluster.advance(0, run_id, "s0")
    cluster.store.insert_steps = original  # type: ignore[method-assign]
    cluster.store.reads.clear()
    cluster.advance(0, run_id)
    assert cluster.store.reads[0].get("all_steps")  # the marks that pass took are lost with it
    assert {s.step_name for s in cluster.processes[0].get_steps(run_id)} == {"s0", "s1"}


def test_a_step_settled_during_a_pass_is_seen_before_the_holder_lets_go() -> None:
    """Process 1 settles s0 while process 0 is in a pass that read s0 as pending: the
    settle finds the run held and leaves a mark, sending nothing; process 0 takes the mark
    when it hands the lease back, passes again, reads s0 and records s1."""
    cluster = Cluster(2, in_place=True)
    run_id = cluster.processes[0].start("v.slow", None)
    cluster.advance(0, run_id)  # records s0
    BLOCK.update(wait=True, entered=threading.Event(), go=threading.Event())
    try:
        with ThreadsJoined() as threads:
            threads.start(lambda: cluster.advance(0, run_id, "unrelated"))
            assert BLOCK["entered"].wait(30)
            cluster.recorders[1].wakes.clear()
            cluster.run_step(1, run_id, "s0")  # in place: the run is held, so it marks
            BLOCK["wait"] = False
            BLOCK["go"].set()
    finally:
        BLOCK.clear()
    assert [countdown > 25 for _, countdown in cluster.recorders[1].wakes] == [True]
    assert [s[2] for s in cluster.recorders[0].steps] == ["s0", "s1"]  # no wake was needed


def test_a_holder_that_dies_with_marks_untaken_is_followed_by_its_watch() -> None:
    cluster = Cluster(1)
    run_id = cluster.processes[0].start("v.chain", 1)
    cluster.advance(0, run_id)
    cluster.run_step(0, run_id, "s0")
    key = keys.run_lease_key(run_id)
    dead = cluster.leases.acquire_or_mark(key, "dies mid-pass", 200, "$all")
    assert isinstance(dead, Lease)
    recorder = cluster.recorders[0]
    recorder.wakes.clear()
    with pytest.raises(LeaseTakenError):
        cluster.advance(0, run_id, "s0")
    [(woken, countdown)] = recorder.wakes
    assert woken == run_id and 0.2 <= countdown <= 1.3  # once the dead holder's lease lapsed
    give_up = time.monotonic() + 30  # the lease lapses (real time, 200 ms): never spin on
    while isinstance(cluster.leases.acquire_or_mark(key, "probe", 1, "$all"), LeaseBusy):
        assert time.monotonic() < give_up, "the dead holder's 200 ms lease never lapsed"
        time.sleep(0.005)
    cluster.leases.release_or_take_marks(cluster.leases.get(key) or dead, 1)
    assert cluster.advance(0, run_id) == "completed"  # what the watch's message does


def test_a_cancel_reaches_a_pass_that_trusts_its_view() -> None:
    """A pass with a current view reads no run document; the cancel's mark makes it read
    the run, so a step settled before the cancel does not get its successor dispatched."""
    cluster = Cluster(1)
    pikku = cluster.processes[0]
    run_id = pikku.start("v.chain", 3)
    cluster.advance(0, run_id)
    store = cluster.store
    settled = store.claim_step(run_id, "s0", "v.add", pikku.engine.now_ms(), 60_000).state
    assert settled is not None
    settled = store.set_result(run_id, "s0", 1, 1, pikku.engine.now_ms())
    pikku.cancel(run_id, "stop")
    recorder = cluster.recorders[0]
    recorder.steps.clear()
    assert pikku.engine.advance(run_id, step_name="s0", settled=settled) == "cancelled"
    assert recorder.steps == [] and "s1" not in {s.step_name for s in pikku.get_steps(run_id)}


def test_a_step_the_view_lacks_is_found_by_its_insert_and_replayed() -> None:
    """A step recorded behind the view's back (by a pass that had lost its lease, late):
    the batch insert returns it as stored, nothing is sent for it, and the pass runs again
    with its result."""
    cluster = Cluster(1)
    pikku = cluster.processes[0]
    run_id = pikku.start("v.chain", 3)
    cluster.advance(0, run_id)
    cluster.run_step(0, run_id, "s0")
    store = cluster.store
    now = pikku.engine.now_ms()
    store.insert_steps([NewStep(run_id, "s1", "v.add", data=1, max_attempts=4)], now, seq=0)
    store.claim_step(run_id, "s1", "v.add", now, 60_000)
    store.set_result(run_id, "s1", 1, 2, now)
    recorder = cluster.recorders[0]
    recorder.steps.clear()
    assert cluster.advance(0, run_id, "s0") == "dispatched"  # s2
    assert [s[2] for s in recorder.steps] == ["s2"]  # s1 was not sent again
    cluster.run_step(0, run_id, "s2")
    assert cluster.advance(0, run_id, "s2") == "completed"
    assert pikku.get_run(run_id).output == 3


def test_the_workflow_changing_a_result_does_not_change_the_next_replay() -> None:
    cluster = Cluster(1)
    pikku = cluster.processes[0]
    run_id = pikku.start("v.mutates", None)
    cluster.advance(0, run_id)
    pikku.engine.execute_step(pikku.registry.steps["v.box"], run_id, "box")
    cluster.advance(0, run_id, "box")
    cluster.run_step(0, run_id, "after")
    assert cluster.advance(0, run_id, "after") == "completed"
    assert pikku.get_run(run_id).output == 1  # every pass got its own copy of the result


def test_finish_skips_the_unsettled_query_only_when_none_is_left() -> None:
    cluster = Cluster(1)
    pikku = cluster.processes[0]
    done = pikku.start("v.chain", 1)
    cluster.advance(0, done)
    cluster.run_step(0, done, "s0")
    assert cluster.advance(0, done, "s0") == "completed"
    assert cluster.store.calls["cancel_steps"] == 0
    left = pikku.start("v.sleeps", None)
    cluster.advance(0, left)
    cluster.run_step(0, left, "now")
    assert cluster.advance(0, left, "now") == "completed"
    assert cluster.store.calls["cancel_steps"] == 1
    later = next(s for s in pikku.get_steps(left) if s.step_name == "later")
    assert later.status == "failed" and later.error["type"] == "WorkflowRunEnded"


def test_passes_touch_the_run_only_when_its_last_touch_is_half_the_stalled_window_old(
        ) -> None:
    cluster = Cluster(1)
    run_id = cluster.processes[0].start("v.chain", 3)
    cluster.advance(0, run_id)
    cluster.run_step(0, run_id, "s0")
    cluster.advance(0, run_id, "s0")
    assert cluster.store.calls["touch_run"] == 0  # the run was created just now
    view = cluster.processes[0].engine.passes.views.take(run_id)
    assert view is not None
    view.touched_ms -= 16_000  # more than half of stalled_after (30 s) ago
    cluster.processes[0].engine.passes.views.put(view)
    cluster.run_step(0, run_id, "s1")
    cluster.advance(0, run_id, "s1")
    assert cluster.store.calls["touch_run"] == 1


def test_a_fan_out_is_sent_on_one_producer() -> None:
    """The steps a pass records together are sent together (``Dispatcher.batch``: one
    producer for all, as a Celery group), a lone step as it is."""
    cluster = Cluster(1)
    pikku = cluster.processes[0]
    sent: list[tuple[str, bool]] = []
    recorder = cluster.recorders[0]
    inside = [False]

    @contextlib.contextmanager
    def batch() -> Any:
        inside[0] = True
        yield
        inside[0] = False

    def dispatch_step(function: str, run_id: str, step_name: str) -> None:
        sent.append((step_name, inside[0]))

    recorder.batch = batch  # type: ignore[attr-defined]
    recorder.dispatch_step = dispatch_step  # type: ignore[method-assign]

    @pikku.workflow("v.fan")
    def fan(wf: Any, data: Any) -> Any:
        add = pikku.registry.steps["v.add"]
        first = wf.do("first", add, 0)
        return wf.gather(*(wf.call(f"f{i}", add, first) for i in range(3)))

    run_id = pikku.start("v.fan", None)
    cluster.advance(0, run_id)
    cluster.run_step(0, run_id, "first")
    cluster.advance(0, run_id, "first")
    assert sent == [("first", False), ("f0", True), ("f1", True), ("f2", True)]


def test_the_redelivery_of_a_step_whose_worker_died_in_its_pass_makes_the_run_pass() -> None:
    """In place, the pass after a step runs inside the step's task: a worker killed there
    has settled the step but not told the run, and its message comes back. That delivery
    claims nothing, but passes (or marks the run), so the run does not wait for the
    stalled-run sweep; any other delivery that claims nothing does not."""
    cluster = Cluster(1, in_place=True)
    pikku = cluster.processes[0]
    run_id = pikku.start("v.chain", 2)
    cluster.advance(0, run_id)
    store, now = cluster.store, pikku.engine.now_ms()
    claimed = store.claim_step(run_id, "s0", "v.add", now, 60_000, task_id="task-1")
    assert claimed.state is not None
    store.set_result(run_id, "s0", 1, 1, now)  # ... and the worker died before its pass
    add = pikku.registry.steps["v.add"]
    # A re-dispatch under another task id stays cheap: no pass.
    assert pikku.engine.execute_step(add, run_id, "s0", task_id="task-2").kind == "settled"
    assert "s1" not in {s.step_name for s in pikku.get_steps(run_id)}
    # The settling delivery's own message, redelivered: the run hears of its step.
    assert pikku.engine.execute_step(add, run_id, "s0", task_id="task-1").kind == (
        "not_claimed")
    assert "s1" in {s.step_name for s in pikku.get_steps(run_id)}
