"""The example application end to end in one process, on real storage (in memory, SQLite,
PostgreSQL): events published, the dispatcher's pass, the runs executed as a worker would
(:class:`tests.example_runtime.Example`), and what the threads hold afterwards: the deploy
notices, the triage turn of the offline agent, nothing posted twice, nothing written without
the grant that rules/allowlist.toml gives the triage rule alone.
"""

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from relayr.core.allowlist import Allowlists
from relayr.core.allowlist_toml import parse_allowlist
from relayr.execution.executor import execute_run
from relayr.runtime.process import Runtime
from rules.example import (
    DEPLOY_NOTICE,
    INCIDENT_TRIAGE,
    REPLY,
    DeployFinished,
    IncidentOpened,
)
from tests.example_runtime import TENANT, WORKSPACE, Example, settings_for
from tests.services import STORAGES, storage_url
from tests.workers import ALLOWLIST, TURNS_SETTLE_S


@pytest.fixture(params=STORAGES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return storage_url(request, tmp_path)


@pytest.fixture
async def example(database_url: str, tmp_path: Path) -> AsyncIterator[Example]:
    runtime = await Runtime.start(settings_for(database_url, tmp_path), role="worker")
    try:
        yield Example(runtime)
    finally:
        await runtime.aclose()


async def test_the_example_rules_keep_the_first_events(example: Example) -> None:
    assert DEPLOY_NOTICE.start == INCIDENT_TRIAGE.start == "beginning"
    assert DEPLOY_NOTICE.ordering == INCIDENT_TRIAGE.ordering == "none"
    thread = await example.thread("release 42")

    # Published into a brand-new workspace before any rule was ever evaluated there.
    await example.publish(
        DeployFinished(service="api", status="ok", thread_id=thread),
        DeployFinished(service="web", status="failed", thread_id=thread),
    )
    executed = await example.work()

    assert [e.outcome for e in executed] == ["succeeded", "succeeded"]
    assert await example.transcript(thread) == [
        ("notice", "external_agent:reflexr:ops:deploy-notice", "deploy of api finished: ok"),
        ("notice", "external_agent:reflexr:ops:deploy-notice", "deploy of web finished: failed"),
    ]


async def test_an_incident_starts_a_turn_of_the_offline_agent(example: Example) -> None:
    thread = await example.thread("incident: checkout errors")
    await example.publish(IncidentOpened(title="checkout errors", thread_id=thread))

    [executed] = await example.work()
    assert await example.runtime.bridge.turns.settled(TURNS_SETTLE_S) == (0, 0)

    assert executed.outcome == "succeeded"
    transcript = await example.transcript(thread)
    assert transcript[0] == (
        "message",
        "external_agent:reflexr:ops:incident-triage",
        "Triage incident: checkout errors",
    )
    assert transcript[1] == ("message", f"agent:{thread}", REPLY)
    assert await example.turns_ended(thread) == ["completed"]


async def test_a_redelivered_run_posts_nothing_twice(example: Example) -> None:
    thread = await example.thread("release 43")
    await example.publish(DeployFinished(service="api", status="ok", thread_id=thread))

    [first] = await example.work()
    again = await execute_run(example.runtime, TENANT, WORKSPACE, first.run.id if first.run else "")

    assert first.outcome == "succeeded"
    assert again.outcome == "not_due"
    assert len(await example.transcript(thread)) == 1


async def test_without_the_grant_a_triage_fails_and_writes_nothing(
    database_url: str, tmp_path: Path
) -> None:
    runtime = await Runtime.start(
        settings_for(database_url, tmp_path),
        role="worker",
        allowlists=lambda: parse_allowlist("[default]\n", source="test"),
    )
    example = Example(runtime)
    try:
        thread = await example.thread("incident")
        await example.publish(IncidentOpened(title="disk full", thread_id=thread))

        [executed] = await example.work()

        assert executed.outcome == "dead"
        assert executed.run is not None
        assert executed.run.reason == "not_allowed"
        assert await example.transcript(thread) == []
    finally:
        await runtime.aclose()


def test_the_allowlist_grants_turns_to_the_triage_rule_only() -> None:
    from relayr.runtime.allowlist_file import load_allowlist

    allowlists: Allowlists = load_allowlist(ALLOWLIST)

    assert allowlists.for_rule(INCIDENT_TRIAGE.name).turns
    assert not allowlists.for_rule(DEPLOY_NOTICE.name).turns
