"""``pikku_celery.testing``: the pytest plugin a user loads with ``pytest_plugins``, its
``pikku_inline`` fixture, and ``inline(pikku)`` for one instance.

The user's test runs through pytest's own ``pytester``, in a project configured for
production (a broker, MongoDB and Redis at hosts that do not resolve): it passes only if
nothing is sent, nothing connects and nothing waits."""

from __future__ import annotations

import textwrap
import uuid
from typing import Any

import pytest
from celery import Celery

from pikku_celery import PikkuCelery, PikkuConfigurationError, signals
from pikku_celery.testing import inline
from tests.support.readme import readme_example

pytest_plugins = ["pytester"]

USER_APP = """
    from celery import Celery
    from pikku_celery import PikkuCelery

    app = Celery("orders", broker="amqp://guest@broker.invalid:5672//")
    app.conf.update(pikku_mongo_url="mongodb://mongo.invalid:27017/orders",
                    pikku_redis_url="redis://redis.invalid:6379/0")
    pikku = PikkuCelery(app)
    bank_calls = []


    @pikku.step(retries=3)  # 4 attempts, 1 s then 2 s then 4 s apart
    def charge(order):
        bank_calls.append(order["id"])
        if len(bank_calls) <= 3:
            raise ConnectionError("the bank is down")
        return {"charged": order["amount"]}


    @pikku.workflow()
    def order(wf, data):
        wf.sleep("cooling-off", "1h")
        return wf.do("charge", charge, data)
"""

USER_TEST = """
    import time

    import pytest

    from orders import bank_calls, order, pikku

    pytest_plugins = ["pikku_celery.testing"]


    @pytest.fixture(autouse=True)
    def no_real_waiting(monkeypatch):
        def forbidden(seconds):
            raise AssertionError(f"time.sleep({seconds}) in a test kit run")
        monkeypatch.setattr(time, "sleep", forbidden)


    def test_an_order_is_charged_after_a_cooling_off_hour_and_three_failures(pikku_inline):
        run_id = pikku.start(order, {"id": "o-1", "amount": 5})

        run = pikku.get_run(run_id)
        assert run.status == "completed" and run.output == {"charged": 5}
        assert [a.status for a in pikku_inline.attempts(run_id, "charge")] == [
            "failed", "failed", "failed", "succeeded"]
        assert pikku_inline.attempts(run_id, "charge")[0].error["type"] == "ConnectionError"
        steps = pikku_inline.steps(run_id)
        assert list(steps) == ["cooling-off", "charge"]
        assert steps["charge"].attempt == 4 and bank_calls == ["o-1"] * 4
        assert pikku_inline.skipped_s > 3600  # the hour and the retry delays: skipped
"""


def test_a_users_test_with_a_one_hour_sleep_and_three_retries(pytester: pytest.Pytester
                                                             ) -> None:
    pytester.makepyfile(orders=textwrap.dedent(USER_APP),
                        test_orders=textwrap.dedent(USER_TEST))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_kit_fails_a_users_test_whose_workflow_is_wrong(pytester: pytest.Pytester
                                                            ) -> None:
    """The kit does not swallow failures: a run that fails fails the user's assert."""
    pytester.makepyfile(orders=textwrap.dedent(USER_APP).replace(
                            "if len(bank_calls) <= 3:", "if True:  # the bank never answers"),
                        test_orders=textwrap.dedent(USER_TEST))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*'failed' == 'completed'*"])


def _configured_pikku() -> PikkuCelery:
    """An instance whose real engine cannot be built here (no URLs configured)."""
    return PikkuCelery(Celery(f"kit-{uuid.uuid4().hex[:8]}", broker="memory://"))


def _workflows(pikku: PikkuCelery, tag: str) -> dict[str, Any]:
    @pikku.step(name=f"kit{tag}.add", retries=1, retry_delay="10m", bind=True)
    def add(ctx: Any, data: dict[str, int]) -> int:
        if data.get("fail_first") and ctx.attempt == 1:
            raise RuntimeError("once")
        return data["a"] + data["b"]

    @pikku.workflow(f"kit-child-{tag}")
    def child(wf: Any, n: int) -> int:
        return int(wf.do("add", add, {"a": n, "b": n}))

    @pikku.workflow(f"kit-{tag}")
    def parent(wf: Any, data: dict[str, Any]) -> dict[str, Any]:
        total = wf.do("sum", add, {"a": 1, "b": 2, "fail_first": True})
        wf.sleep("wait-a-day", "1d")
        wf.suspend("approve")
        doubled = wf.child("double", child, total)
        return {"total": total, "doubled": doubled}

    return {"parent": parent, "child": child}


def test_inline_runs_one_instance_to_its_end_then_gives_its_engine_back() -> None:
    pikku = _configured_pikku()
    flows = _workflows(pikku, uuid.uuid4().hex[:6])
    with inline(pikku) as kit:
        run_id = pikku.start(flows["parent"], {})
        assert pikku.get_run(run_id).status == "suspended"  # waits for its resume
        assert pikku.resume(run_id) is True
        run = pikku.get_run(run_id)
        assert run.status == "completed" and run.output == {"total": 3, "doubled": 6}
        assert kit.run(run_id) == run
        assert [(a.step_name, a.attempt, a.status) for a in kit.attempts(run_id)] == [
            ("sum", 1, "failed"), ("sum", 2, "succeeded"),
            ("wait-a-day", 1, "succeeded"), ("__suspend:approve", 1, "succeeded"),
            ("double", 1, "succeeded")]
        assert kit.skipped_s > 86_400
        assert kit.steps(run_id)["sum"].attempt == 2
    with pytest.raises(PikkuConfigurationError, match="pikku_mongo_url"):
        pikku.get_run(run_id)  # the configured engine again: nothing leaked


def test_the_fixture_reaches_instances_created_during_the_test_and_cancels_inline(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_later=textwrap.dedent("""
        from celery import Celery
        from pikku_celery import PikkuCelery, PikkuConfigurationError
        import pytest

        pytest_plugins = ["pikku_celery.testing"]

        def test_an_instance_made_in_the_test(pikku_inline):
            pikku = PikkuCelery(Celery("late", broker="memory://"))

            @pikku.workflow()
            def waits(wf, data):
                wf.suspend("never resumed")

            run_id = pikku.start(waits, None)
            assert pikku_inline.run(run_id).status == "suspended"
            assert pikku.cancel(run_id, "no") is True
            assert pikku.get_run(run_id).status == "cancelled"

        def test_outside_the_fixture_the_configured_engine_is_back():
            from pikku_celery.worker.shared import instances
            late = [p for p in instances() if p.app.main == "late"]
            assert late
            with pytest.raises(PikkuConfigurationError):
                late[0].engine
    """))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_signals_are_sent_under_the_kit() -> None:
    pikku = _configured_pikku()
    tag = uuid.uuid4().hex[:6]
    flows = _workflows(pikku, tag)
    finished: list[str] = []

    def record(sender: Any = None, **fields: Any) -> None:
        finished.append(fields["status"])

    signals.run_finished.connect(record, sender=f"kit-child-{tag}", weak=False)
    try:
        with inline(pikku):
            pikku.start(flows["child"], 4)
    finally:
        signals.run_finished.disconnect(record)
    assert finished == ["completed"]


def test_the_readme_example_passes_as_written(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(shop=readme_example("shop.py"),
                        test_shop=readme_example("test_shop.py"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_kit_leaves_no_heartbeat_thread_behind() -> None:
    pikku = _configured_pikku()
    flows = _workflows(pikku, uuid.uuid4().hex[:6])
    with inline(pikku):
        pikku.start(flows["child"], 1)  # runs a step: the engine's heartbeat thread starts
        thread = pikku.engine.heartbeat._thread
        assert thread is not None and thread.is_alive()
    thread.join(5)
    assert not thread.is_alive()
