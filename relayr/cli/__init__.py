"""The ``relayr`` command line: the one package that composes relayr's engine with ``tasks``.

Each command family has a module of its own (``serve``, ``publish``, ``threads``, ``demo``,
``follow``, ``allowlist``, ``runs``, ``health``, ``console``, ``db``). Every command reads the
settings once, takes ``--json`` when it prints data, and stops on bad input before writing
anything, with one line naming what is wrong and exit code 2 (:mod:`relayr.cli.helpers`). A
command's module imports only click and the helpers; Celery, the libraries and the application
are imported when the command runs (ADR-0050).
"""

import importlib
from typing import Final

import click

COMMANDS: Final = {
    "allowlist": "relayr.cli.allowlist:allowlist",
    "console": "relayr.cli.console:console",
    "db": "relayr.cli.db:db",
    "demo": "relayr.cli.demo:demo",
    "dispatch": "relayr.cli.serve:dispatch",
    "follow": "relayr.cli.follow:follow",
    "health": "relayr.cli.health:health",
    "limits": "relayr.cli.limits:limits",
    "publish": "relayr.cli.publish:publish",
    "run": "relayr.cli.serve:run",
    "runs": "relayr.cli.runs:runs",
    "thread": "relayr.cli.threads:thread",
    "worker": "relayr.cli.serve:worker",
}
"""Every command, by the module and attribute that define it; loaded when called or listed."""


class Commands(click.Group):
    """relayr's commands, each loaded from :data:`COMMANDS` when it is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        reference = COMMANDS.get(cmd_name)
        if reference is None:
            return None
        module, _, name = reference.partition(":")
        command = getattr(importlib.import_module(module), name)
        if not isinstance(command, click.Command):
            raise TypeError(f"{reference} is not a click command")
        return command


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    package_name="relayr-bridge", prog_name="relayr", message="%(prog)s %(version)s"
)
def cli() -> None:
    """relayr: reflexr rules run on Celery workers and act in artifactr threads.

    Settings come from RELAYR_* environment variables; with none set, everything is embedded
    under .relayr/ (SQLite, and a broker in folders), and no server is needed.
    """


def main() -> None:
    """The console script ``relayr``."""
    cli(prog_name="relayr")
