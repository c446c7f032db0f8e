"""The ``pikku`` command group (click), shared by every way of running it.

``python manage.py pikku ...`` and ``flask pikku ...`` run this group with a function that
finds their ``PikkuCelery`` (``bound``); ``celery -A proj pikku ...`` (a ``celery.commands``
entry point) runs it bare, and the commands then take the instance bound to the Celery app
Celery's own CLI loaded. The commands call the app's public methods only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from pikku_celery.app import PikkuCelery, get_pikku
from pikku_celery.errors import PikkuError

RESOLVER = "pikku_celery.resolve"


def resolve(ctx: click.Context) -> PikkuCelery:
    """The ``PikkuCelery`` the commands act on."""
    found: Callable[[], PikkuCelery] | None = ctx.meta.get(RESOLVER)
    if found is not None:
        return found()
    celery_app = getattr(ctx.find_root().obj, "app", None)  # Celery's CLIContext
    if celery_app is None:
        raise click.UsageError("no Celery app: run it as `celery -A proj pikku ...`")
    try:
        return get_pikku(celery_app)
    except LookupError as exc:
        raise click.ClickException(str(exc)) from None


@click.group("pikku")
def pikku() -> None:
    """Read and manage pikku workflow runs."""


def bound(find: Callable[[], PikkuCelery]) -> click.Group:
    """The same commands, acting on the ``PikkuCelery`` that ``find()`` returns."""
    @click.pass_context
    def remember(ctx: click.Context) -> None:
        ctx.meta[RESOLVER] = find

    return click.Group("pikku", commands=pikku.commands, callback=remember,
                       help=pikku.help)


def _echo_json(value: Any) -> None:
    from pikku_celery.contrib._api import to_json

    click.echo(json.dumps(to_json(value), indent=2, sort_keys=True))


def _error(error: dict[str, Any] | None) -> str:
    return "" if not error else f"{error.get('type')}: {error.get('message')}"


@pikku.command("runs")
@click.option("--workflow", help="Only runs of this workflow.")
@click.option("--status", help="Only runs with this status (running, failed, ...).")
@click.option("--limit", default=20, show_default=True, help="At most this many runs.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def runs(ctx: click.Context, workflow: str | None, status: str | None, limit: int,
         as_json: bool) -> None:
    """List runs, newest first."""
    try:
        found = resolve(ctx).list_runs(workflow=workflow, status=status, limit=limit)
    except PikkuError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    if as_json:
        _echo_json(found)
        return
    for run in found:
        click.echo(f"{run.run_id}  {run.workflow:<20}  {run.status:<10}  "
                   f"{run.created_at:%Y-%m-%d %H:%M:%S}  {_error(run.error)}".rstrip())


@pikku.command("show")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def show(ctx: click.Context, run_id: str, as_json: bool) -> None:
    """Show a run and its steps."""
    app = resolve(ctx)
    try:
        run, steps = app.get_run(run_id), app.get_steps(run_id)
    except PikkuError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    if as_json:
        _echo_json({"run": run, "steps": steps})
        return
    click.echo(f"run {run.run_id}: {run.workflow} {run.status}  {_error(run.error)}".rstrip())
    click.echo(f"  created {run.created_at:%Y-%m-%d %H:%M:%S}, "
               f"updated {run.updated_at:%Y-%m-%d %H:%M:%S}")
    for step in steps:
        click.echo(f"  {step.step_name:<24} {step.status:<10} attempt {step.attempt}"
                   f"/{step.max_attempts}  {_error(step.error)}".rstrip())
