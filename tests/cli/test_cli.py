"""The ``relayr`` command: bad input is refused in one line, and a person can try a rule by hand.

Bad input runs in this process (click's runner) on a home of the test's own, and checks that
nothing was written. Trying a rule by hand runs ``relayr run`` (the dispatcher and a real worker
subprocess) and drives it with ``relayr thread create``, ``relayr publish`` and
``relayr thread show --json``, as the README tells a person to.
"""

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from reflexr import SourceActor
from reflexr.workspace import Reactor

from relayr.cli import cli
from relayr.cli.processes import RelayrProcess, relayr_command
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tests.runtime.supervised import kill_left_worker
from tests.workers import REPO, relayr_environment

SUBCOMMANDS = [
    [],
    ["worker"],
    ["dispatch"],
    ["run"],
    ["publish"],
    ["thread"],
    ["thread", "create"],
    ["thread", "show"],
    ["demo"],
]


@pytest.fixture
def environment(tmp_path: Path) -> dict[str, str]:
    return relayr_environment(tmp_path)


def invoke(environment: dict[str, str], *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env=environment, catch_exceptions=False)


def assert_refused(result: Result, message: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    assert message in lines[0]


def events_in(environment: dict[str, str], tenant: str, workspace: str) -> int:
    async def count() -> int:
        runtime = await Runtime.start(Settings.from_env(environment), role="cli")
        async with runtime:
            log = await runtime.application.rules.open(
                tenant, workspace, actor=SourceActor(name="test")
            )
            return len(await log.read())

    return asyncio.run(count())


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=lambda c: " ".join(c) or "relayr")
def test_every_command_has_help(command: list[str]) -> None:
    result = CliRunner().invoke(cli, [*command, "--help"])
    assert result.exit_code == 0
    assert "Usage: " in result.output


# ─── bad input ────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["publish", "acme", "deploy:finished"], "TENANT/WORKSPACE 'acme' is malformed"),
        (["publish", "acme/", "deploy:finished"], "TENANT/WORKSPACE 'acme/' is malformed"),
        (["publish", "a b/ops", "deploy:finished"], "TENANT/WORKSPACE 'a b/ops' is malformed"),
        (["publish", "acme/ops", "deploy:finished", "--data", "{"], "--data is not valid JSON"),
        (["publish", "acme/ops", "deploy:finished", "--data", "[1]"], "must be a JSON object"),
        (["publish", "acme/ops", "deploy:finished", "--id", "two words"], "--id 'two words'"),
        (["thread", "create", "acme//ops", "--title", "x"], "is malformed"),
        (["thread", "show", "acme/ops", "thr x"], "THREAD 'thr x' is malformed"),
        (["runs", "show", "fir x"], "RUN 'fir x' is malformed"),
        (["runs", "retry", "fir_1", "fir/2"], "RUN 'fir/2' is malformed"),
        (["runs", "cancel", "fir_1", "fir 2"], "RUN 'fir 2' is malformed"),
        (["runs", "skip", "--reason", "x", "fir:\\"], "RUN 'fir:\\\\' is malformed"),
    ],
)
def test_malformed_arguments_are_refused_before_anything_opens(
    environment: dict[str, str], args: list[str], message: str
) -> None:
    assert_refused(invoke(environment, *args), message)
    assert not Path(environment["RELAYR_HOME"], "relayr.db").exists()


@pytest.mark.parametrize(
    ("event_type", "data", "message"),
    [
        ("deploy:started", {"service": "api"}, "unknown event type 'deploy:started'"),
        ("deploy:finished", {"service": "api"}, "invalid deploy:finished event"),
        ("deploy:finished", {"service": "api", "status": "ok", "thread_id": 7}, "thread_id"),
        ("reflexr:run_succeeded", {}, "invalid reflexr:run_succeeded event"),
    ],
)
def test_an_event_that_is_not_the_applications_is_refused_and_nothing_is_written(
    environment: dict[str, str], event_type: str, data: dict[str, Any], message: str
) -> None:
    result = invoke(environment, "publish", "acme/ops", event_type, "--data", json.dumps(data))
    assert_refused(result, message)
    assert events_in(environment, "acme", "ops") == 0


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("RELAYR_SOFT_TIME_LIMIT_S", "5000", "the time limits are out of order"),
        ("RELAYR_LOG_FORMAT", "xml", "RELAYR_LOG_FORMAT='xml' is invalid"),
        ("RELAYR_BROKER_URL", "amqp://", "RELAYR_BROKER_URL='amqp://' is invalid"),
        ("RELAYR_APP", "nowhere.at.all:create_app", "cannot be imported"),
    ],
)
def test_invalid_settings_are_refused_in_one_line(
    environment: dict[str, str], variable: str, value: str, message: str
) -> None:
    data = json.dumps({"service": "api", "status": "ok", "thread_id": "thr_1"})
    args = ["publish", "acme/ops", "deploy:finished", "--data", data]
    assert_refused(invoke({**environment, variable: value}, *args), message)


def test_an_unknown_thread_is_refused(environment: dict[str, str]) -> None:
    result = invoke(environment, "thread", "show", "acme/ops", "thr_0000000000000000")
    assert_refused(result, "thread thr_0000000000000000 does not exist in acme/ops")


def test_publishing_an_id_again_adds_nothing(environment: dict[str, str]) -> None:
    data = json.dumps({"service": "api", "status": "ok", "thread_id": "thr_1"})
    args = ["publish", "acme/ops", "deploy:finished", "--data", data, "--id", "evt-1", "--json"]
    first, second = invoke(environment, *args), invoke(environment, *args)
    assert json.loads(first.stdout) == {
        "id": "evt-1",
        "seq": 1,
        "type": "deploy:finished",
        "duplicate": False,
    }
    assert json.loads(second.stdout)["duplicate"] is True
    assert events_in(environment, "acme", "ops") == 1


def fired_run(environment: dict[str, str], workspace: str = "ops") -> str:
    """A run of the example's ``ops:deploy-notice`` in ``acme/<workspace>``, fired in this
    process: it stays pending (no worker runs it)."""
    data = json.dumps({"service": "api", "status": "ok", "thread_id": "thr_1"})
    published = invoke(
        environment, "publish", f"acme/{workspace}", "deploy:finished", "--data", data
    )
    assert published.exit_code == 0, published.output

    async def fire() -> str:
        runtime = await Runtime.start(Settings.from_env(environment), role="cli")
        async with runtime:
            rules = runtime.application.rules
            await Reactor(rules, actions=runtime.application.actions).evaluate()
            log = await rules.open("acme", workspace, actor=SourceActor(name="test"))
            [run] = await log.runs(rule="ops:deploy-notice")
            return run.id

    return asyncio.run(fire())


def status_of(environment: dict[str, str], run_id: str) -> str:
    shown = invoke(environment, "runs", "show", run_id, "--json")
    assert shown.exit_code == 0, shown.output
    status: str = json.loads(shown.stdout)["run"]["status"]
    return status


@pytest.mark.parametrize(
    "command", [["retry"], ["cancel"], ["skip", "--reason", "retired"]], ids=lambda c: c[0]
)
def test_a_run_id_that_names_no_run_is_bad_input_and_changes_nothing(
    environment: dict[str, str], command: list[str]
) -> None:
    run_id = fired_run(environment)
    result = invoke(environment, "runs", *command, run_id, "fir_typo0000000000")
    assert_refused(result, "Error: no run fir_typo0000000000: nothing was changed")
    assert status_of(environment, run_id) == "pending"
    where = invoke(environment, "runs", *command, "--workspace", "acme/billing", run_id)
    assert_refused(where, f"no run {run_id} in acme/billing: nothing was changed")
    assert status_of(environment, run_id) == "pending"


def test_a_run_id_two_workspaces_hold_needs_its_workspace(environment: dict[str, str]) -> None:
    """The same rule firing at the same seq in two workspaces makes the same run id: without
    ``--workspace`` the command changes neither and says which to name."""
    run_id = fired_run(environment)
    assert fired_run(environment, "billing") == run_id  # the premise
    ambiguous = f"run {run_id} is in 2 workspaces (acme/billing, acme/ops): name one with"
    assert_refused(invoke(environment, "runs", "show", run_id), ambiguous)
    assert_refused(invoke(environment, "runs", "cancel", run_id), ambiguous)
    cancelled = invoke(environment, "runs", "cancel", "--workspace", "acme/billing", run_id)
    assert cancelled.exit_code == 0, cancelled.output
    shown = invoke(environment, "runs", "show", "--workspace", "acme/ops", run_id, "--json")
    assert json.loads(shown.stdout)["run"]["status"] == "pending"


# ─── trying a rule by hand ────────────────────────────────────────────────────


@pytest.fixture
def relayr_run(environment: dict[str, str]) -> Iterator[RelayrProcess]:
    """``relayr run``: the dispatcher here and a worker subprocess; stopped with Ctrl-C, else
    killed, and the worker with it (it runs in a session of its own)."""
    home = Path(environment["RELAYR_HOME"])
    process = RelayrProcess.start(
        relayr_command("run", "--concurrency", "1"),
        environment=environment,
        cwd=REPO,
        log_path=home / "run.log",
    )
    try:
        yield process
    finally:
        if process.alive():
            process.signal(signal.SIGINT)
            with suppress(subprocess.TimeoutExpired):
                process.wait(60)
        process.kill()
        kill_left_worker(home)
        print(process.log()[-5000:])


@pytest.mark.worker
@pytest.mark.slow
def test_a_person_tries_the_rules_by_hand(
    environment: dict[str, str], relayr_run: RelayrProcess
) -> None:
    created = invoke(environment, "thread", "create", "acme/ops", "--title", "release", "--json")
    assert created.exit_code == 0, created.output
    thread_id = json.loads(created.stdout)["id"]

    deploy = {"service": "api", "status": "succeeded", "thread_id": thread_id}
    incident = {"title": "checkout errors", "thread_id": thread_id}
    for event_type, data in (("deploy:finished", deploy), ("incident:opened", incident)):
        published = invoke(
            environment, "publish", "acme/ops", event_type, "--data", json.dumps(data)
        )
        assert published.exit_code == 0, published.output
        assert published.stdout.startswith(f"published {event_type} ")

    # both events are published before the dispatcher's next pass, and their two runs may
    # execute in either order: only the agent's reply must follow the rule's message. The
    # reply then comes back as a bridged event, and the example's inbound rules answer it
    # (a follow-up notice among them): wait for that one, whatever else they post meanwhile
    rule = "external_agent:reflexr:"
    answered = {f"{rule}ops:deploy-notice", f"{rule}ops:incident-triage", f"agent:{thread_id}"}
    messages = wait_for_messages(
        environment, thread_id, authors={*answered, f"{rule}ops:agent-replied"}
    )
    assert all(set(m) == {"id", "kind", "author", "content", "seq"} for m in messages)
    assert [m["seq"] for m in messages] == sorted(m["seq"] for m in messages)
    mine = [m for m in messages if m["author"] in answered]
    by_author = {m["author"]: m for m in mine}
    assert len(mine) == len(by_author) == 3, messages
    notice = by_author[f"{rule}ops:deploy-notice"]
    assert (notice["kind"], notice["content"]) == ("notice", "deploy of api finished: succeeded")
    triage = by_author[f"{rule}ops:incident-triage"]
    assert (triage["kind"], triage["content"]) == ("message", "Triage incident: checkout errors")
    reply = by_author[f"agent:{thread_id}"]
    assert reply["kind"] == "message"
    assert reply["seq"] > triage["seq"], messages
    [follow_up] = [m for m in messages if m["author"] == f"{rule}ops:agent-replied"]
    assert (follow_up["kind"], follow_up["seq"] > reply["seq"]) == ("notice", True)

    shown = invoke(environment, "thread", "show", "acme/ops", thread_id)
    assert "[notice] external_agent:reflexr:ops:deploy-notice" in shown.stdout

    relayr_run.signal(signal.SIGINT)
    assert relayr_run.wait(60) == 0


def wait_for_messages(
    environment: dict[str, str], thread_id: str, *, authors: set[str], timeout_s: float = 90
) -> list[dict[str, Any]]:
    """The thread's messages once every one of ``authors`` has posted in it."""
    deadline = time.monotonic() + timeout_s
    while True:
        shown = invoke(environment, "thread", "show", "acme/ops", thread_id, "--json")
        assert shown.exit_code == 0, shown.output
        messages: list[dict[str, Any]] = json.loads(shown.stdout)
        if authors <= {m["author"] for m in messages}:
            return messages
        assert time.monotonic() < deadline, messages
        time.sleep(0.5)


@pytest.mark.parametrize("command", [["worker"], ["dispatch"], ["run"]], ids=" ".join)
def test_a_long_running_command_with_invalid_settings_does_not_start(
    environment: dict[str, str], command: list[str]
) -> None:
    environment = {**environment, "RELAYR_TIME_LIMIT_S": "99999"}
    assert_refused(invoke(environment, *command), "the time limits are out of order")


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("RELAYR_ALLOWLIST", "/nonexistent/allowlist.toml", "cannot read: no such file"),
        ("RELAYR_APP", "nowhere.at.all:create_app", "cannot be imported"),
        ("RELAYR_APP", "relayr.settings:Settings", "is not an async function"),
    ],
)
def test_a_worker_whose_allowlist_or_application_cannot_load_does_not_start(
    environment: dict[str, str], variable: str, value: str, message: str
) -> None:
    assert_refused(invoke({**environment, variable: value}, "worker"), message)
