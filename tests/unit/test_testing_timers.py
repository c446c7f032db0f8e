"""The test kit's held timers: with ``inline(pikku, hold_timers=True)``, the
``pikku_hold_timers`` marker or ``kit.hold_timers()``, the clock no longer jumps to the next
timer, so a test can decide an approval before its expiry; ``kit.advance`` moves the clock
by hand and fires what is due. Without them the kit still jumps (issue 25, item 4)."""

from __future__ import annotations

import textwrap
import uuid
from typing import Any

import pytest
from celery import Celery

from pikku_celery import PikkuCelery, WorkflowApprovalError
from pikku_celery.testing import InlineKit, inline
from tests.support.readme import readme_example

pytest_plugins = ["pytester"]


def _pikku() -> tuple[PikkuCelery, dict[str, Any]]:
    """An instance with no engine configured, and its workflows: an approval with an
    expiry, a ten-minute sleep, a step retried after a delay, a parent of the sleep."""
    pikku = PikkuCelery(Celery(f"timers-{uuid.uuid4().hex[:8]}", broker="memory://"))
    tag = uuid.uuid4().hex[:6]
    calls: list[int] = []

    @pikku.step(name=f"timers{tag}.record")
    def record(data: Any) -> Any:
        return data

    @pikku.step(name=f"timers{tag}.flaky", retries=1, retry_delay="30s", bind=True)
    def flaky(ctx: Any, data: Any) -> str:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise ConnectionError("down")
        return "up"

    @pikku.workflow(f"approve-{tag}")
    def onboarding(wf: Any, data: Any) -> Any:
        decision = wf.approval("manager", expiry="1h", approvers=["ann"])
        if decision.get("expired"):
            return "expired"
        return wf.do("after", record, "yes" if decision["approved"] else "no")

    @pikku.workflow(f"nap-{tag}")
    def nap(wf: Any, data: Any) -> Any:
        wf.sleep("nap", "10m")
        return wf.do("woke", record, "awake")

    @pikku.workflow(f"retry-{tag}")
    def retry(wf: Any, data: Any) -> Any:
        return wf.do("flaky", flaky, None)

    @pikku.workflow(f"parent-{tag}")
    def parent(wf: Any, data: Any) -> Any:
        return {"child": wf.child("nap", nap, None)}

    return pikku, {"approval": onboarding, "nap": nap, "retry": retry, "parent": parent,
                   "calls": calls}


def _gate(kit: InlineKit, run_id: str) -> Any:
    return kit.steps(run_id)["__approval:manager"]


def test_the_default_kit_still_jumps_to_the_expiry_and_past_the_sleep() -> None:
    pikku, flows = _pikku()
    with inline(pikku) as kit:
        assert not kit.timers_held
        gated = pikku.start(flows["approval"], None)
        assert kit.run(gated).output == "expired"
        napped = pikku.start(flows["nap"], None)
        assert kit.run(napped).status == "completed" and kit.run(napped).output == "awake"
        assert kit.skipped_s > 4000  # the hour and the ten minutes, less real time


def test_a_held_gate_is_decided_before_its_expiry() -> None:
    pikku, flows = _pikku()
    with inline(pikku, hold_timers=True) as kit:
        run_id = pikku.start(flows["approval"], None)
        assert kit.run(run_id).status == "suspended"  # at the gate, the clock not moved
        assert _gate(kit, run_id).status == "scheduled" and kit.skipped_s == 0
        kit.advance("59m")
        assert kit.run(run_id).status == "suspended"  # not expired yet

        pikku.approve(run_id, "manager", {"approved": True}, by="ann")

        run = kit.run(run_id)
        assert run.status == "completed" and run.output == "yes"
        assert _gate(kit, run_id).result == {"approved": True}
        kit.advance("2h")  # the expiry's timer fires into a decided gate: nothing changes
        assert kit.run(run_id) == run and _gate(kit, run_id).result == {"approved": True}


def test_a_held_gate_expires_when_the_clock_is_advanced_past_its_expiry() -> None:
    pikku, flows = _pikku()
    with inline(pikku, hold_timers=True) as kit:
        run_id = pikku.start(flows["approval"], None)
        kit.advance("30m")
        assert kit.run(run_id).status == "suspended"
        kit.advance("30m")  # an hour since the gate opened: its expiry
        run = kit.run(run_id)
        assert run.status == "completed" and run.output == "expired"
        assert _gate(kit, run_id).result == {"expired": True}
        with pytest.raises(WorkflowApprovalError, match="the run has ended"):
            pikku.approve(run_id, "manager", {"approved": True}, by="ann")


def test_a_held_sleep_waits_for_ten_minutes_of_advance() -> None:
    pikku, flows = _pikku()
    with inline(pikku, hold_timers=True) as kit:
        run_id = pikku.start(flows["nap"], None)
        assert kit.run(run_id).status == "running"
        assert kit.steps(run_id)["nap"].status == "scheduled" and "woke" not in kit.steps(run_id)
        kit.advance("9m")
        kit.advance(59)
        assert kit.run(run_id).status == "running"
        kit.advance(1)
        run = kit.run(run_id)
        assert run.status == "completed" and run.output == "awake"
        # What was advanced, less the real time the kit spent firing schedules on the way
        # (``advance`` moves the clock to the target it computed first): no jump past it.
        assert 599 < kit.skipped_s <= 600


def test_a_held_sleep_in_a_child_run_wakes_its_parent_on_advance() -> None:
    pikku, flows = _pikku()
    with inline(pikku, hold_timers=True) as kit:
        run_id = pikku.start(flows["parent"], None)
        assert kit.run(run_id).status == "running"
        kit.advance("10m")
        assert kit.run(run_id).output == {"child": "awake"}


def test_a_held_retry_delay_waits_for_advance_too() -> None:
    pikku, flows = _pikku()
    with inline(pikku, hold_timers=True) as kit:
        run_id = pikku.start(flows["retry"], None)
        assert [a.status for a in kit.attempts(run_id, "flaky")] == ["failed"]
        kit.advance("29s")
        assert flows["calls"] == [1]
        kit.advance("1s")
        assert kit.run(run_id).output == "up" and flows["calls"] == [1, 2]


def test_hold_timers_mid_test_and_release_timers_runs_on_at_once() -> None:
    pikku, flows = _pikku()
    with inline(pikku) as kit:
        kit.hold_timers()
        assert kit.timers_held
        napped = pikku.start(flows["nap"], None)
        gated = pikku.start(flows["approval"], None)
        assert kit.run(napped).status == "running" and kit.run(gated).status == "suspended"
        kit.release_timers()  # both jump: the sleep ends, the gate expires
        assert not kit.timers_held
        assert kit.run(napped).output == "awake" and kit.run(gated).output == "expired"


USER_APP = """
    from celery import Celery
    from pikku_celery import PikkuCelery

    app = Celery("hr", broker="amqp://guest@broker.invalid:5672//")
    app.conf.update(pikku_mongo_url="mongodb://mongo.invalid:27017/hr",
                    pikku_redis_url="redis://redis.invalid:6379/0")
    pikku = PikkuCelery(app)


    @pikku.step()
    def notify(text):
        return text


    @pikku.workflow()
    def onboarding(wf, data):
        decision = wf.approval("manager", expiry="1h")
        if decision.get("expired"):
            return wf.do("escalate", notify, "expired")
        return wf.do("welcome", notify, "approved" if decision["approved"] else "refused")
"""

USER_TEST = """
    import time

    import pytest

    from hr import onboarding, pikku


    @pytest.fixture(autouse=True)
    def no_real_waiting(monkeypatch):
        def forbidden(seconds):
            raise AssertionError(f"time.sleep({seconds}) in a test kit run")
        monkeypatch.setattr(time, "sleep", forbidden)


    @pytest.mark.pikku_hold_timers
    def test_the_manager_approves_in_time(pikku_inline):
        run_id = pikku.start(onboarding, {"who": "ann"})
        assert pikku.get_run(run_id).status == "suspended"
        pikku.approve(run_id, "manager", {"approved": True})
        assert pikku.get_run(run_id).output == "approved"


    @pytest.mark.pikku_hold_timers
    def test_nobody_decides_within_the_hour(pikku_inline):
        run_id = pikku.start(onboarding, {"who": "bob"})
        pikku_inline.advance("1h")
        assert pikku.get_run(run_id).output == "expired"


    def test_held_by_the_method(pikku_inline):
        pikku_inline.hold_timers()
        run_id = pikku.start(onboarding, {"who": "cy"})
        pikku.approve(run_id, "manager", {"approved": False})
        assert pikku.get_run(run_id).output == "refused"


    def test_by_default_the_clock_jumps_to_the_expiry(pikku_inline):
        run_id = pikku.start(onboarding, {"who": "dee"})
        assert pikku.get_run(run_id).output == "expired"
"""


def test_a_users_tests_hold_timers_by_the_marker_and_by_the_method(
        pytester: pytest.Pytester) -> None:
    """The plugin loaded from conftest.py registers its marker: --strict-markers accepts it."""
    pytester.makeconftest('pytest_plugins = ["pikku_celery.testing"]')
    pytester.makepyfile(hr=textwrap.dedent(USER_APP), test_hr=textwrap.dedent(USER_TEST))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=4)


def test_the_readme_examples_pass_as_written(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["pikku_celery.testing"]')
    pytester.makepyfile(hr=readme_example("hr.py"), test_hr=readme_example("test_hr.py"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=2)


def test_a_day_advanced_holds_a_day_of_ticks_however_long_the_first_round_takes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``docs/guide/schedules.md``'s example counts 2,880 runs of a 30 s schedule in a day
    advanced; it once counted 2,879 under load: the target was read before the first round
    built the engine and saved the schedule, and a tick fell in between. Here the build
    takes a whole interval (the kit's clock moved 30 s meanwhile, as a slow build's
    real time would move it) before it saves the schedule."""
    from pikku_celery.schedules.firing import Scheduler

    app = Celery(f"ticks-{uuid.uuid4().hex[:6]}")
    pikku = PikkuCelery(app)

    @pikku.workflow("ticks.ping")
    def ping(wf: Any, data: Any) -> str:
        return "pong"

    pikku.schedule("ticks", "ticks.ping", every="30s", catch_up="none")
    save = Scheduler._save
    slow = {"first": True}
    with inline(pikku, hold_timers=True) as kit:
        def slowly(self: Scheduler, definition: Any, now: int) -> Any:
            if slow.pop("first", False):
                kit.clock.advance(30)
                now = kit.clock.now_ms()
            return save(self, definition, now)

        monkeypatch.setattr(Scheduler, "_save", slowly)
        kit.advance("1d")
        assert pikku.count_runs("completed", workflow="ticks.ping") == 2880
