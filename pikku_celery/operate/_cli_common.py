"""What every ``pikku`` command shares (``cli`` and the modules adding commands to its
group, such as ``_cli_schedules``): finding the ``PikkuCelery`` acted on, and turning any
failure into one line on stderr and exit status 1."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import click

from pikku_celery.app import PikkuCelery, get_pikku
from pikku_celery.operate._text import error_line

RESOLVER = "pikku_celery.resolve"
WEB_CHECKS = "pikku_celery.web_checks"
P = ParamSpec("P")
T = TypeVar("T")


class CommandFailed(click.ClickException):
    """One line on stderr and exit status 1."""


class WatchFailed(CommandFailed):
    """``watch`` could not watch: 3, apart from the run outcomes' 0, 1 and 2."""

    exit_code = 3


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
        raise CommandFailed(f"{exc} (create PikkuCelery(app) in the module -A names)"
                            ) from None


@contextmanager
def one_line_errors(failure: type[CommandFailed] = CommandFailed) -> Iterator[None]:
    """Whatever fails becomes one line (``Type: message``) raised as ``failure``."""
    try:
        yield
    except CommandFailed as exc:
        if isinstance(exc, failure):
            raise
        raise failure(exc.message) from None
    except (click.ClickException, click.exceptions.Exit, click.Abort):
        raise
    except KeyboardInterrupt:
        raise click.Abort() from None
    except Exception as exc:
        raise failure(error_line({"type": type(exc).__name__, "message": str(exc)},
                                 limit=500)) from None


def operator_command(fn: Callable[P, T]) -> Callable[P, T]:
    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        with one_line_errors():
            return fn(*args, **kwargs)
    return run


def echo_json(value: Any) -> None:
    from pikku_celery.contrib._json import to_json

    click.echo(json.dumps(to_json(value), indent=2, sort_keys=True, default=str))
