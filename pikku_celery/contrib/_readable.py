"""What a caller may read, for the JSON API (``_api``) and the dashboard's pages
(``pikku_celery.dashboard._pages``) alike: one run (unknown to a caller whose run filter
does not keep it), a page of runs, a page narrowed by time and run id prefix, a count, and
the schedules (those whose runs the caller's filter would keep: it is matched against the
input a schedule's runs get, its ``data``). Every listed run is also checked on its own
with ``read`` (``_access``).

The filter also bounds what a caller starts (``check_startable``): the run a start would
create must be one of the caller's runs, or a tenant could plant runs in another's listing
and take their concurrency slots."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib._access import READ, ApiError, Caller
from pikku_celery.model.errors import InvalidInputError, WorkflowRunNotFoundError
from pikku_celery.model.records import WorkflowRun, WorkflowSchedule
from pikku_celery.model.redaction import ValueRedactor, redact_value
from pikku_celery.store.base import run_matches


def readable_run(pikku: PikkuCelery, caller: Caller, run_id: str) -> WorkflowRun:
    """The run, if the caller's run filter keeps it; else unknown to them (404)."""
    run = pikku.get_run(run_id)
    match = caller.match()
    if match is not None and not run_matches(run.input, match):
        raise WorkflowRunNotFoundError(run_id)
    return run


def hidden_run(pikku: PikkuCelery, caller: Caller, run_id: str) -> bool:
    """Whether ``run_id`` is a run the caller may not read (``read`` refused, or their
    run filter does not keep it); ``False`` for an id no run has."""
    try:
        run = pikku.get_run(run_id)
    except WorkflowRunNotFoundError:
        return False
    match = caller.match()
    return (not caller.can(READ, run_id)
            or (match is not None and not run_matches(run.input, match)))


def check_startable(caller: Caller, data: Any) -> None:
    """Refuse (403) a start whose run the caller's run filter would not keep as theirs:
    each field the filter names must hold the filter's value itself, not inside a list
    (the filter reads ``{"owner": ["ann", "bob"]}`` as ann's and as bob's run: it would be
    planted in another's listing). The message names the filter's fields, never a value
    or the input: it is the same whatever the caller sent."""
    match = caller.match()
    if match is None:
        return
    if all(_plain(data, key.split(".")[1:]) for key in match) and run_matches(data, match):
        return
    raise ApiError(403, "PermissionDenied",
                   "not allowed to start this run: it would not be one of your runs (your "
                   f"run filter keeps the runs whose input has your value at "
                   f"{', '.join(sorted(match))}, and a list there is not yours alone)")


def _plain(value: Any, path: list[str]) -> bool:
    """Whether ``path`` in ``value`` goes through no list (a missing field is ``None``)."""
    for name in path:
        if isinstance(value, list):
            return False
        if not isinstance(value, Mapping) or name not in value:
            return True
        value = value[name]
    return not isinstance(value, list)


#: A run's forks listed with it (the oldest): its JSON and its dashboard page.
MAX_FORKS = 100


def readable_forks(pikku: PikkuCelery, caller: Caller, run_id: str) -> list[WorkflowRun]:
    """The runs forked from ``run_id`` (oldest first) that the caller may read: kept by
    their run filter and allowed ``read`` one by one, as a listing's runs are."""
    match = caller.match()
    return [f for f in pikku.list_forks(run_id, MAX_FORKS)
            if (match is None or run_matches(f.input, match)) and caller.can(READ, f.run_id)]


def readable_schedules(pikku: PikkuCelery, caller: Caller,
                       stored: Iterable[WorkflowSchedule] | None = None
                       ) -> list[WorkflowSchedule]:
    """The schedules (``stored``, else the store's) whose runs the caller's run filter
    keeps (all without a filter)."""
    match = caller.match()
    return [s for s in (pikku.list_schedules() if stored is None else stored)
            if match is None or run_matches(s.data, match)]


def unsaved_schedules(pikku: PikkuCelery, caller: Caller,
                      stored: Iterable[WorkflowSchedule]) -> list[str]:
    """The names of the schedules this process declares that are not ``stored`` yet and
    whose runs the caller's filter keeps (matched against the declared ``data``): a
    schedule the filter hides is never named, stored or not."""
    saved = {s.name for s in stored}
    match = caller.match()
    return sorted(name for name, declared in pikku.registry.schedules.items()
                  if name not in saved and (match is None or run_matches(declared.data, match)))


def readable_schedule(pikku: PikkuCelery, caller: Caller, name: str) -> WorkflowSchedule:
    """The schedule ``name``; ``InvalidInputError`` ("no schedule named", a 404) for one
    that is unknown, or whose runs the caller's filter does not keep."""
    schedule = pikku.get_schedule(name)
    match = caller.match()
    if match is not None and not run_matches(schedule.data, match):
        raise InvalidInputError(f"no schedule named {name!r}")
    return schedule


def readable_page(pikku: PikkuCelery, caller: Caller, *, workflow: str | None,
                  status: str | None, limit: int, before: str | None
                  ) -> tuple[list[WorkflowRun], str | None]:
    """A page of the runs the caller may read, newest first, and the ``before`` of the
    next page. The page is a store query with the caller's run filter (``match``); the
    cursor must be a run they may read; every run is then checked with ``read`` on its
    own, and a refused one is left out (the page can come back short, never with
    another's run)."""
    cursor = None
    if before:
        if not caller.can(READ, before):
            raise WorkflowRunNotFoundError(before)
        cursor = readable_run(pikku, caller, before)
    runs = pikku.list_runs(workflow=workflow, status=status, limit=limit,
                           created_before=cursor, match=caller.match())
    more = runs[-1].run_id if len(runs) == limit else None
    return [r for r in runs if caller.can(READ, r.run_id)], more


#: A run-id search reads at most this many runs (newest first, within the other filters)
#: for one page: the store has no prefix filter, so the page is filtered as it is read.
SEARCH_BATCH = 200
MAX_SEARCHED = 2_000


@dataclass(frozen=True)
class RunSearch:
    """The runs page's narrower filters: created in ``[after_ms, before_ms)`` and a run id
    starting with ``prefix`` (each ``None``: any)."""

    after_ms: int | None = None
    before_ms: int | None = None
    prefix: str | None = None

    @property
    def narrows(self) -> bool:
        return (self.after_ms, self.before_ms, self.prefix) != (None, None, None)


def readable_search(pikku: PikkuCelery, caller: Caller, search: RunSearch, *,
                    workflow: str | None, status: str | None, limit: int,
                    before: str | None) -> tuple[list[WorkflowRun], str | None, bool]:
    """``readable_page`` narrowed by ``search``: the page, the ``before`` of the next
    page, and whether the search gave up before the range ended (it read
    ``MAX_SEARCHED`` runs without filling the page; the next page reads on).

    The time range is part of the store query (its upper bound is the listing's
    ``created_before_ms``; the listing is newest first, so the runs after ``after_ms``
    are the start of it and reading stops at the first older one). The store has no
    run-id prefix filter: the runs read are filtered here, ``SEARCH_BATCH`` at a time."""
    bound_ms: int | None = search.before_ms
    bound_id: str | None = None
    if before:
        if not caller.can(READ, before):
            raise WorkflowRunNotFoundError(before)
        cursor = readable_run(pikku, caller, before)
        cursor_ms = round(cursor.created_at.timestamp() * 1000)
        if bound_ms is None or cursor_ms < bound_ms:
            bound_ms, bound_id = cursor_ms, cursor.run_id
    kept: list[WorkflowRun] = []
    read = 0
    batch = limit if search.prefix is None else SEARCH_BATCH
    while True:
        runs = pikku.engine.store.list_runs(
            workflow=workflow, status=status, limit=batch, created_before_ms=bound_ms,
            before_run_id=bound_id, **({} if caller.match() is None
                                       else {"match": caller.match()}))
        read += len(runs)
        for run in runs:
            if search.after_ms is not None and \
                    run.created_at.timestamp() * 1000 < search.after_ms:
                return kept, None, False  # the range ended
            if search.prefix is None or run.run_id.startswith(search.prefix):
                if caller.can(READ, run.run_id):
                    kept.append(run)
                if len(kept) == limit:
                    return kept, run.run_id, False
        if len(runs) < batch:
            return kept, None, False  # no more runs
        bound_ms = round(runs[-1].created_at.timestamp() * 1000)
        bound_id = runs[-1].run_id
        if read >= MAX_SEARCHED:
            return kept, bound_id, True


def readable_count(pikku: PikkuCelery, caller: Caller, status: str, *,
                   workflow: str | None, limit: int) -> int:
    """How many runs of ``status`` the caller's run filter keeps, up to ``limit``."""
    return pikku.count_runs(status, workflow=workflow, limit=limit, match=caller.match())


def readable_queued(pikku: PikkuCelery, caller: Caller, run: WorkflowRun,
                    redact: ValueRedactor | None) -> dict[str, Any] | None:
    """Why ``run`` waits ``queued``, as the caller may see it: the key (through the
    ``redact_value`` hook, ``"concurrency_key"``), the limit, how many runs come before it,
    the runs holding the slots that the caller may read (``holders``) and how many others
    do (``other_holders``: never their ids). ``None`` for a run that is not queued."""
    why = pikku.why_queued(run.run_id) if run.status == "queued" else None
    if why is None:
        return None
    mine = [h for h in why.holders if _readable_holder(pikku, caller, h)]
    return {"key": redact_value(why.key, "concurrency_key", redact), "limit": why.limit,
            "ahead": why.ahead, "holders": mine,
            "other_holders": len(why.holders) - len(mine)}


def _readable_holder(pikku: PikkuCelery, caller: Caller, run_id: str) -> bool:
    """Whether a slot holder may be named to the caller: it exists and their ``read`` and
    run filter keep it (one read of the run)."""
    try:
        readable_run(pikku, caller, run_id)
    except WorkflowRunNotFoundError:
        return False
    return caller.can(READ, run_id)
