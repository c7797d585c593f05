"""``relayr follow``: one pass, the status, and dead letters listed and replayed, on SQLite.

The commands run in this process (click's runner) on a home of the test's own, with the
example application; what a person typed wrong is refused in one line, exit code 2.
"""

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from artifactr import ExternalAgentActor, UserActor
from click.testing import CliRunner, Result
from reflexr import SourceActor

from relayr.cli import cli
from relayr.cli.follow import followers_of
from relayr.follow.store import DeadLetter
from relayr.ledger.port import WorkspaceKey
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from rules.example import DeployFinished
from tests.workers import relayr_environment

TENANT, WORKSPACE = "acme", "ops"


@pytest.fixture
def environment(tmp_path: Path) -> dict[str, str]:
    return relayr_environment(tmp_path)


def invoke(environment: dict[str, str], *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env=environment, catch_exceptions=False)


def write(environment: dict[str, str], *, ghost: bool = False) -> str:
    """A thread with a person's message (and a rule's notice no run wrote, with ``ghost``),
    and a deploy event that makes reflexr know the tenant; the thread's id."""

    async def work() -> str:
        runtime = await Runtime.start(Settings.from_env(environment), role="cli")
        async with runtime:
            artifacts = await runtime.application.artifacts.open(
                TENANT, WORKSPACE, actor=UserActor(id="alice")
            )
            thread = (await artifacts.create_thread("incident")).id
            await artifacts.post_message(thread, "is the api up?")
            if ghost:
                rule = ExternalAgentActor(client_id="reflexr:ops:ghost", name="ops:ghost")
                await artifacts.as_actor(rule).post_message(thread, "boo", kind="notice")
            rules = await runtime.application.rules.open(
                TENANT, WORKSPACE, actor=SourceActor(name="test")
            )
            await rules.publish(DeployFinished(service="api", status="ok", thread_id=thread))
            return thread

    return asyncio.run(work())


def output(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_one_pass_bridges_what_is_new_once(environment: dict[str, str]) -> None:
    write(environment)

    first = output(invoke(environment, "follow", "--once", "--json"))
    second = output(invoke(environment, "follow", "--once", "--json"))
    [status] = output(invoke(environment, "follow", "status", "--json"))

    assert (first["workspaces"], first["read"], first["bridged"]) == (1, 2, 1)
    assert (second["read"], second["bridged"]) == (0, 0)
    assert (status["workspace"], status["lag"], status["holder"]) == ("acme/ops", 0, None)
    assert status["cursor"] == status["head"] == 2


def test_dead_letters_are_listed_and_replayed(environment: dict[str, str]) -> None:
    write(environment, ghost=True)
    done = output(invoke(environment, "follow", "--once", "--json"))

    [letter] = output(invoke(environment, "follow", "dead-letters", "list", "--json"))
    replay = invoke(environment, "follow", "dead-letters", "replay", "acme/ops", "--all", "--json")
    unknown = invoke(environment, "follow", "dead-letters", "replay", "acme/ops", "nope")
    listed = invoke(environment, "follow", "dead-letters", "list")

    assert (done["bridged"], done["dead"]) == (1, 1)
    assert (letter["workspace"], letter["reason"], letter["event_type"]) == (
        "acme/ops",
        "cause_missing",
        "message_posted",
    )
    assert replay.exit_code == 1
    again = json.loads(replay.stdout)
    assert [f["reason"] for f in again["failed"]] == ["cause_missing"]
    assert unknown.exit_code == 1
    assert "unknown nope: not a dead letter waiting in acme/ops" in unknown.stdout
    assert "cause_missing, 2 tries" in listed.stdout


def test_a_dead_letter_whose_envelope_is_gone_is_reported_and_stays_waiting(
    environment: dict[str, str],
) -> None:
    write(environment)
    output(invoke(environment, "follow", "--once", "--json"))

    async def lose_an_envelope() -> None:
        """A dead letter whose seq holds another envelope: replay finds nothing to publish."""
        runtime = await Runtime.start(Settings.from_env(environment), role="cli")
        async with runtime:
            store = followers_of(runtime).store
            key, now = WorkspaceKey(TENANT, WORKSPACE), datetime.now(UTC)
            until = now + timedelta(minutes=5)
            cursor = await store.take(key, "test", until=until, now=now)
            assert cursor is not None
            gone = DeadLetter(key, "env-gone", 1, "message_posted", "cause_missing", "-", now)
            assert await store.advance(key, "test", cursor, until=until, dead=[gone])
            await store.release(key, "test")

    asyncio.run(lose_an_envelope())
    replay = invoke(environment, "follow", "dead-letters", "replay", "acme/ops", "--all", "--json")
    said = invoke(environment, "follow", "dead-letters", "replay", "acme/ops", "env-gone")
    [letter] = output(invoke(environment, "follow", "dead-letters", "list", "--json"))

    assert replay.exit_code == 1
    assert json.loads(replay.stdout)["not_found"] == ["env-gone"]
    assert json.loads(replay.stdout)["bridged"] == []
    assert said.exit_code == 1
    assert "missing env-gone: not in artifactr's log at its seq; it stays waiting" in said.stdout
    assert letter["envelope_id"] == "env-gone"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["follow", "--json"], "--json goes with --once"),
        (["follow", "--once", "status"], "--once and --json go with relayr follow itself"),
        (["follow", "dead-letters", "replay", "acme/ops"], "name envelope IDs or --all"),
        (["follow", "dead-letters", "replay", "acme/ops", "x", "--all"], "not both"),
        (["follow", "dead-letters", "replay", "acme", "--all"], "'acme' is malformed"),
        (["follow", "dead-letters", "list", "--workspace", "a b/c"], "'a b/c' is malformed"),
        (["follow", "dead-letters", "replay", "acme/ops", "a b"], "ID 'a b' is malformed"),
    ],
)
def test_bad_input_is_refused_in_one_line(
    environment: dict[str, str], args: list[str], message: str
) -> None:
    result = invoke(environment, *args)

    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert not Path(environment["RELAYR_HOME"], "relayr.db").exists()
