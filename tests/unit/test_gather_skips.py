"""A pass that only learns that some steps of the gather it waits on succeeded, while
others still run, skips the replay (``views.RunView.skips``, issue 24): a fan-out of N
steps replays about once at its end, not once per settle (N replays of N calls each).
Anything else replays: a failed step, a step the gather did not wait on, a message that
names nothing."""

from __future__ import annotations

from typing import Any

from tests.unit.test_in_place import _app


def test_a_fan_out_replays_at_its_start_and_its_end_only() -> None:
    pikku, _, worker = _app()
    replays: list[int] = []

    @pikku.step(name="gs.double")
    def double(n: int) -> int:
        return 2 * n

    @pikku.workflow("gs.fan")
    def fan(wf: Any, n: int) -> int:
        replays.append(1)
        return sum(wf.gather(*(wf.call(f"c{i}", double, i) for i in range(n))))

    run_id = pikku.start("gs.fan", 20)
    worker.drain()
    assert pikku.get_run(run_id).output == 2 * sum(range(20))
    assert len(worker.sent) == 20
    # The start's pass, and the pass after the last settle: the 19 between skip.
    assert len(replays) == 2, len(replays)


def test_a_failure_in_the_gather_replays_at_once() -> None:
    pikku, _, worker = _app()
    seen: list[str] = []

    @pikku.step(name="gs.maybe", retries=0)
    def maybe(n: int) -> int:
        if n == 1:
            raise ValueError("one fails")
        return n

    @pikku.step(name="gs.undo")
    def undo(data: Any) -> str:
        seen.append("compensated")
        return "undone"

    @pikku.workflow("gs.some")
    def some(wf: Any, data: Any) -> Any:
        return wf.gather(*(wf.call(f"c{i}", maybe, i, on_error=undo) for i in range(4)))

    run_id = pikku.start("gs.some", None)
    worker.drain()
    run = pikku.get_run(run_id)
    assert run.status == "failed" and "one fails" in str(run.error), run
    assert seen == ["compensated"]
