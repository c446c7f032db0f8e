"""The read and operate half of ``PikkuCelery``: read runs, their steps and history, wait
for a run, resume, approve and cancel it, send it events, list and count runs, purge ended
ones, sweep for lost work; declare, list, pause, resume and trigger schedules. Each call
goes to the engine (``engine.Engine``); nothing here sends a message itself.
``PikkuCelery`` inherits it; the CLI and the web API call these methods, never the store."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pikku_celery.engine.events import Events
from pikku_celery.engine.facade import Engine
from pikku_celery.model.durations import Duration
from pikku_celery.model.records import (
    RUN_TERMINAL,
    QueuedReason,
    StepAttempt,
    StepState,
    WorkflowEvent,
    WorkflowRun,
    WorkflowSchedule,
)
from pikku_celery.schedules.firing import Scheduler
from pikku_celery.store.base import RunMatch
from pikku_celery.workflow.definitions import Registry
from pikku_celery.workflow.schedule_spec import ScheduleDefinition, make_schedule


class ScheduleOperations:
    """Schedules (``pikku_celery.schedules``): declare one, list them, pause, resume and
    trigger one. On the engine ``engine`` gives and the registry ``registry`` holds."""

    registry: Registry

    @property
    def engine(self) -> Engine:
        raise NotImplementedError

    def schedule(self, name: str, workflow: str | Callable[..., Any], *,
                 cron: str | None = None, every: Duration | None = None, data: Any = None,
                 tz: str = "UTC", catch_up: str = "latest") -> ScheduleDefinition:
        """Start a run of ``workflow`` with input ``data`` at each tick: each instant the
        cron expression ``cron`` names in time zone ``tz``, or each multiple of ``every``
        (a duration, at least 1 s) since the Unix epoch. Exactly one run per tick, however
        many workers fire it and across restarts; ``wf.scheduled_for`` is its tick. Every
        worker of the app fires due ticks (no beat process). ``catch_up`` says what the
        ticks missed while no worker ran start: ``"latest"`` only the most recent,
        ``"all"`` each of them (bounded), ``"none"`` none. Declare it where the workflow
        is declared, after it, so every worker imports it; a worker writes its
        declarations to the store when it starts. ``InvalidInputError`` naming what is
        wrong: an unknown workflow, a bad cron, both or neither of ``cron`` and ``every``,
        a bad ``tz`` or ``catch_up``, a name already used for another definition."""
        named = workflow if isinstance(workflow, str) else str(
            getattr(getattr(workflow, "pikku_workflow", None), "name", None)
            or getattr(workflow, "__name__", repr(workflow)))
        definition = make_schedule(name, named, cron=cron, every=every, data=data, tz=tz,
                                   catch_up=catch_up,
                                   workflow_known=lambda w: w in self.registry.workflows)
        self.registry.add_schedule(definition)
        return definition

    def list_schedules(self) -> list[WorkflowSchedule]:
        """Every schedule in the store, by name, each with its definition, whether it is
        paused, its next tick, its latest tick and that tick's run id, and ``declared``:
        whether this process declares it (one no worker declares any more never fires)."""
        return self._scheduler.list()

    def get_schedule(self, name: str) -> WorkflowSchedule:
        """The schedule ``name``; ``InvalidInputError`` for one neither stored nor
        declared here."""
        return self._scheduler.get(name)

    def pause_schedule(self, name: str) -> bool:
        """Stop the schedule's ticks until ``resume_schedule``; ``False`` when it was
        paused already. Durable, for every worker."""
        return self._scheduler.pause(name)

    def resume_schedule(self, name: str) -> bool:
        """Resume a paused schedule from its first tick after now: the ticks that fell
        while it was paused start nothing (``catch_up`` is for ticks missed while no worker
        ran, not for a pause). ``False`` when it was not paused."""
        return self._scheduler.resume(name)

    def trigger_schedule(self, name: str) -> str:
        """Start the schedule's workflow now, paused or not, as a tick of this instant
        (its run's ``scheduled_for``); the ticks go on as before. Returns the run id."""
        return self._scheduler.trigger(name)

    @property
    def _scheduler(self) -> Scheduler:
        return Scheduler(self.engine)


class RunOperations(ScheduleOperations):
    """What callers do with runs, on the engine ``engine`` gives (``PikkuCelery``'s)."""

    @property
    def engine(self) -> Engine:
        raise NotImplementedError

    def get_run(self, run_id: str) -> WorkflowRun:
        return self.engine.get_run(run_id)

    def get_steps(self, run_id: str) -> list[StepState]:
        return self.engine.get_steps(run_id)

    def get_history(self, run_id: str) -> list[StepAttempt]:
        return self.engine.get_history(run_id)

    def why_queued(self, run_id: str) -> QueuedReason | None:
        """Why the run waits ``queued``: its key, its workflow's concurrency limit, the runs
        holding the slots and how many queued runs come before it; ``None`` when the run
        is not queued. ``WorkflowRunNotFoundError`` for an unknown run."""
        return self.engine.why_queued(run_id)

    def wait(self, run_id: str, timeout: float) -> WorkflowRun:
        """Block until the run is completed, failed or cancelled and return it;
        ``TimeoutError`` only when ``timeout`` seconds pass first. Woken by the run's end
        as it is written (an announcement on Redis), not by polling; a backstop read every
        second at most covers an announcement lost."""
        return self.engine.wait(run_id, timeout)

    def resume(self, run_id: str) -> bool:
        """Resume a run suspended by ``wf.suspend(reason)``. Returns ``False`` if it was not
        suspended."""
        return self.engine.resume(run_id)

    def approve(self, run_id: str, name: str, decision: Any, *, by: str | None = None
                ) -> StepState:
        """Record ``decision`` for the run's ``wf.approval(name, ...)`` gate and wake the
        run; the decision becomes the gate's result. Raises ``WorkflowApprovalError``,
        recording nothing, when the run does not wait on that gate, ``by`` is not one of
        its ``approvers``, or the decision does not match its ``schema``."""
        return self.engine.approve(run_id, name, decision, by=by)

    def cancel(self, run_id: str, reason: str | None = None) -> bool:
        """Cancel the run durably; in-flight steps are fenced and told through their
        context. Returns ``False`` if the run had already ended."""
        return self.engine.cancel(run_id, reason)

    def retry(self, run_id: str, *, by: str | None = None) -> bool:
        """Run a failed or cancelled run again from where it stopped: its succeeded steps
        are replayed, each step its end left failed (a body's error, a cancel's fence) gets
        a fresh attempt budget, and every earlier attempt stays in its history; its failed
        or cancelled child runs are retried too. ``False`` (nothing done) for a run in any
        other status. ``WorkflowRunNotFoundError`` for an unknown run. ``by``: who retries,
        recorded in the run's ``lineage`` with the time of the retry."""
        return self.engine.retry(run_id, by=by)

    def fork(self, run_id: str, *, from_step: str, new_run_id: str | None = None,
             keep_decisions: bool = False, by: str | None = None) -> str:
        """Start a new run of ``run_id``'s workflow and input that replays the steps it
        recorded before ``from_step`` (their results copied) and runs the rest afresh,
        ``from_step`` included, whatever the old run's status (Temporal's reset, DBOS's
        fork). Returns the new run's id; the new run names its source
        (``WorkflowRun.forked_from``) and the fork (its first ``lineage`` entry, with
        ``by``: who forks).

        Approvals and event waits are not copied: the new run asks each again (its own
        approver decides, its own events are taken), unless ``keep_decisions=True``.
        ``new_run_id``: the new run's id (the contract's second ``run_id``, which Python
        cannot name twice): the same fork repeated returns that run again; any other run
        under that id is ``WorkflowRunConflictError`` (a fork never writes into a run it
        did not create). ``InvalidInputError`` when the run recorded no ``from_step``."""
        return self.engine.fork(run_id, from_step, new_run_id, keep_decisions=keep_decisions,
                                by=by)

    def list_forks(self, run_id: str, limit: int = 50) -> list[WorkflowRun]:
        """The runs forked from ``run_id``, oldest first, at most ``limit`` (1 to 1000)."""
        return self.engine.store.list_forks(run_id, limit)

    def list_runs(self, *, workflow: str | None = None, status: str | None = None,
                  limit: int = 50, created_before: WorkflowRun | None = None,
                  match: RunMatch | None = None) -> list[WorkflowRun]:
        """Newest first, at most ``limit``; pass the last run of a page as
        ``created_before`` for the next page. ``match`` (``{"input.<path>": value}``, at
        most 8 plain values) keeps the runs whose input has those values, in the query:
        a page still holds ``limit`` matching runs. Raises ``InvalidInputError`` for a
        ``match`` that names no input field or holds anything but a plain value."""
        before_ms = before_id = None
        if created_before is not None:
            before_ms = round(created_before.created_at.timestamp() * 1000)
            before_id = created_before.run_id
        return self.engine.store.list_runs(workflow=workflow, status=status, limit=limit,
                                           created_before_ms=before_ms,
                                           before_run_id=before_id,
                                           **_matching(match))

    def count_runs(self, status: str, *, workflow: str | None = None,
                   limit: int = 10_000, match: RunMatch | None = None) -> int:
        """How many runs have ``status`` (and ``workflow``, and ``match`` as for
        ``list_runs``), counting at most ``limit`` (an index-served count that stops
        there)."""
        return int(self.engine.store.count_runs(status=status, workflow=workflow,
                                                limit=limit, **_matching(match)))

    def purge(self, older_than: Duration, *, statuses: Iterable[str] = RUN_TERMINAL,
              dry_run: bool = False, batch: int = 500) -> int:
        """Delete the runs that ended (``statuses``: completed, failed, cancelled) more
        than ``older_than`` ago, with their steps and history, ``batch`` runs per round
        trip; never a live run. Returns how many were deleted (with ``dry_run``: would
        be, deleting nothing). See ``pikku_celery.worker.retention``."""
        from pikku_celery.worker.retention import purge

        return purge(self.engine, older_than, statuses=statuses, dry_run=dry_run,
                     batch=batch)

    def send_event(self, run_id: str, name: str, payload: Any = None, *,
                   key: str | None = None) -> WorkflowEvent:
        """Send the event ``name`` with ``payload`` to the run and wake it: its next
        ``wf.wait_for_event(name)`` returns the payload (events wait, in the order sent,
        until a wait takes them). ``key`` makes the send idempotent: a send with a key
        already sent to this run returns the first send's event and delivers nothing more.
        ``WorkflowRunNotFoundError`` for an unknown run, ``WorkflowEventError`` for one that
        has ended, ``WorkflowEventLimitError`` (a ``WorkflowEventError``) for a payload
        over ``pikku_max_event_bytes`` as JSON or a run that has kept
        ``pikku_max_events_per_run`` events; nothing is kept then."""
        return self._events.send(run_id, name, payload, key=key)

    def get_event(self, run_id: str, key: str, default: Any = None) -> Any:
        """The value the run last published under ``key`` with ``wf.set_event``;
        ``default`` when it has published none."""
        return self._events.get(run_id, key, default)

    def list_events(self, run_id: str, limit: int = 1000, *, after: int = 0,
                    payloads: bool = True) -> list[WorkflowEvent]:
        """The events sent to the run, in the order they were sent (taken or not): at
        most ``limit``, those whose ``seq`` is over ``after`` (the next page: the last
        ``seq`` of this one). Without ``payloads``, no payload is read (each event's
        ``payload`` is ``None``, its ``size`` says how large it is)."""
        return self._events.list(run_id, limit, after=after, payloads=payloads)

    @property
    def _events(self) -> Events:
        return Events(self.engine)

    def reap(self) -> dict[str, int]:
        """Sweep for lost work now (workers also do this every ``reaper_interval``)."""
        return self.engine.reap()



def _matching(match: RunMatch | None) -> dict[str, Any]:
    """``match`` as the store's keyword, only when given (a store from before ``match``
    is still called as it was)."""
    return {} if match is None else {"match": match}
