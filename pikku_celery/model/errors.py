"""One error tree: everything the library raises on purpose derives from ``PikkuError``."""

from __future__ import annotations


class PikkuError(Exception):
    """Root of every error pikku-celery raises on purpose.

    ``args`` holds the constructor's arguments, so an error survives pickling and Celery's
    JSON exception round trip (both rebuild it as ``cls(*args)``); ``str()`` is the message.
    """

    _message: str | None = None

    def __str__(self) -> str:
        return self._message if self._message is not None else super().__str__()


class WorkflowStepSupersededError(PikkuError):
    """A write came from an attempt that no longer owns the step; nothing was changed."""

    def __init__(
        self, run_id: str, step_name: str, attempt: int, current_attempt: int | None = None
    ):
        self.run_id = run_id
        self.step_name = step_name
        self.attempt = attempt
        self.current_attempt = current_attempt
        super().__init__(run_id, step_name, attempt, current_attempt)
        if current_attempt is not None and current_attempt != attempt:
            how = f"superseded by attempt {current_attempt}"
        else:
            how = "fenced (the step was cancelled or already settled)"
        self._message = (f"step {step_name!r} of run {run_id}: attempt {attempt} was {how}; "
                         "its write was refused")


class WorkflowStepLeaseExpiredError(PikkuError):
    """The step's worker stopped renewing its lease and no attempts are left."""

    def __init__(self, run_id: str, step_name: str, attempt: int):
        self.run_id = run_id
        self.step_name = step_name
        self.attempt = attempt
        super().__init__(run_id, step_name, attempt)
        self._message = (f"step {step_name!r} of run {run_id} lost its worker on attempt "
                         f"{attempt} (lease expired) and has no attempts left")


class WorkflowStepFunctionMismatchError(PikkuError):
    """A step message named a different function than the workflow dispatched."""

    def __init__(self, run_id: str, step_name: str, expected: str | None, got: str | None):
        self.run_id = run_id
        self.step_name = step_name
        self.expected = expected
        self.got = got
        super().__init__(run_id, step_name, expected, got)
        self._message = (f"step {step_name!r} of run {run_id} was dispatched as {expected!r} "
                         f"but the message names {got!r}; refused before any write")


class WorkflowNotFoundError(PikkuError):
    """No workflow is registered under this name. ``known``: the names that are (a typo
    shows beside them; none at all means the module defining them was never imported)."""

    def __init__(self, name: str, known: tuple[str, ...] | list[str] | None = None):
        self.name = name
        self.known = None if known is None else tuple(known)
        super().__init__(name, self.known)
        message = f"no workflow named {name!r} is registered"
        if self.known:
            shown = ", ".join(repr(k) for k in sorted(self.known)[:20])
            message += f" (registered: {shown}{', ...' if len(self.known) > 20 else ''})"
        elif self.known is not None:
            message += (" (none is: the module that defines it was not imported in this "
                        "process. With Django, add 'pikku_celery.contrib.django' to "
                        "INSTALLED_APPS, which imports every app's workflows.py; with "
                        "Celery alone, import it where the app is made, or list it in the "
                        "app's include=/imports)")
        self._message = message


class WorkflowRunNotFoundError(PikkuError):
    """No run has this id."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        super().__init__(run_id)
        self._message = f"no workflow run with id {run_id!r}"


class WorkflowRunConflictError(PikkuError):
    """A run id given to ``start`` already names a run of another workflow or input.

    Starting with a chosen ``run_id`` is idempotent only for the *same* start: a different
    workflow or input under that id is a caller's mistake (or another caller's id) and must
    never silently return somebody else's run."""

    def __init__(self, run_id: str, reason: str):
        self.run_id = run_id
        self.reason = reason
        super().__init__(run_id, reason)
        self._message = f"run id {run_id!r} is already taken: {reason}"


class WorkflowStepNotFoundError(PikkuError):
    """The run has no step with this name."""

    def __init__(self, run_id: str, step_name: str):
        self.run_id = run_id
        self.step_name = step_name
        super().__init__(run_id, step_name)
        self._message = f"run {run_id} has no step named {step_name!r}"


class WorkflowRunFailedError(PikkuError):
    """Raised into a workflow (or to a caller) when a step or child run failed for good."""

    def __init__(self, message: str, error: dict[str, object] | None = None):
        self.error = error or {}
        super().__init__(message, error)
        self._message = message


class WorkflowCancelledError(PikkuError):
    """The run was cancelled; raised to bodies that check their context and to waiters."""

    def __init__(self, run_id: str, reason: str | None = None):
        self.run_id = run_id
        self.reason = reason
        super().__init__(run_id, reason)
        self._message = f"run {run_id} was cancelled" + (f": {reason}" if reason else "")


class WorkflowApprovalError(PikkuError):
    """An approval decision was refused: the run does not wait on that approval (never
    reached, already decided, expired or ended), the decision does not match the gate's
    schema, or ``by`` is not one of its approvers. Nothing was recorded: a run waiting on the
    gate stays suspended, so a corrected decision can still be given."""

    def __init__(self, run_id: str, name: str, reason: str):
        self.run_id = run_id
        self.name = name
        self.reason = reason
        super().__init__(run_id, name, reason)
        self._message = f"approval {name!r} of run {run_id} refused: {reason}"


class WorkflowEventError(PikkuError):
    """An event was refused: the run it was sent to has ended, or the send is past one
    of the run's limits on events (``WorkflowEventLimitError``; an unknown run raises
    ``WorkflowRunNotFoundError``). Nothing was recorded."""

    def __init__(self, run_id: str, name: str, reason: str):
        self.run_id = run_id
        self.name = name
        self.reason = reason
        super().__init__(run_id, name, reason)
        self._message = f"event {name!r} for run {run_id} refused: {reason}"


class WorkflowEventLimitError(WorkflowEventError):
    """An event was refused for one of the limits every run has on its events (the
    ``pikku_max_event_bytes`` and ``pikku_max_events_per_run`` settings): ``limit`` names
    it (``MAX_EVENT_BYTES``: the payload is ``found`` bytes as JSON, over ``maximum``;
    ``MAX_EVENTS_PER_RUN``: the run has kept ``found`` events, its ``maximum``). Nothing
    was recorded; the run's events stay as they were (a key already sent still returns
    its first send's event)."""

    MAX_EVENT_BYTES = "max_event_bytes"
    MAX_EVENTS_PER_RUN = "max_events_per_run"

    def __init__(self, run_id: str, name: str, limit: str, maximum: int, found: int):
        if limit == self.MAX_EVENT_BYTES:
            reason = (f"its payload is {found} bytes as JSON, over the {maximum}-byte limit "
                      f"of an event (the pikku_{limit} setting): store large data elsewhere "
                      "and send its key")
        else:
            reason = (f"the run has kept {found} events, its limit (the pikku_{limit} "
                      "setting)")
        super().__init__(run_id, name, reason)
        self.args = (run_id, name, limit, maximum, found)
        self.limit = limit
        self.maximum = maximum
        self.found = found

    @property
    def too_large(self) -> bool:
        """Whether the payload is too large (else: the run has too many events)."""
        return self.limit == self.MAX_EVENT_BYTES


class WorkflowEventNotSentError(PikkuError):
    """A send could not reach the store: its writes kept failing (a MongoDB primary
    election that outlasted the send's retries, an outage) until its deadline passed.

    ``may_be_kept`` says what the caller can do: ``False``, none of the send's writes
    reached the store, and sending again delivers the event once; ``True``, one may have
    (its answer was lost), and the event may be in the run: an unkeyed send repeated can
    then deliver it twice, a keyed one never does (send it again with the same key)."""

    def __init__(self, run_id: str, name: str, may_be_kept: bool, reason: str):
        self.run_id = run_id
        self.name = name
        self.may_be_kept = may_be_kept
        self.reason = reason
        super().__init__(run_id, name, may_be_kept, reason)
        kept = ("it may have been kept" if may_be_kept else "nothing was kept")
        self._message = f"event {name!r} for run {run_id} not sent ({kept}): {reason}"


class WorkflowReplayError(PikkuError):
    """A replay met a recorded step that the workflow code no longer reaches the same way."""


class LeaseTakenError(PikkuError):
    """Another holder has the lease; the caller does not wait."""

    def __init__(self, key: str):
        self.key = key
        super().__init__(key)
        self._message = f"lease {key!r} is held by another holder"


class LeaseLostError(PikkuError):
    """The lease was lost (refused renewal, or unconfirmed past its expiry)."""

    def __init__(self, key: str):
        self.key = key
        super().__init__(key)
        self._message = f"lease {key!r} was lost"


class InvalidInputError(PikkuError, ValueError):
    """Input that can never be stored: a bad name, key, value or option."""


class PikkuConfigurationError(PikkuError):
    """pikku cannot be set up from what it was given: a required setting (a store or lease
    service URL) is missing, or a setting has a value pikku cannot use. Raised when pikku is
    first used, not at import: the message names the setting to set."""
