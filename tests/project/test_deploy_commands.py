"""deploy/'s command lines: each runs a real ``relayr`` command, parsed by relayr's own click group.

Each command a manifest runs (the image's entry point and command, compose's commands and health
checks, Kubernetes' container args and probes, systemd's ExecStart) is parsed by the ``relayr``
click group itself, so an unknown command or option, or a bad value, fails here rather than in
a rollout; each health probe checks the role it runs in. Files only: no service runs.
"""

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest

from tests.project.deploy_files import (
    UNITS,
    containers,
    deployments,
    dockerfile_instructions,
    exec_form,
    relayr_services,
    unit_values,
)


@dataclass(frozen=True)
class Invocation:
    """One command line a deployment runs, and where it comes from."""

    where: str
    argv: tuple[str, ...]


def invocations() -> list[Invocation]:
    """Every relayr command line in deploy/."""
    found: list[Invocation] = []
    instructions = dict(dockerfile_instructions())
    entrypoint = exec_form(instructions["ENTRYPOINT"])
    found.append(Invocation("Dockerfile CMD", (*entrypoint, *exec_form(instructions["CMD"]))))
    for name, service in relayr_services().items():
        found.append(Invocation(f"compose {name}", ("relayr", *service["command"])))
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD", f"compose {name}: use the exec form for the health check"
        found.append(Invocation(f"compose {name} healthcheck", tuple(test[1:])))
    for name, deployment in deployments().items():
        for container in containers(deployment):
            assert "command" not in container, f"{name}: keep the image's entry point"
            found.append(Invocation(f"k8s {name}", ("relayr", *container["args"])))
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe in container:
                    command = container[probe]["exec"]["command"]
                    found.append(Invocation(f"k8s {name} {probe}", tuple(command)))
    for path in UNITS:
        for line in unit_values(path, "Service", "ExecStart"):
            found.append(Invocation(f"systemd {path.name}", tuple(shlex.split(line))))
    return found


def relayr_group() -> click.Group:
    from relayr.cli import cli

    return cli


def parse_command(argv: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """Parse a relayr command line with the click group itself; return its path and params.

    Raises:
        click.UsageError: For an unknown command or option, or a bad value.
    """
    assert Path(argv[0]).name == "relayr", f"{argv} does not run relayr"
    command: click.Command = relayr_group()
    path = ["relayr"]
    rest = list(argv[1:])
    while isinstance(command, click.Group):
        assert rest, f"{argv}: no command given"
        name = rest.pop(0)
        sub = command.get_command(click.Context(command), name)
        if sub is None:
            raise click.UsageError(f"no such command {name!r} under {' '.join(path)}")
        command = sub
        path.append(name)
    context = command.make_context(" ".join(path), rest)
    return " ".join(path[1:]), dict(context.params)


ALL = invocations()


def test_deploy_runs_relayr_everywhere() -> None:
    sources = {invocation.where.split()[0] for invocation in ALL}
    assert sources == {"Dockerfile", "compose", "k8s", "systemd"}
    commands = {invocation.argv[1] for invocation in ALL}
    assert commands == {"worker", "dispatch", "health", "console"}


@pytest.mark.parametrize("invocation", ALL, ids=[invocation.where for invocation in ALL])
def test_every_command_is_a_real_relayr_command(invocation: Invocation) -> None:
    parse_command(invocation.argv)


def test_an_unknown_option_is_caught() -> None:
    with pytest.raises(click.UsageError, match="--no-such-option"):
        parse_command(("relayr", "worker", "--no-such-option"))
    with pytest.raises(click.UsageError, match="no such command 'wroker'"):
        parse_command(("relayr", "wroker"))
    with pytest.raises(click.BadParameter):
        parse_command(("relayr", "worker", "--concurrency", "0"))


def test_probes_check_the_role_they_run_in() -> None:
    for invocation in ALL:
        if "health" not in invocation.argv:
            continue
        where = invocation.where
        role = "--dispatcher" if "dispatcher" in where else "--worker"
        assert role in invocation.argv, where
        liveness = "livenessProbe" in where or "startupProbe" in where
        # a liveness probe that needed Redis would restart every worker during an outage
        assert ("--liveness" in invocation.argv) == liveness, where
