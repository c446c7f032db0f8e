"""Steps retry as Celery tasks do (issue 36, item 1): once by default, more only when asked,
in Celery's words (``autoretry_for``, ``max_retries``, ``retry_backoff``,
``retry_backoff_max``, ``retry_jitter``), and app-wide through ``pikku_step_*`` settings."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import PikkuCelery, PikkuConfigurationError
from pikku_celery.testing import InlineKit, inline
from pikku_celery.workflow.definitions import make_step
from pikku_celery.workflow.retry import NO_DEFAULTS, RetryPolicy, StepDefaults, retry_policy

_apps = itertools.count()


@pytest.fixture
def app() -> Celery:
    return Celery(f"retries{next(_apps)}", broker="memory://")


@pytest.fixture
def pikku(app: Celery) -> PikkuCelery:
    return PikkuCelery(app, worker_reaper=False)


@pytest.fixture
def kit(pikku: PikkuCelery) -> Iterator[InlineKit]:
    with inline(pikku) as kit:
        yield kit


def _failing(pikku: PikkuCelery, *errors: BaseException, **options: Any) -> Any:
    """A step raising ``errors`` in turn (then succeeding), and a workflow running it."""
    calls = iter(errors)

    @pikku.step(name="retries.s", **options)
    def s(data: Any) -> str:
        error = next(calls, None)
        if error is not None:
            raise error
        return "ok"

    @pikku.workflow("retries.flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("s", s, data)

    return flow


def _statuses(kit: InlineKit, run_id: str) -> list[str]:
    return [a.status for a in kit.attempts(run_id, "s")]


# --- the default: one attempt ---------------------------------------------------------------

def test_a_failing_step_fails_the_run_on_its_first_attempt(pikku: PikkuCelery,
                                                           kit: InlineKit) -> None:
    _failing(pikku, RuntimeError("card declined"))
    run_id = pikku.start("retries.flow", {"id": 1})
    assert kit.run(run_id).status == "failed"
    assert _statuses(kit, run_id) == ["failed"]
    # Celery's 3 retries, for a lost worker's attempts only (an acks_late redelivery): the
    # body's error is not tried again (tests/integration/test_in_place.py kills a worker).
    state = kit.steps(run_id)["s"]
    assert (state.max_attempts, state.errors_retried) == (4, False)
    assert pikku.registry.steps["retries.s"].retries is None  # said nothing: the app decides


def test_retries_gives_that_many_more_attempts(pikku: PikkuCelery, kit: InlineKit) -> None:
    _failing(pikku, RuntimeError("1"), RuntimeError("2"), retries=2)
    run_id = pikku.start("retries.flow", None)
    assert kit.run(run_id).status == "completed"
    assert _statuses(kit, run_id) == ["failed", "failed", "succeeded"]


# --- max_retries: another name for retries -------------------------------------------------

def test_max_retries_is_retries(pikku: PikkuCelery, kit: InlineKit) -> None:
    _failing(pikku, RuntimeError("1"), RuntimeError("2"), RuntimeError("3"), max_retries=2)
    run_id = pikku.start("retries.flow", None)
    assert kit.run(run_id).status == "failed"
    assert _statuses(kit, run_id) == ["failed", "failed", "failed"]
    assert kit.steps(run_id)["s"].max_attempts == 3


def test_retries_and_max_retries_that_disagree_are_refused(pikku: PikkuCelery) -> None:
    with pytest.raises(ValueError, match="max_retries is another name for retries"):
        pikku.step(name="retries.both", retries=1, max_retries=2)(lambda data: data)
    same = pikku.step(name="retries.same", retries=2, max_retries=2)(lambda data: data)
    assert same.pikku_step.max_attempts() == 3


# --- autoretry_for: only those exceptions ---------------------------------------------------

def test_autoretry_for_retries_its_exceptions_three_times_by_default(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    _failing(pikku, *[ConnectionError(str(n)) for n in range(3)],
             autoretry_for=(ConnectionError,))
    run_id = pikku.start("retries.flow", None)
    assert kit.run(run_id).status == "completed"
    assert _statuses(kit, run_id) == ["failed"] * 3 + ["succeeded"]
    assert kit.steps(run_id)["s"].max_attempts == 4  # Celery's max_retries default: 3


def test_autoretry_for_fails_any_other_exception_at_once(pikku: PikkuCelery,
                                                         kit: InlineKit) -> None:
    _failing(pikku, ConnectionError("retried"), ValueError("not retried"),
             autoretry_for=(ConnectionError,), retries=5)
    run_id = pikku.start("retries.flow", None)
    assert kit.run(run_id).status == "failed"
    assert _statuses(kit, run_id) == ["failed", "failed"]
    assert kit.steps(run_id)["s"].error["type"] == "ValueError"


def test_autoretry_for_must_be_exception_classes(pikku: PikkuCelery) -> None:
    with pytest.raises(ValueError, match="autoretry_for must be a tuple of exception classes"):
        pikku.step(name="retries.bad", autoretry_for=("ConnectionError",))(lambda d: d)
    assert make_step(lambda d: d, "one", autoretry_for=OSError).retry.autoretry_for == (OSError,)


def test_no_retry_for_wins_over_autoretry_for() -> None:
    policy = retry_policy("s", autoretry_for=(OSError,), no_retry_for=(FileNotFoundError,))
    assert policy.retries_on(ConnectionError())
    assert not policy.retries_on(FileNotFoundError())
    assert not policy.retries_on(ValueError())
    assert RetryPolicy().retries_on(ValueError())  # no autoretry_for: any exception


# --- the wait before a retry ----------------------------------------------------------------

def _delays(policy: RetryPolicy, attempts: range, defaults: StepDefaults = NO_DEFAULTS,
            override_ms: int | None = None) -> list[int]:
    return [policy.delay_ms_before(n, override_ms, defaults) for n in attempts]


def test_retry_backoff_doubles_like_celery_with_jitter_off() -> None:
    policy = retry_policy("s", retry_backoff=2, retry_jitter=False)
    assert _delays(policy, range(2, 7)) == [2000, 4000, 8000, 16000, 32000]
    assert _delays(retry_policy("s", retry_backoff=True, retry_jitter=False),
                   range(2, 5)) == [1000, 2000, 4000]


def test_retry_backoff_max_caps_it() -> None:
    policy = retry_policy("s", retry_backoff=2, retry_backoff_max=10, retry_jitter=False)
    assert _delays(policy, range(2, 7)) == [2000, 4000, 8000, 10000, 10000]
    default_cap = retry_policy("s", retry_backoff=1, retry_jitter=False)
    assert default_cap.delay_ms_before(1000) == 600_000  # Celery's retry_backoff_max
    assert default_cap.delay_ms_before(12) == 600_000


def test_retry_jitter_is_on_by_default_and_stays_within_the_backoff() -> None:
    policy = retry_policy("s", retry_backoff=4)
    asked: list[tuple[int, int]] = []

    def randint(low: int, high: int) -> int:
        asked.append((low, high))
        return high // 2

    assert policy.delay_ms_before(3, randint=randint) == 4000
    assert asked == [(0, 8000)]  # Celery's full jitter: anywhere from 0 to the backoff
    for attempt in range(2, 12):
        cap = min(4000 * 2 ** (attempt - 2), 600_000)
        assert all(0 <= policy.delay_ms_before(attempt) <= cap for _ in range(50))


def test_retry_delay_and_the_default_wait() -> None:
    assert _delays(retry_policy("s", retry_delay="250ms"), range(2, 5)) == [250, 250, 250]
    assert _delays(RetryPolicy(), range(2, 6)) == [1000, 2000, 4000, 8000]  # unchanged
    assert RetryPolicy().delay_ms_before(30) == 300_000
    with pytest.raises(ValueError, match="cannot both be given"):
        retry_policy("s", retry_delay=1, retry_backoff=True)
    backoff = retry_policy("s", retry_backoff=2, retry_jitter=False)
    assert _delays(backoff, range(2, 4), override_ms=50) == [50, 50]  # wf.do(retry_delay=)


def test_retry_jitter_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="retry_jitter must be True or False"):
        retry_policy("s", retry_backoff=True, retry_jitter="yes")  # type: ignore[arg-type]


# --- app-wide: pikku_step_* settings ---------------------------------------------------------

def test_pikku_step_retries_is_the_default_of_steps_that_do_not_say(
        app: Celery, pikku: PikkuCelery) -> None:
    app.conf.pikku_step_retries = 2
    _failing(pikku, RuntimeError("1"), RuntimeError("2"))

    @pikku.step(name="retries.once", retries=0)
    def once(data: Any) -> None:
        raise RuntimeError("once")

    @pikku.workflow("retries.once_flow")
    def once_flow(wf: Any, data: Any) -> Any:
        return wf.do("o", once, data)

    with inline(pikku) as kit:
        run_id = pikku.start("retries.flow", None)
        assert _statuses(kit, run_id) == ["failed", "failed", "succeeded"]
        other = pikku.start("retries.once_flow", None)
        assert [a.status for a in kit.attempts(other)] == ["failed"]


def test_pikku_step_autoretry_for_from_a_settings_file(app: Celery, pikku: PikkuCelery) -> None:
    app.conf.pikku_step_autoretry_for = "ConnectionError, json:JSONDecodeError"
    _failing(pikku, ConnectionError("retried"), KeyError("not retried"))
    with inline(pikku) as kit:
        run_id = pikku.start("retries.flow", None)
        assert _statuses(kit, run_id) == ["failed", "failed"]
        assert kit.steps(run_id)["s"].max_attempts == 4  # autoretry_for alone: 3 retries
    assert pikku.settings.step_defaults.autoretry_for is not None
    assert pikku.settings.step_defaults.autoretry_for[0] is ConnectionError


def test_pikku_step_retry_backoff_sets_the_wait(app: Celery, pikku: PikkuCelery) -> None:
    app.conf.pikku_step_retries = "1"  # from the environment
    app.conf.pikku_step_retry_backoff = 5
    app.conf.pikku_step_retry_jitter = "false"
    _failing(pikku, RuntimeError("1"))
    with inline(pikku, hold_timers=True) as kit:
        run_id = pikku.start("retries.flow", None)
        step = kit.steps(run_id)["s"]
        assert step.due_at is not None and step.updated_at is not None
        assert round((step.due_at - step.updated_at).total_seconds()) == 5
        kit.advance("5s")
        assert kit.run(run_id).status == "completed"


@pytest.mark.parametrize(("setting", "value"), [
    ("step_retries", -1), ("step_autoretry_for", "NoSuchError"),
    ("step_retry_backoff", "soon"), ("step_retry_jitter", 3),
    ("step_retry_backoff_max", 0)])
def test_a_bad_step_setting_is_named(app: Celery, pikku: PikkuCelery, setting: str,
                                     value: Any) -> None:
    app.conf["pikku_" + setting] = value
    with pytest.raises(PikkuConfigurationError, match="pikku_" + setting):
        pikku.settings  # noqa: B018


def test_a_run_keeps_the_attempts_it_was_recorded_with(pikku: PikkuCelery) -> None:
    """``max_attempts`` is stored with the step: a run recorded under the old default (4
    attempts) keeps them after the step's definition changes."""
    calls = iter([RuntimeError("1"), RuntimeError("2")])

    def body(data: Any) -> str:
        error = next(calls, None)
        if error is not None:
            raise error
        return "ok"

    step = pikku.step(name="retries.kept", retries=3)(body)

    @pikku.workflow("retries.kept_flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("s", step, data)

    with inline(pikku, hold_timers=True) as kit:
        run_id = pikku.start("retries.kept_flow", None)
        assert kit.steps(run_id)["s"].max_attempts == 4
        pikku.step(name="retries.kept")(body)  # redeployed with the new default
        kit.release_timers()
        kit.advance("1s")
        assert kit.run(run_id).status == "completed"
        assert _statuses(kit, run_id) == ["failed", "failed", "succeeded"]


def test_wf_do_retries_wins_over_the_step(pikku: PikkuCelery, kit: InlineKit) -> None:
    @pikku.step(name="retries.call")
    def s(data: Any) -> None:
        raise RuntimeError("always")

    @pikku.workflow("retries.call_flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("s", s, data, retries=1, retry_delay=0)

    run_id = pikku.start("retries.call_flow", None)
    assert _statuses(kit, run_id) == ["failed", "failed"]
    assert kit.run(run_id).status == "failed"
