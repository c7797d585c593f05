"""The command line answers at once: ``--help`` imports only what it prints, and each command
only the library it uses (ADR-0050); ``--version``; and exit code 2 for bad settings under every
command family.

What a command imported is read from ``sys.modules`` in a process of its own, after the
command ran, so nothing this test process imported counts.
"""

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from relayr.cli import COMMANDS, cli
from tests.otlp import receiving
from tests.workers import REPO, relayr_environment

HEAVY = (
    "artifactr",
    "reflexr",
    "pydantic_ai",
    "alembic",
    "sqlalchemy",
    "celery",
    "asyncio",
    "starlette",
    "jinja2",
    "uvicorn",
    "multipart",
    "itsdangerous",
    "opentelemetry",
)
"""What no ``--help`` may import: the libraries, their schema tools, Celery, the console's web
stack, OpenTelemetry, even asyncio."""

SDK = (
    "opentelemetry.sdk",
    "opentelemetry.exporter.otlp.proto.http",
    "opentelemetry.instrumentation.celery",
    "relayr.observe.otel",
)
"""OpenTelemetry's SDK, its exporter and Celery's instrumentation: loaded only when tracing is
on (ADR-0080)."""

PROBE = """
import json, sys
from relayr.cli import cli
try:
    cli(args=sys.argv[2:], prog_name="relayr")
except SystemExit as done:
    code = done.code
else:
    code = 0
loaded = sorted(name for name in json.loads(sys.argv[1]) if name in sys.modules)
print("\\n" + json.dumps({"code": code, "loaded": loaded}))
"""
"""Runs ``relayr ARGS``, then prints which of the named modules it loaded, as the last line."""


def imported(environment: dict[str, str], *args: str, among: tuple[str, ...] = HEAVY) -> set[str]:
    """Which of ``among`` ``relayr ARGS`` imported; it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(among), *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] in (0, None), done.stdout + done.stderr
    return set(result["loaded"])


def every_command() -> list[list[str]]:
    """Every command and subcommand, as the arguments that name it."""
    found: list[list[str]] = [[]]

    def walk(group: click.Group, path: list[str]) -> None:
        for name in group.list_commands(click.Context(group)):
            command = group.get_command(click.Context(group), name)
            assert command is not None, name
            found.append([*path, name])
            if isinstance(command, click.Group):
                walk(command, [*path, name])

    walk(cli, [])
    return found


@pytest.fixture
def environment(tmp_path: Path) -> dict[str, str]:
    return relayr_environment(tmp_path)


def test_the_version_is_the_package_version(environment: dict[str, str]) -> None:
    result = CliRunner().invoke(cli, ["--version"], env=environment)
    assert result.exit_code == 0
    assert result.stdout == f"relayr {version('relayr-bridge')}\n"


def test_every_command_is_listed() -> None:
    assert {path[0] for path in every_command() if path} == set(COMMANDS)


@pytest.mark.process
def test_help_imports_only_what_it_prints(environment: dict[str, str]) -> None:
    for command in every_command():
        assert imported(environment, *command, "--help") == set(), command


def test_help_shows_the_defaults_it_does_not_import() -> None:
    from relayr.observe.health import DEFAULT_MAX_AGE_S, DEFAULT_TIMEOUT_S
    from relayr.runtime.supervisor import RESTART_DELAY_MAX_S, RESTART_DELAY_S

    shown = {
        ("run",): (RESTART_DELAY_S, RESTART_DELAY_MAX_S),
        ("health",): (DEFAULT_TIMEOUT_S, DEFAULT_MAX_AGE_S),
    }
    for command, defaults in shown.items():
        text = CliRunner().invoke(cli, [*command, "--help"], terminal_width=200).stdout
        for default in defaults:
            assert f"[default: {default:g}]" in text, (command, default)


@pytest.mark.process
def test_publish_loads_reflexr_and_no_artifactr(environment: dict[str, str]) -> None:
    data = json.dumps({"service": "api", "status": "ok", "thread_id": "thr_1"})
    loaded = imported(environment, "publish", "acme/ops", "deploy:finished", "--data", data)
    assert "reflexr" in loaded
    assert loaded.isdisjoint({"artifactr", "pydantic_ai", "celery"}), loaded


@pytest.mark.process
def test_publish_loads_nothing_of_opentelemetry_s_sdk_unless_traced(
    environment: dict[str, str],
) -> None:
    data = json.dumps({"service": "api", "status": "ok", "thread_id": "thr_1"})
    command = ("publish", "acme/ops", "deploy:finished", "--data", data)

    assert imported(environment, *command, among=SDK) == set()
    with receiving() as receiver:
        traced = {**environment, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        loaded = imported(traced, *command, among=(*SDK, "artifactr", "celery"))
    # traced, the command loads the SDK and its exporter, and still no artifactr nor Celery
    assert loaded == {
        "opentelemetry.sdk",
        "opentelemetry.exporter.otlp.proto.http",
        "relayr.observe.otel",
    }


@pytest.mark.process
def test_runs_list_and_allowlist_check_load_no_artifactr(environment: dict[str, str]) -> None:
    for command in (["runs", "list"], ["allowlist", "check"]):
        loaded = imported(environment, *command)
        assert loaded.isdisjoint({"artifactr", "pydantic_ai", "celery"}), (command, loaded)


@pytest.mark.process
def test_thread_commands_load_artifactr_and_no_reflexr(environment: dict[str, str]) -> None:
    loaded = imported(environment, "thread", "create", "acme/ops", "--title", "t")
    assert "artifactr" in loaded
    assert loaded.isdisjoint({"reflexr", "celery"}), loaded


FAMILIES = [
    ["worker"],
    ["dispatch"],
    ["run"],
    ["publish", "acme/ops", "deploy:finished"],
    ["thread", "create", "acme/ops", "--title", "t"],
    ["thread", "show", "acme/ops", "thr_1"],
    ["allowlist", "check"],
    ["allowlist", "explain", "ops:deploy-notice"],
    ["runs", "list"],
    ["runs", "show", "fir_1"],
    ["runs", "retry", "fir_1"],
    ["runs", "cancel", "fir_1"],
    ["runs", "skip", "fir_1", "--reason", "r"],
    ["health"],
    ["console", "--port", "0"],
    ["db", "upgrade"],
    ["db", "current"],
]
"""A command of every family (``relayr demo`` runs on settings of its own, not the caller's)."""


@pytest.mark.parametrize("command", FAMILIES, ids=" ".join)
@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("RELAYR_LOG_FORMAT", "xml", "RELAYR_LOG_FORMAT='xml' is invalid"),
        ("RELAYR_TIME_LIMIT_S", "99999", "the time limits are out of order"),
    ],
    ids=["log format", "time limits"],
)
def test_invalid_settings_are_bad_input_under_every_family(
    environment: dict[str, str], command: list[str], variable: str, value: str, message: str
) -> None:
    result = CliRunner().invoke(cli, command, env={**environment, variable: value})
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("Error: ")
    assert message in line
    assert not Path(environment["RELAYR_HOME"], "relayr.db").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["publish", "acme/ops", "deploy:finished"],
        ["thread", "create", "acme/ops", "--title", "t"],
        ["allowlist", "check"],
        ["runs", "list"],
        ["runs", "show", "fir_1"],
        ["worker"],
        ["console", "--port", "0"],
    ],
    ids=" ".join,
)
def test_an_application_that_cannot_load_is_bad_input(
    environment: dict[str, str], command: list[str]
) -> None:
    result = CliRunner().invoke(cli, command, env={**environment, "RELAYR_APP": "nowhere.at:all"})
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert (
        line == "Error: application 'nowhere.at:all' cannot be imported: No module named 'nowhere'"
    )


def test_a_run_that_does_not_exist_is_bad_input(environment: dict[str, str]) -> None:
    result = CliRunner().invoke(cli, ["runs", "show", "fir_0000000000000000"], env=environment)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == "Error: no run fir_0000000000000000"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["runs", "list", "--workspace", "acme"], "--workspace 'acme' is malformed"),
        (["runs", "list", "--since", "yesterday"], "--since 'yesterday' is not a duration"),
        (["runs", "retry", "fir_1", "--workspace", "a b/c"], "--workspace 'a b/c' is malformed"),
    ],
)
def test_runs_parse_workspaces_and_durations_as_every_command(
    environment: dict[str, str], args: list[str], message: str
) -> None:
    result = CliRunner().invoke(cli, args, env=environment)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert not Path(environment["RELAYR_HOME"], "relayr.db").exists()
