"""When a failed step attempt is tried again, and after how long: Celery's vocabulary.

A step's body tries once unless it asks for more, like a Celery task; an attempt whose
worker was lost (its lease lapsed: killed, out of memory, a host gone) runs again, as Celery
redelivers an ``acks_late`` task, up to 3 times. What a step may say, each meaning what it
means in Celery (``Task.autoretry_for`` & co):

- ``retries`` (or its alias ``max_retries``): the retries after the first attempt, so
  ``retries + 1`` attempts however an attempt ends (an error, a lost worker); ``retries=0``
  is at most once: a lost worker's attempt fails the step too;
- ``autoretry_for``: only an exception of these classes is retried, any other fails the
  step at once; ``no_retry_for``: these never are (Celery's ``dont_autoretry_for``);
- ``retry_delay``: a fixed wait before each retry; or ``retry_backoff`` (``True``: 1 s, or
  a number of seconds): the wait doubles per retry, ``backoff * 2 ** n`` before retry n + 1
  (n counted from 0), at most ``retry_backoff_max`` (600 s), and with ``retry_jitter``
  (default ``True``, as in Celery) a random wait from 0 up to that. Both on one step is an
  error; a ``wf.do(retry_delay=...)`` of one call wins over either. With neither, the wait
  is pikku's own: 1 s doubling per retry, at most 300 s, no jitter.

What a step leaves out comes from the app's ``pikku_step_*`` settings (``StepDefaults``,
read by ``worker.config``): ``pikku_step_retries``, ``pikku_step_autoretry_for``,
``pikku_step_retry_backoff``, ``pikku_step_retry_backoff_max``, ``pikku_step_retry_jitter``.
A step with no count anywhere gets 3 retries, Celery's ``max_retries`` default: for the
errors of ``autoretry_for`` (its own or the app's) if it has one, else for lost workers only
(``StepState.errors_retried`` false: its body's error is not tried again).

When each is decided: the attempts when replay first records the step (``max_attempts`` is
stored with it, so a run keeps the budget it started with, whatever the code says later);
whether to retry and the wait when an attempt fails (``engine.execution``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pikku_celery.model.dotted import import_dotted
from pikku_celery.model.durations import Duration, to_ms
from pikku_celery.model.errors import InvalidInputError, PikkuConfigurationError

DEFAULT_RETRIES = 0  # a body's error is not retried unless asked, like a Celery task
CELERY_MAX_RETRIES = 3  # Celery's ``Task.max_retries``: what ``autoretry_for`` alone gives
DEFAULT_RETRY_DELAY_MS = 1000  # pikku's own wait before the first retry, doubled per retry
MAX_DEFAULT_DELAY_MS = 300_000
DEFAULT_BACKOFF_MAX_MS = 600_000  # Celery's ``retry_backoff_max``
MAX_RETRIES = 1000
_MAX_DOUBLINGS = 40  # past any cap: 2 ** 40 s is 35,000 years

Errors = tuple[type[BaseException], ...]


def check_retries(retries: object, what: str) -> int:
    if isinstance(retries, bool) or not isinstance(retries, int) or not (
            0 <= retries <= MAX_RETRIES):
        raise InvalidInputError(f"{what}: retries must be an int from 0 to {MAX_RETRIES}, "
                                f"got {retries!r}")
    return retries


@dataclass(frozen=True)
class StepDefaults:
    """The app's ``pikku_step_*`` settings: what a step that does not say gets."""

    retries: int | None = None  # None: 0, or CELERY_MAX_RETRIES with autoretry_for
    autoretry_for: Errors | None = None  # None: every ``Exception``
    backoff_ms: int = 0  # 0: no Celery backoff, pikku's own delays
    backoff_max_ms: int = DEFAULT_BACKOFF_MAX_MS
    jitter: bool = True


NO_DEFAULTS = StepDefaults()


@dataclass(frozen=True)
class RetryPolicy:
    """A step's own retry choices (``None``: not said, the app's ``StepDefaults`` decide)."""

    retries: int | None = None
    delay_ms: int | None = None  # a fixed wait
    autoretry_for: Errors | None = None
    no_retry_for: Errors = ()
    backoff_ms: int | None = None  # 0: no backoff, even if the app sets one
    backoff_max_ms: int | None = None
    jitter: bool | None = None

    def max_attempts(self, defaults: StepDefaults = NO_DEFAULTS) -> int:
        """``retries + 1``: the step's count, else the app's, else Celery's 3 (the retries
        of ``autoretry_for``'s errors, or, for a step that said nothing, of a lost worker's
        attempts only: ``errors_retried``)."""
        if self.retries is not None:
            return self.retries + 1
        if defaults.retries is not None:
            return defaults.retries + 1
        return CELERY_MAX_RETRIES + 1

    def errors_retried(self, defaults: StepDefaults = NO_DEFAULTS) -> bool:
        """Whether an error in the body may be tried again at all: when a count or
        ``autoretry_for`` was given (the step's or the app's). A step that said nothing
        tries its body once, as a Celery task does; only an attempt whose worker was lost
        (its lease lapsed) runs again, as ``acks_late`` redelivers a task."""
        kinds = self.autoretry_for if self.autoretry_for is not None else defaults.autoretry_for
        return self.retries is not None or defaults.retries is not None or kinds is not None

    def retries_on(self, exc: BaseException, defaults: StepDefaults = NO_DEFAULTS) -> bool:
        """Whether an attempt that raised ``exc`` may be tried again (attempts allowing)."""
        if isinstance(exc, self.no_retry_for):
            return False
        kinds = self.autoretry_for if self.autoretry_for is not None else defaults.autoretry_for
        return kinds is None or isinstance(exc, kinds)

    def delay_ms_before(self, next_attempt: int, override_ms: int | None = None,
                        defaults: StepDefaults = NO_DEFAULTS,
                        randint: Callable[[int, int], int] = random.randint) -> int:
        """The wait before ``next_attempt`` (2, 3, ...): ``override_ms`` (a
        ``wf.do(retry_delay=...)``), else the step's ``retry_delay``, else Celery's backoff
        (the step's, else the app's), else pikku's own doubling delay."""
        if override_ms is not None:
            return override_ms
        if self.delay_ms is not None:
            return self.delay_ms
        doublings = min(max(0, next_attempt - 2), _MAX_DOUBLINGS)  # Celery's request.retries
        backoff_ms = self.backoff_ms if self.backoff_ms is not None else defaults.backoff_ms
        if not backoff_ms:
            return min(DEFAULT_RETRY_DELAY_MS << doublings, MAX_DEFAULT_DELAY_MS)
        cap = self.backoff_max_ms if self.backoff_max_ms is not None else defaults.backoff_max_ms
        delay = min(backoff_ms << doublings, cap)
        jitter = self.jitter if self.jitter is not None else defaults.jitter
        return randint(0, delay) if jitter else delay  # Celery's full jitter


def retry_policy(what: str, *, retries: int | None = None, max_retries: int | None = None,
                 retry_delay: Duration | None = None, autoretry_for: Any = None,
                 no_retry_for: Any = (), retry_backoff: bool | Duration | None = None,
                 retry_backoff_max: Duration | None = None,
                 retry_jitter: bool | None = None) -> RetryPolicy:
    """A step's decorator arguments as a policy; ``InvalidInputError`` (a ``ValueError``)
    names ``what`` for a bad value, or for two arguments that contradict each other."""
    if retries is not None and max_retries is not None and retries != max_retries:
        raise InvalidInputError(f"{what}: retries={retries!r} and max_retries="
                                f"{max_retries!r} disagree (max_retries is another name "
                                "for retries: give one)")
    count = retries if retries is not None else max_retries
    backoff_ms = None if retry_backoff is None else backoff_of(retry_backoff, what)
    if retry_delay is not None and backoff_ms:
        raise InvalidInputError(f"{what}: retry_delay (a fixed wait) and retry_backoff (a "
                                "growing one) cannot both be given")
    if retry_jitter is not None and not isinstance(retry_jitter, bool):
        raise InvalidInputError(f"{what}: retry_jitter must be True or False, got "
                                f"{retry_jitter!r}")
    return RetryPolicy(
        retries=None if count is None else check_retries(count, what),
        delay_ms=None if retry_delay is None else to_ms(retry_delay, what="retry_delay"),
        autoretry_for=None if autoretry_for is None else errors_of(
            autoretry_for, f"{what}: autoretry_for"),
        no_retry_for=errors_of(no_retry_for, f"{what}: no_retry_for"),
        backoff_ms=backoff_ms,
        backoff_max_ms=None if retry_backoff_max is None else positive_ms(
            retry_backoff_max, f"{what}: retry_backoff_max"),
        jitter=retry_jitter)


def backoff_of(value: object, what: str) -> int:
    """Celery's ``retry_backoff``: ``True`` is 1 s, ``False`` (or 0) none, a number (or a
    duration) the first retry's wait."""
    if value is True:
        return 1000
    if value is False:
        return 0
    try:
        return to_ms(value, what=f"{what}: retry_backoff")  # type: ignore[arg-type]
    except ValueError as exc:
        raise InvalidInputError(f"{exc} (use True, False or a number of seconds)") from None


def errors_of(value: object, what: str) -> Errors:
    """Exception classes: a tuple (or list, set) of them, or one."""
    if isinstance(value, type) and issubclass(value, BaseException):
        return (value,)
    if isinstance(value, list | tuple | set | frozenset) and all(
            isinstance(kind, type) and issubclass(kind, BaseException) for kind in value):
        return tuple(value)
    raise InvalidInputError(f"{what} must be a tuple of exception classes, such as "
                            f"(ConnectionError,), got {value!r}")


def positive_ms(value: Duration, what: str) -> int:
    ms = to_ms(value, what=what)
    if ms <= 0:
        raise InvalidInputError(f"invalid {what}: {value!r} (must be greater than zero)")
    return ms


def step_defaults(read: Callable[[str], Any], name_of: Callable[[str], str]) -> StepDefaults:
    """The app's ``pikku_step_*`` settings: ``read(name)`` is the value of ``pikku_<name>``
    (``None``: unset), ``name_of(name)`` how an error names it. Settings from a file or the
    environment may be strings: ``"3"``, ``"true"``, and for ``autoretry_for`` class names
    or dotted paths (``"ConnectionError, requests.exceptions:Timeout"``). Raises
    ``PikkuConfigurationError`` naming the setting."""
    def get(name: str, parse: Callable[[Any], Any]) -> Any:
        value = read("step_" + name)
        if value is None or value == "":
            return None
        try:
            return parse(_from_text(value))
        except (ValueError, ImportError, AttributeError) as exc:
            raise PikkuConfigurationError(
                f"invalid {name_of('step_' + name)}: {value!r} ({exc})") from None

    jitter = get("retry_jitter", _flag)
    return StepDefaults(
        retries=get("retries", lambda v: check_retries(v, "pikku_step_retries")),
        autoretry_for=get("autoretry_for", lambda v: errors_of(_imported(v), "autoretry_for")),
        backoff_ms=get("retry_backoff", lambda v: backoff_of(v, "pikku_step_retry_backoff"))
        or 0,
        backoff_max_ms=get("retry_backoff_max", lambda v: positive_ms(v, "retry_backoff_max"))
        or DEFAULT_BACKOFF_MAX_MS,
        jitter=True if jitter is None else jitter)


def _from_text(value: Any) -> Any:
    """A setting from the environment is a string: ``"3"`` is 3, ``"true"`` is True."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "yes", "on", "false", "no", "off"):
            return text in ("true", "yes", "on")
        if text.replace(".", "", 1).isdigit():
            return float(text) if "." in text else int(text)
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("use True or False")
    return value


def _imported(value: Any) -> Any:
    """Exception classes, named or given: a bare name is a builtin (``ConnectionError``)."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list | tuple):
        return tuple(import_dotted(v if "." in v or ":" in v else f"builtins:{v}")
                     if isinstance(v, str) else v for v in value)
    return value
