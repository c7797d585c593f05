"""The ``relayr`` command line: the one package that composes relayr's engine with ``tasks``.

Every command reads the settings once from ``RELAYR_*`` (:class:`relayr.settings.Settings`), and
commands that print data take ``--json``. Bad input (a malformed ``TENANT/WORKSPACE``, data that
is not a JSON object, an unknown event type, invalid settings, allowlist or application) stops
the command before it writes anything, with one line naming what is wrong and exit code 2
(:mod:`relayr.cli.helpers`).

The commands, by family, each in a module of its own:

- :mod:`relayr.cli.serve`: ``relayr worker``, ``relayr dispatch`` and ``relayr run``;
- :mod:`relayr.cli.publish` and :mod:`relayr.cli.threads`: ``relayr publish``,
  ``relayr thread create``, ``post`` and ``show``, to try rules by hand;
- :mod:`relayr.cli.demo`: ``relayr demo``;
- :mod:`relayr.cli.follow`: ``relayr follow``, the followers alone, and their dead letters;
- :mod:`relayr.cli.allowlist`, :mod:`relayr.cli.runs`, :mod:`relayr.cli.health`: the operators'
  ``relayr allowlist``, ``relayr runs`` and ``relayr health``;
- :mod:`relayr.cli.console`: ``relayr console``, the same in a browser (:mod:`relayr.console`).

A command's module is imported when the command is called or listed, and imports only click and
the helpers when it is: Celery, the libraries and the application are imported by the command
that needs them, when it runs. So ``relayr --help`` imports click and these modules only, and
``relayr publish`` loads reflexr but no artifactr (ADR-0050). :mod:`relayr.cli.processes` is
the one wrapper of the relayr and Celery processes the CLI, the tests and the benchmarks start.
"""

import importlib
from typing import Final

import click

COMMANDS: Final = {
    "allowlist": "relayr.cli.allowlist:allowlist",
    "console": "relayr.cli.console:console",
    "demo": "relayr.cli.demo:demo",
    "dispatch": "relayr.cli.serve:dispatch",
    "follow": "relayr.cli.follow:follow",
    "health": "relayr.cli.health:health",
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
@click.version_option(package_name="relayr", prog_name="relayr", message="%(prog)s %(version)s")
def cli() -> None:
    """relayr: reflexr rules run on Celery workers and act in artifactr threads.

    Settings come from RELAYR_* environment variables; with none set, everything is embedded
    under .relayr/ (SQLite, and a broker in folders), and no server is needed.
    """


def main() -> None:
    """The console script ``relayr``."""
    cli(prog_name="relayr")
