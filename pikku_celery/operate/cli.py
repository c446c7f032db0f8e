"""The ``pikku`` command group (click), shared by every way of running it.

``celery -A proj pikku ...`` runs it through Celery's ``celery.commands`` entry point
(``pikku_celery_commands``, which imports this module only when its commands are used; the
commands take the ``PikkuCelery`` bound to the app Celery's CLI loaded);
``python manage.py pikku ...`` and ``flask pikku ...`` run the same group with a function
that finds their ``PikkuCelery`` (``bound``). The commands call the app's public methods.

Every failure (an unknown run, MongoDB or Redis unreachable, a missing setting) is one line
on stderr and exit status 1, never a traceback; ``watch`` exits 0, 1 or 2 for a run that
completed, failed or was cancelled, and 3 when it cannot watch. Module imports stay light
(the Django and Flask integrations import this module in their processes): rich and the
dashboard are imported by the commands that use them.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import click

from pikku_celery.app import PikkuCelery
from pikku_celery.model.records import RUN_STATUSES, RUN_TERMINAL
from pikku_celery.operate._cli_common import (
    RESOLVER,
    WEB_CHECKS,
    CommandFailed,
    WatchFailed,
    echo_json,
    one_line_errors,
    operator_command,
    resolve,
)
from pikku_celery.operate._cli_schedules import schedule, schedules
from pikku_celery.operate.timeline import (
    APPROVAL,
    Timeline,
    approve_command,
    build,
    kind_of,
    send_command,
)
from pikku_celery.workflow.replay import APPROVAL_PREFIX
from pikku_celery_commands import HELP

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

EXIT_FOR_STATUS = {"completed": 0, "failed": 1, "cancelled": 2}
DEFAULT_DASHBOARD_PORT = 5580
_sleep = time.sleep  # watch's wait between reads (tests replace it)


@click.group("pikku", help=HELP)
def pikku() -> None:
    pass


pikku.add_command(schedules)  # pikku schedules
pikku.add_command(schedule)  # pikku schedule pause|resume|trigger NAME


def bound(find: Callable[[], PikkuCelery],
          web_checks: Callable[[], list[str]] | None = None) -> click.Group:
    """The same commands, acting on the ``PikkuCelery`` that ``find()`` returns;
    ``web_checks()`` lists what ``check`` reports of the framework's web settings."""
    @click.pass_context
    def remember(ctx: click.Context) -> None:
        ctx.meta[RESOLVER] = find
        if web_checks is not None:
            ctx.meta[WEB_CHECKS] = web_checks

    return click.Group("pikku", commands=pikku.commands, callback=remember,
                       help=pikku.help)


def timeline_of(app: PikkuCelery, run_id: str, *, history: bool = True) -> Timeline:
    """The run's timeline from four reads (run, steps, history, events); ``history``
    false: without the attempts (one read fewer)."""
    run = app.get_run(run_id)
    return build(run, app.get_steps(run_id), app.get_history(run_id) if history else [],
                 datetime.now(UTC), events=app.list_events(run_id),
                 queued=app.why_queued(run_id) if run.status == "queued" else None)


def events_json(timeline: Timeline) -> list[dict[str, Any]]:
    """The run's sent events as JSON, each with the wait that took it (``taken_by``)."""
    from pikku_celery.contrib._json import sent_events_json

    return sent_events_json(timeline.events)


def timeline_json(timeline: Timeline) -> dict[str, Any]:
    from pikku_celery.contrib._json import to_json

    attempts = []
    for attempt in timeline.attempts:
        entry = to_json(attempt)
        entry.update(superseded=attempt.superseded, duration_s=(
            None if attempt.duration is None else attempt.duration.total_seconds()))
        attempts.append(entry)
    return {"run": to_json(timeline.run), "steps": to_json([s.state for s in timeline.steps]),
            "attempts": attempts, "progress": timeline.progress(),
            "gates": to_json(timeline.gates),
            "event_waits": to_json(timeline.event_waits),
            "published": to_json(timeline.published),
            "events": events_json(timeline),
            "queued": to_json(timeline.queued),
            "compensations": [{"for_step": c.for_step, "step": c.step.step_name,
                               "function": c.function, "status": c.status,
                               "result": to_json(c.result), "error": c.error}
                              for c in timeline.compensations]}


# --- reading ------------------------------------------------------------------------------


@pikku.command("runs")
@click.option("--workflow", help="Only runs of this workflow.")
@click.option("--status", type=click.Choice(RUN_STATUSES), help="Only runs with this status.")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 1000),
              help="Runs per page.")
@click.option("--before", metavar="RUN_ID",
              help="The next page: runs created before this one (the last of a page).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@operator_command
def runs(ctx: click.Context, workflow: str | None, status: str | None, limit: int,
         before: str | None, as_json: bool) -> None:
    """List runs, newest first, one page at a time."""
    app = resolve(ctx)
    found = app.list_runs(workflow=workflow, status=status, limit=limit,
                          created_before=app.get_run(before) if before else None)
    more = found[-1].run_id if len(found) == limit else None
    # Why each queued run waits (two reads each; a page is at most 1,000 runs).
    queued = {r.run_id: why for r in found if r.status == "queued"
              if (why := app.why_queued(r.run_id)) is not None}
    if as_json:
        echo_json({"runs": found, "next": more, "queued": queued})
        return
    from pikku_celery.operate import _terminal

    out = _terminal.console()
    if not found:
        out.print("no runs")
        return
    out.print(_terminal.runs_table(found, whole=not _terminal.is_terminal(out.file),
                                   queued=queued))
    if more:
        out.print(f"next page: --before {more}", style="dim")


@pikku.command("show")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--tracebacks", is_flag=True, help="Print the errors' tracebacks too.")
@click.pass_context
@operator_command
def show(ctx: click.Context, run_id: str, as_json: bool, tracebacks: bool) -> None:
    """Show a run and its per-attempt timeline (superseded attempts marked)."""
    app = resolve(ctx)
    timeline = timeline_of(app, run_id)
    forks = app.list_forks(run_id)
    if as_json:
        found = {**timeline_json(timeline), "forks": [f.run_id for f in forks]}
        click.echo(json.dumps(found, indent=2, sort_keys=True, default=str))
        return
    from pikku_celery.operate import _terminal

    out = _terminal.console()
    out.print(_terminal.run_header(timeline, tracebacks=tracebacks, forks=forks))
    out.print()
    for table in (_terminal.step_progress_table(timeline), _terminal.gates_table(timeline),
                  _terminal.event_waits_table(timeline),
                  _terminal.compensations_table(timeline)):
        if table is not None:
            out.print(table)
            out.print()
    if timeline.events:
        out.print(_terminal.events_table(timeline.events,
                                         whole=not _terminal.is_terminal(out.file)))
        out.print()
    out.print(_terminal.attempts_table(timeline, tracebacks=tracebacks))
    out.print(_terminal.progress_line(timeline))
    waiting = timeline.waiting_gate
    if waiting is not None:
        out.print(_terminal.approve_hint(timeline.run.run_id, waiting), style="dim")
    event = timeline.waiting_event
    if event is not None:
        out.print(_terminal.send_hint(timeline.run.run_id, event), style="dim")


@pikku.command("events")
@click.argument("run_id")
@click.option("--limit", default=1000, show_default=True, type=click.IntRange(1, 1000),
              help="At most this many events (the first sent).")
@click.option("--after", default=0, show_default=True, type=click.IntRange(0),
              help="Only the events after this seq (the next page: the last seq listed).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@operator_command
def events(ctx: click.Context, run_id: str, limit: int, after: int, as_json: bool) -> None:
    """List the events sent to a run, in the order sent, each with the wait that took it
    (or "not taken yet")."""
    app = resolve(ctx)
    run = app.get_run(run_id)
    timeline = build(run, app.get_steps(run_id), [], datetime.now(UTC),
                     events=app.list_events(run_id, limit, after=after))
    if as_json:
        click.echo(json.dumps({"events": events_json(timeline)}, indent=2, sort_keys=True,
                              default=str))
        return
    from pikku_celery.operate import _terminal

    out = _terminal.console()
    if not timeline.events:
        out.print("no events")
    else:
        out.print(_terminal.events_table(timeline.events,
                                         whole=not _terminal.is_terminal(out.file)))
    waiting = timeline.waiting_event
    if waiting is not None:
        out.print(_terminal.send_hint(run_id, waiting), style="dim")


@pikku.command("watch")
@click.argument("run_id")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.01, 60),
              help="Seconds between reads.")
@click.pass_context
def watch(ctx: click.Context, run_id: str, interval: float) -> None:
    """Follow a run live until it ends; exit 0 completed, 1 failed, 2 cancelled (3: could
    not watch). On a terminal the table redraws in place; otherwise (a pipe, a file, CI)
    each change of the progress line is printed as it happens, then the attempts."""
    from rich.live import Live

    from pikku_celery.operate import _terminal

    with one_line_errors(WatchFailed):
        app = resolve(ctx)
        timeline = timeline_of(app, run_id)
        out = _terminal.console()
        if not _terminal.is_terminal(out.file):
            timeline = _watch_in_lines(app, timeline, interval, out)
        else:
            with Live(_terminal.live_view(timeline), console=out, auto_refresh=False
                      ) as live:
                while not timeline.run.is_terminal:
                    _sleep(interval)
                    timeline = timeline_of(app, run_id)
                    live.update(_terminal.live_view(timeline), refresh=True)
    ctx.exit(EXIT_FOR_STATUS[timeline.run.status])


def _watch_in_lines(app: PikkuCelery, timeline: Timeline, interval: float,
                    out: Any) -> Timeline:
    """``watch`` without a terminal: one progress line whenever the run's status or
    progress changes (flushed as printed), and once it ends its attempts and last line."""
    from pikku_celery.operate import _terminal

    shown: tuple[str, str] | None = None
    while not timeline.run.is_terminal:
        now = (timeline.run.status, timeline.progress())
        if now != shown:
            out.print(_terminal.progress_line(timeline))
            shown = now
        _sleep(interval)
        timeline = timeline_of(app, timeline.run.run_id)
    out.print(_terminal.live_view(timeline))
    return timeline


# --- acting -------------------------------------------------------------------------------


@pikku.command("cancel")
@click.argument("run_id")
@click.option("--reason", help="Recorded with the run.")
@click.pass_context
@operator_command
def cancel(ctx: click.Context, run_id: str, reason: str | None) -> None:
    """Cancel a run durably (its in-flight steps are fenced and told)."""
    app = resolve(ctx)
    if not app.cancel(run_id, reason):
        raise CommandFailed(f"run {run_id} has already ended "
                            f"({app.get_run(run_id).status}): nothing to cancel")
    click.echo(f"cancelled run {run_id}")


BY_HELP = "Who asks (your name), kept in the run's lineage."


@pikku.command("retry")
@click.argument("run_id")
@click.option("--by", help=BY_HELP)
@click.pass_context
@operator_command
def retry(ctx: click.Context, run_id: str, by: str | None) -> None:
    """Run a failed or cancelled run again from where it stopped (its failed steps get a
    fresh attempt budget; earlier attempts stay in its history)."""
    app = resolve(ctx)
    if not app.retry(run_id, by=by):
        raise CommandFailed(f"run {run_id} is {app.get_run(run_id).status}, not failed or "
                            "cancelled: nothing to retry")
    click.echo(f"retrying run {run_id}")


@pikku.command("fork")
@click.argument("run_id")
@click.option("--from", "from_step", required=True,
              help="The step to run afresh; the steps recorded before it are replayed.")
@click.option("--run-id", "new_run_id",
              help="The new run's id (default: a fresh one). The same fork again returns "
                   "it; another run's id is refused.")
@click.option("--keep-decisions", is_flag=True,
              help="Copy the approvals and event waits decided before --from (default: "
                   "the new run asks each again).")
@click.option("--by", help=BY_HELP)
@click.pass_context
@operator_command
def fork(ctx: click.Context, run_id: str, from_step: str, new_run_id: str | None,
         keep_decisions: bool, by: str | None) -> None:
    """Start a new run of RUN_ID's workflow and input, replaying its steps before --from
    (approvals and event waits are asked again unless --keep-decisions)."""
    forked = resolve(ctx).fork(run_id, from_step=from_step, new_run_id=new_run_id,
                               keep_decisions=keep_decisions, by=by)
    kept = ", decisions kept" if keep_decisions else ""
    click.echo(f"forked run {forked} from run {run_id} at step {from_step!r}{kept}")


@pikku.command("resume")
@click.argument("run_id")
@click.pass_context
@operator_command
def resume(ctx: click.Context, run_id: str) -> None:
    """Resume a run suspended by wf.suspend() (not one waiting at wf.approval(): approve
    decides that)."""
    app = resolve(ctx)
    timeline = timeline_of(app, run_id, history=False)
    gate = timeline.approval_only
    if gate is not None:
        # resume opens suspensions only: the run would wake, find its gate still waiting
        # and suspend again, and "resumed" would be a lie.
        raise CommandFailed(
            f"run {run_id} waits for approval {gate.name!r}, which resume does not open: "
            f"decide it with `{approve_command(run_id, gate)}`")
    wait = timeline.event_wait_only
    if wait is not None:
        raise CommandFailed(
            f"run {run_id} waits for event {wait.name!r}, which resume does not send: "
            f"send it with `{send_command(run_id, wait)}`")
    if not app.resume(run_id):
        raise CommandFailed(f"run {run_id} is {app.get_run(run_id).status}, not suspended: "
                            "nothing to resume")
    click.echo(f"resumed run {run_id}")


@pikku.command("approve")
@click.argument("run_id")
@click.argument("name")
@click.option("--decision", required=True, metavar="JSON",
              help='The decision, as JSON: \'{"approved": true}\', true, \'"yes"\'...')
@click.option("--by", default=None, metavar="WHO",
              help="Who decides (checked against the approval's approvers).")
@click.option("--json", "as_json", is_flag=True, help="Print the settled step as JSON.")
@click.pass_context
@operator_command
def approve(ctx: click.Context, run_id: str, name: str, decision: str, by: str | None,
            as_json: bool) -> None:
    """Record a decision for the run's wf.approval(NAME) and wake the run."""
    try:
        value = json.loads(decision)
    except ValueError as exc:
        raise CommandFailed(f"--decision is not JSON: {exc}") from None
    app = resolve(ctx)
    name = gate_name(app, run_id, name)
    step = app.approve(run_id, name, value, by=by)
    if as_json:
        echo_json(step)
        return
    from pikku_celery.operate import _terminal

    click.echo(_terminal.decided_line(run_id, name, value, step.data))


@pikku.command("send")
@click.argument("run_id")
@click.argument("name")
@click.argument("payload", required=False, metavar="[PAYLOAD_JSON]")
@click.option("--key", default=None, metavar="KEY",
              help="Idempotency key: a send with a key already sent to this run delivers "
                   "nothing more (safe to retry).")
@click.option("--json", "as_json", is_flag=True, help="Print the event as JSON.")
@click.pass_context
@operator_command
def send(ctx: click.Context, run_id: str, name: str, payload: str | None, key: str | None,
         as_json: bool) -> None:
    """Send the event NAME to the run and wake it: its next wf.wait_for_event(NAME)
    returns PAYLOAD_JSON (JSON: '{"amount": 12}', 42, '"text"'; none: null). Events
    wait, in the order sent, until a wait takes them. One event per call: a send the
    store cannot take within 30 s fails saying whether the event may have been kept."""
    value = None
    if payload is not None:
        try:
            value = json.loads(payload)
        except ValueError as exc:
            raise CommandFailed(f"PAYLOAD_JSON is not JSON: {exc}") from None
    event = resolve(ctx).send_event(run_id, name, value, key=key)
    if as_json:
        echo_json(event)
        return
    keyed = f", key {event.key!r}" if event.key is not None else ""
    click.echo(f"sent event {event.name!r} to run {run_id} (seq {event.seq}{keyed})")


def gate_name(app: PikkuCelery, run_id: str, given: str) -> str:
    """The approval name ``approve`` takes for ``given``, which may be any name ``show``
    printed for the gate: ``manager``, a loop's later reach ``manager#2``, or the stored
    step name ``__approval:manager``."""
    for step in app.get_steps(run_id):
        if kind_of(step) == APPROVAL and given in (
                step.step_name, step.step_name.removeprefix(APPROVAL_PREFIX)):
            return str(step.data["approval"])
    return given


@pikku.command("purge")
@click.option("--older-than", required=True, metavar="DURATION",
              help="Runs that ended longer ago than this: 30d, 12h, 90m...")
@click.option("--status", "statuses", multiple=True, type=click.Choice(sorted(RUN_TERMINAL)),
              help="Only these ended statuses (repeat it); default all three.")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option("--batch", default=500, show_default=True, type=click.IntRange(1, 1000),
              help="Runs deleted per round trip.")
@click.pass_context
@operator_command
def purge(ctx: click.Context, older_than: str, statuses: tuple[str, ...], dry_run: bool,
          batch: int) -> None:
    """Delete ended runs with their steps and history (never a live run)."""
    chosen = statuses or tuple(sorted(RUN_TERMINAL))
    count = resolve(ctx).purge(older_than, statuses=chosen, dry_run=dry_run, batch=batch)
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{verb} {count} run{'s' if count != 1 else ''} ({', '.join(chosen)}) "
               f"that ended more than {older_than} ago")


# --- the deployment -----------------------------------------------------------------------


@pikku.command("check")
@click.option("--create-indexes", is_flag=True,
              help="Create missing MongoDB indexes first (the first start does too).")
@click.option("--no-workers", "skip_workers", is_flag=True,
              help="Do not ask the workers (through the broker, 1 s) what they consume.")
@click.pass_context
def check(ctx: click.Context, create_indexes: bool, skip_workers: bool) -> None:
    """Check the configuration, MongoDB, its indexes and Redis; list workflows and steps;
    warn of a queue pikku's tasks share with other apps. Exits 1 with one line per
    problem (a warning does not change the exit status)."""
    from pikku_celery.operate import _checks

    with one_line_errors():
        app = resolve(ctx)
    web_checks = ctx.meta.get(WEB_CHECKS)
    report = _checks.run_checks(app, create_indexes=create_indexes,
                                web_checks=web_checks, ask_workers=not skip_workers)
    for line in report.lines:
        click.echo(line)
    for problem in report.problems:
        click.echo(f"problem: {problem}", err=True)
    if report.problems:
        ctx.exit(1)


@pikku.command("dashboard")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; another than loopback needs --authorize or "
                   "PIKKU_DASHBOARD_TOKEN.")
@click.option("--port", default=DEFAULT_DASHBOARD_PORT, show_default=True,
              type=click.IntRange(1, 65535))
@click.option("--authorize", metavar="DOTTED.PATH",
              help="A callable (request, action, run_id) -> bool deciding every request.")
@click.option("--https", "behind_https", is_flag=True,
              help="Browsers reach it over HTTPS (a TLS proxy in front): the session "
                   "cookie is Secure on loopback too.")
@click.option("--token", "token_argument", hidden=True,
              help="Refused: a command line shows in ps; use PIKKU_DASHBOARD_TOKEN.")
@click.option("--show-tracebacks", is_flag=True, help="Show error tracebacks to readers.")
@click.option("--identity-header", metavar="HEADER",
              envvar="PIKKU_DASHBOARD_IDENTITY_HEADER",
              help="A header your proxy sets to the signed-in user (X-Forwarded-User): "
                   "its value names the caller, who may then decide gates naming "
                   "approvers. Serve only behind that proxy, which must replace any the "
                   "client sends.")
@click.pass_context
def dashboard(ctx: click.Context, host: str, port: int, authorize: str | None,
              behind_https: bool, token_argument: str | None, show_tracebacks: bool,
              identity_header: str | None) -> None:
    """Serve the dashboard (and the JSON API) standalone, on waitress.

    Who gets in: --authorize decides every request; else whoever has the token
    (PIKKU_DASHBOARD_TOKEN, an environment variable only, 16 characters or more). On a
    loopback address without either, a random token is drawn for this process and the
    URL carrying it is printed once. The session cookie is signed with
    PIKKU_DASHBOARD_SECRET_KEY (environment only, at least 32 characters) when set, so
    logins survive a restart; else with a key drawn at random for this process."""
    with one_line_errors():
        standalone = _dashboard_module()
        if token_argument is not None:
            raise CommandFailed("--token is not accepted (a command line shows in ps and "
                                "shell history): set PIKKU_DASHBOARD_TOKEN instead")
        token = standalone.token_from_env()
        loopback = is_loopback(host)
        if authorize is None and token is None and not loopback:
            raise CommandFailed(
                f"refusing to serve the dashboard on {host} without --authorize or "
                "PIKKU_DASHBOARD_TOKEN (on 127.0.0.1 it draws a random token and prints "
                "the URL carrying it)")
        drawn = standalone.new_token() if authorize is None and token is None else None
        web = standalone.make_app(
            resolve(ctx), authorize=authorize, token=token or drawn,
            show_tracebacks=show_tracebacks, secret_key=standalone.secret_key_from_env(),
            plain_http=loopback and not behind_https, identity_header=identity_header)
        server = standalone.create_server(web, host, port)
    shown = f"[{host}]" if ":" in host else host
    where = f"http://{shown}:{server.effective_port}/"
    if drawn is not None:
        click.echo(f"pikku dashboard on {where}?token={drawn} (open it once; Ctrl-C to stop)")
    else:
        click.echo(f"pikku dashboard on {where} (Ctrl-C to stop)")
    with one_line_errors():
        try:
            server.run()
        finally:
            server.close()


def _dashboard_module() -> Any:
    """``pikku_celery.dashboard.standalone``, or one line naming the extra it needs."""
    try:
        from pikku_celery.dashboard import standalone
    except ImportError as exc:
        raise CommandFailed(str(exc)) from None
    return standalone


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
