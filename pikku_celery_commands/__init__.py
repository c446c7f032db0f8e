"""The ``celery pikku`` entry point, kept outside ``pikku_celery`` so that loading it costs
one small click group.

Celery loads every installed ``celery.commands`` entry point whenever any ``celery``
command starts: workers, ``inspect`` and ``purge`` of apps that never use pikku included.
An entry point inside ``pikku_celery`` would import the package, and with it pymongo, in
every such process (about 16 MB and a tenth of a second each). This group imports
``pikku_celery.operate.cli`` only when its commands are listed or one of them runs.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import click

HELP = "Read and operate pikku workflow runs."


class LazyPikkuGroup(click.Group):
    """``pikku_celery.operate.cli.pikku``'s commands, found when click first asks for them."""

    def _commands(self) -> MutableMapping[str, click.Command]:
        from pikku_celery.operate.cli import pikku as group

        return group.commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self._commands())

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self._commands().get(cmd_name)


pikku = LazyPikkuGroup("pikku", help=HELP)
