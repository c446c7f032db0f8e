"""``pikku schedules`` and ``pikku schedule pause|resume|trigger NAME``: the schedules in
the store (``pikku.schedule``) and what an operator does to one. Added to the ``pikku``
group by ``cli``. An unknown name is one line and exit status 1, as every failure."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

from pikku_celery.model.errors import InvalidInputError
from pikku_celery.operate._cli_common import CommandFailed, echo_json, operator_command, resolve
from pikku_celery.operate._text import format_time

T = TypeVar("T")


@click.command("schedules")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@operator_command
def schedules(ctx: click.Context, as_json: bool) -> None:
    """List the schedules in the store, by name: workflow, cron or every, time zone,
    catch-up, paused or active (and "not declared" when this code no longer declares it),
    the next tick, the latest tick and the run it started. Workers save the schedules
    their code declares when they start."""
    from pikku_celery.operate.schedule_views import schedule_json

    app = resolve(ctx)
    found = app.list_schedules()
    if as_json:
        echo_json({"schedules": [schedule_json(s) for s in found]})
        return
    from pikku_celery.operate import _terminal

    out = _terminal.console()
    if found:
        out.print(_terminal.schedules_table(found))
    else:
        out.print("no schedules")
    unsaved = sorted(set(app.registry.schedules) - {s.name for s in found})
    if unsaved:
        out.print(f"declared here but not in the store yet (a worker saves them when it "
                  f"starts): {', '.join(unsaved)}", style="dim", markup=False)


@click.group("schedule")
def schedule() -> None:
    """Pause, resume or trigger one schedule (``pikku schedules`` lists them)."""


def acted(operation: Callable[[str], T], name: str) -> T:
    """``operation(name)``; the ``InvalidInputError`` of an unknown name is its message,
    on one line (``no schedule named 'x'; declared here: ...``)."""
    try:
        return operation(name)
    except InvalidInputError as exc:
        raise CommandFailed(str(exc)) from None


@schedule.command("pause")
@click.argument("name")
@click.pass_context
@operator_command
def pause(ctx: click.Context, name: str) -> None:
    """Stop the schedule's ticks until `pikku schedule resume NAME`."""
    if not acted(resolve(ctx).pause_schedule, name):
        raise CommandFailed(f"schedule {name} is already paused: nothing to pause")
    click.echo(f"paused schedule {name}")


@schedule.command("resume")
@click.argument("name")
@click.pass_context
@operator_command
def resume(ctx: click.Context, name: str) -> None:
    """Resume a paused schedule from its first tick after now (the ticks that fell due
    while it was paused start nothing)."""
    app = resolve(ctx)
    if not acted(app.resume_schedule, name):
        raise CommandFailed(f"schedule {name} is not paused: nothing to resume")
    click.echo(f"resumed schedule {name}; next tick "
               f"{format_time(app.get_schedule(name).next_at)}")


@schedule.command("trigger")
@click.argument("name")
@click.pass_context
@operator_command
def trigger(ctx: click.Context, name: str) -> None:
    """Start the schedule's workflow now, paused or not, as a tick of this instant (the
    ticks go on as before); prints the new run's id alone."""
    click.echo(acted(resolve(ctx).trigger_schedule, name))
