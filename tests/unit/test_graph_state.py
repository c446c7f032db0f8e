"""Graph run state (issue 12): nodes read the run state in their data and write it by
returning ``with_state``; each write is merged once, under the run lease, as one versioned
write, and a bad write fails the run clearly and leaves the stored state as it was."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    InvalidInputError,
    LeaseLostError,
    PikkuCelery,
    with_state,
)
from tests.support.readme import readme_example
from tests.unit.test_engine import Recorder


@pytest.fixture
def pikku() -> Iterator[PikkuCelery]:
    app = Celery("graph-state", broker="memory://")
    yield PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                      worker_reaper=False)


def _order_graph(pikku: PikkuCelery, seen: dict[str, Any]) -> None:
    @pikku.step(name="gs.reserve")
    def reserve(data: dict[str, Any]) -> Any:
        seen["reserve"] = data["state"]
        return with_state({"reserved": 2}, {"reservation": "R-1", "tries": 1})

    @pikku.step(name="gs.charge")
    def charge(data: dict[str, Any]) -> Any:
        seen["charge"] = data["state"]
        return with_state({"charged": data["from"]["reserve"]["reserved"] * 10},
                          {"tries": data["state"]["tries"] + 1})

    @pikku.step(name="gs.ship")
    def ship(data: dict[str, Any]) -> Any:
        seen["ship"] = data["state"]
        return {"shipped": data["state"]["reservation"], "paid": data["from"]["charge"]}

    pikku.graph("order", nodes={"reserve": reserve, "charge": charge, "ship": ship},
                edges=[("reserve", "charge"), ("charge", "ship")])


def test_nodes_read_the_state_written_before_they_started_and_successors_get_the_result(
        pikku: PikkuCelery) -> None:
    seen: dict[str, Any] = {}
    _order_graph(pikku, seen)
    run = pikku.get_run(pikku.start("order", {"id": 7}, inline=True))
    assert run.status == "completed", run.error
    assert seen == {"reserve": {}, "charge": {"reservation": "R-1", "tries": 1},
                    "ship": {"reservation": "R-1", "tries": 2}}
    assert run.output == {"ship": {"shipped": "R-1", "paid": {"charged": 20}}}
    assert run.state == {"reservation": "R-1", "tries": 2}
    assert (run.state_version, run.state_writers) == (2, ("reserve", "charge"))


def test_a_write_is_merged_once_however_many_passes_see_the_node_done(
        pikku: PikkuCelery) -> None:
    _order_graph(pikku, {})
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    run_id = pikku.start("order", None)
    pikku.engine.advance(run_id)
    pikku.engine.execute_step(pikku.registry.steps["gs.reserve"], run_id, "reserve")
    for _ in range(3):  # duplicate wake-ups: every pass replays the done node
        pikku.engine.advance(run_id)
    run = pikku.get_run(run_id)
    assert (run.state_version, run.state_writers) == (1, ("reserve",))
    assert [s[2] for s in recorder.steps] == ["reserve", "charge"]
    pikku.engine.passes.views.clear()  # a process that never saw the run: it reads it all
    pikku.engine.advance(run_id)
    assert pikku.get_run(run_id).state_version == 1


def _counting_loop(pikku: PikkuCelery, rounds: int) -> None:
    @pikku.step(name="gs.seed")
    def seed(data: Any) -> Any:
        return with_state(None, {"visits": 0})

    @pikku.step(name="gs.visit")
    def visit(data: dict[str, Any]) -> Any:
        visits = data["state"]["visits"] + 1
        return with_state(visits, {"visits": visits})

    @pikku.step(name="gs.end")
    def end(data: dict[str, Any]) -> Any:
        return {"visits": data["state"]["visits"], "last": data["from"]["visit"]}

    pikku.graph("counting", nodes={"seed": seed, "visit": visit, "end": end},
                edges=[("seed", "visit"), ("visit", "visit"), ("visit", "end")],
                branch={"visit": lambda n: ["end"] if n >= rounds else ["visit"]})


def test_each_loop_visit_writes_its_own_version(pikku: PikkuCelery) -> None:
    _counting_loop(pikku, rounds=3)
    run = pikku.get_run(pikku.start("counting", None, inline=True))
    assert run.status == "completed", run.error
    assert run.output == {"end": {"visits": 3, "last": 3}}
    assert run.state == {"visits": 3}
    assert run.state_writers == ("seed", "visit", "visit#2", "visit#3")
    assert run.state_version == 4


def test_a_sequential_fan_out_item_sees_what_the_item_before_it_wrote(
        pikku: PikkuCelery) -> None:
    @pikku.step(name="gs.items")
    def items(data: Any) -> list[int]:
        return [5, 7, 9]

    @pikku.step(name="gs.add")
    def add(data: dict[str, Any]) -> Any:
        total = data["state"].get("total", 0) + data["item"]
        return with_state(total, {"total": total})

    pikku.graph("running-total", nodes={"items": items, "add": add},
                edges=[("items", "add")],
                for_each={"add": {"over": "items", "sequential": True}})
    run = pikku.get_run(pikku.start("running-total", None, inline=True))
    assert run.status == "completed", run.error
    assert run.output == {"add": [5, 12, 21]}
    assert run.state == {"total": 21}
    assert run.state_writers == ("add[0]", "add[1]", "add[2]")


def test_with_state_refuses_a_bad_key_where_the_node_returns() -> None:
    with pytest.raises(InvalidInputError, match=r"run state key 'a\.b'.*letters, digits"):
        with_state(1, {"a.b": 2})
    with pytest.raises(InvalidInputError, match="non-empty mapping"):
        with_state(1, [("a", 1)])  # type: ignore[arg-type]


@pytest.mark.parametrize(("write", "says"), [
    ({"bad key": 1}, "run state key 'bad key' written by 'second'"),
    ({"blob": "x" * 70_000}, "over the 65536-byte limit"),
])
def test_a_bad_write_fails_the_run_clearly_and_keeps_the_stored_state(
        pikku: PikkuCelery, write: dict[str, Any], says: str) -> None:
    @pikku.step(name="gs.first")
    def first(data: Any) -> Any:
        return with_state(1, {"kept": True})

    @pikku.step(name="gs.second")
    def second(data: Any) -> Any:
        # What ``with_state`` would have refused, as a node built by hand returns it.
        return {"__pikku_state__": write, "result": 2}

    @pikku.step(name="gs.third")
    def third(data: Any) -> Any:
        return 3

    pikku.graph("bad-write", nodes={"first": first, "second": second, "third": third},
                edges=[("first", "second"), ("second", "third")])
    run = pikku.get_run(pikku.start("bad-write", None, inline=True))
    assert run.status == "failed"
    assert run.error is not None and says in run.error["message"]
    assert (run.state, run.state_version, run.state_writers) == ({"kept": True}, 1, ("first",))
    assert "third" not in {s.step_name for s in pikku.get_steps(run.run_id)}


def test_a_pass_whose_state_moved_under_it_writes_nothing_and_the_next_pass_goes_on(
        pikku: PikkuCelery) -> None:
    """The view says version 1, but another pass wrote meanwhile (this pass lost the run
    lease): the write is refused, the pass ends as a lost lease, and a pass that reads the
    run afresh merges the node's write on top of the other one."""
    _order_graph(pikku, {})
    pikku.engine.dispatcher = Recorder()
    run_id = pikku.start("order", None)
    pikku.engine.advance(run_id)
    pikku.engine.execute_step(pikku.registry.steps["gs.reserve"], run_id, "reserve")
    assert pikku.get_run(run_id).state_writers == ("reserve",)  # continued in place
    store = pikku.engine.store
    assert store.write_run_state(run_id, "elsewhere", {"other": 1}, 1, 0) is not None
    pikku.engine.settings = dataclasses.replace(pikku.engine.settings,
                                                continue_in_place=False)
    pikku.engine.execute_step(pikku.registry.steps["gs.charge"], run_id, "charge")
    with pytest.raises(LeaseLostError):
        pikku.engine.advance(run_id, step_name="charge")  # its view is at version 1
    run = pikku.get_run(run_id)
    assert (run.state_version, run.state_writers) == (2, ("reserve", "elsewhere"))
    pikku.engine.advance(run_id)  # the failed pass kept no view: this one reads the run
    run = pikku.get_run(run_id)
    assert run.state == {"other": 1, "reservation": "R-1", "tries": 2}
    assert run.state_writers == ("reserve", "elsewhere", "charge")


def test_workflow_code_can_write_and_read_the_run_state_once_per_writer(
        pikku: PikkuCelery) -> None:
    @pikku.workflow("stateful")
    def stateful(wf: Any, data: Any) -> Any:
        wf.set_state("start", {"phase": "started"})
        wf.sleep("pause", 0)
        wf.set_state("start", {"phase": "ignored: this writer wrote before"})
        return wf.state

    run = pikku.get_run(pikku.start("stateful", None, inline=True))
    assert run.status == "completed", run.error
    assert run.output == {"phase": "started"}
    assert (run.state_version, run.state_writers) == (1, ("start",))


def test_the_readme_example_runs_as_written(pikku: PikkuCelery) -> None:
    code = readme_example("run-state.py")
    scope: dict[str, Any] = {"pikku": pikku}
    exec(compile(code, "README.md:run-state.py", "exec"), scope)  # its asserts are the test
    assert scope["run"].output == {"done": {"visits": 3}}
