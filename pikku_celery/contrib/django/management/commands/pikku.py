"""``python manage.py pikku ...``: the ``pikku`` command group of ``pikku_celery.cli``, on
the project's ``PikkuCelery``, after Django set up (so every app's workflows are
registered)."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

import click
from django.core.management.base import BaseCommand, CommandError

from pikku_celery.cli import bound
from pikku_celery.contrib.django import project_pikku


class Command(BaseCommand):
    help = "Read and manage pikku workflow runs (`manage.py pikku --help`)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER)

    def run_from_argv(self, argv: list[str]) -> None:
        # click parses its own arguments and help, and exits like any click program.
        bound(project_pikku).main(args=argv[2:],
                                  prog_name=f"{os.path.basename(argv[0])} {argv[1]}")

    def handle(self, *args: Any, **options: Any) -> None:
        """``call_command("pikku", "runs", stdout=...)``: errors as ``CommandError``."""
        try:
            with contextlib.redirect_stdout(self.stdout):
                bound(project_pikku).main(args=list(args), prog_name="pikku",
                                          standalone_mode=False)
        except click.ClickException as exc:
            raise CommandError(exc.format_message()) from None
