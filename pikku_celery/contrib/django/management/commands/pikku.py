"""``python manage.py pikku ...``: the ``pikku`` command group of ``pikku_celery.operate.cli``, on
the project's ``PikkuCelery``, after Django set up (so every app's workflows are
registered)."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

import click
from django.core.management.base import BaseCommand, CommandError

from pikku_celery.contrib._access import REMOVED_ALLOW_LOCAL
from pikku_celery.contrib.django import project_pikku
from pikku_celery.operate.cli import bound


def web_problems() -> list[str]:
    """What ``manage.py pikku check`` reports of the web settings: the removed
    ``allow-local``, and (unless ``DEBUG``) session and CSRF cookies a browser would send
    over plain HTTP (they carry the login the API trusts and the buttons' CSRF token)."""
    from django.conf import settings

    found = []
    if getattr(settings, "PIKKU_AUTHORIZE", None) == REMOVED_ALLOW_LOCAL:
        found.append("PIKKU_AUTHORIZE = 'allow-local' is refused (loopback is not an "
                     "identity): set a callable (request, action, run_id) -> bool")
    if not settings.DEBUG:
        for name in ("SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE"):
            if not getattr(settings, name, False):
                found.append(f"{name} = False: the cookie goes over plain HTTP too; set it "
                             "True behind HTTPS")
    if not getattr(settings, "SESSION_COOKIE_HTTPONLY", True):
        found.append("SESSION_COOKIE_HTTPONLY = False: scripts can read the session cookie")
    if getattr(settings, "SESSION_COOKIE_SAMESITE", "Lax") not in ("Lax", "Strict"):
        found.append("SESSION_COOKIE_SAMESITE is not 'Lax' or 'Strict'")
    return found


class Command(BaseCommand):
    help = "Read and manage pikku workflow runs (`manage.py pikku --help`)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER)

    def run_from_argv(self, argv: list[str]) -> None:
        # click parses its own arguments and help, and exits like any click program.
        bound(project_pikku, web_problems).main(args=argv[2:],
                                  prog_name=f"{os.path.basename(argv[0])} {argv[1]}")

    def handle(self, *args: Any, **options: Any) -> None:
        """``call_command("pikku", "runs", stdout=...)``: errors as ``CommandError``."""
        try:
            with contextlib.redirect_stdout(self.stdout):
                bound(project_pikku, web_problems).main(args=list(args), prog_name="pikku",
                                          standalone_mode=False)
        except click.ClickException as exc:
            raise CommandError(exc.format_message()) from None
