"""The example application's inbound rules, on real storage with runs executed in-process.

An incident's triage turn ends with the agent's reply; the follower bridges it, and three rules
answer: a follow-up, a page (the reply says ``@on-call``) and the scribe agent, whose tools
propose a triage note and name it in a notice. None of them answers a notice, so the thread
goes quiet: no rule answers another's notice, and nothing is posted twice.
"""

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from artifactr import UserActor
from artifactr.core import MessagePosted, ProposalCreated
from reflexr import SourceActor

from relayr import demo
from relayr.core.run_messages import RunMessage
from relayr.dispatch.dispatcher import Dispatcher
from relayr.execution.executor import execute_runs
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from rules.example import REPLY, SCRIBE_TOOL_CALLS, IncidentOpened
from rules.example.rules import INBOUND_RULES, INCIDENT_SCRIBE
from tests.workers import ALLOWLIST, TURNS_SETTLE_S

TENANT, WORKSPACE = "acme", "ops"
ALICE = UserActor(id="alice")
ROUNDS = 30


@pytest.fixture(
    params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
)
async def runtime(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Runtime]:
    if request.param == "memory":
        url = "memory://"
    elif request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path}/relayr.db"
    else:
        url = request.getfixturevalue("postgres_url")
    settings = Settings(home=tmp_path, database_url=url, allowlist=ALLOWLIST, turn_grace_s=5)
    started = await Runtime.start(settings, role="worker")
    try:
        yield started
    finally:
        await started.aclose()


async def settle(runtime: Runtime) -> None:
    """Dispatcher passes (each following first) and their runs, until a pass does nothing."""

    async def empty() -> int:
        return 0

    dispatcher = Dispatcher(runtime, queue_depth=empty)
    queue: list[RunMessage] = []

    async def enqueue(batch: RunMessage) -> None:
        queue.append(batch)

    for _ in range(ROUNDS):
        queue.clear()
        done = await dispatcher.pass_once(enqueue)
        for batch in queue:
            await execute_runs(runtime, TENANT, WORKSPACE, list(batch.run_ids))
        turns = runtime.bridge.turns.running()
        assert await runtime.bridge.turns.settled(TURNS_SETTLE_S) == (0, 0)
        if not (done.bridged or done.firings or queue or turns):
            return
    raise AssertionError("the example did not settle")


async def test_an_incident_is_followed_up_paged_and_written_up(runtime: Runtime) -> None:
    artifacts = await runtime.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
    thread = (await artifacts.create_thread("incident: checkout errors")).id
    rules = await runtime.application.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="ci"))
    await rules.publish(IncidentOpened(title="checkout errors", thread_id=thread))

    await settle(runtime)

    log = await artifacts.read()
    transcript = [
        (e.event.kind, e.actor.participant.removeprefix("external_agent:reflexr:"))
        for e in log
        if isinstance(e.event, MessagePosted)
    ]
    assert transcript[:2] == [("message", "ops:incident-triage"), ("message", f"agent:{thread}")]
    assert sorted(transcript[2:]) == [
        ("notice", "ops:agent-replied"),
        ("notice", "ops:incident-scribe"),
        ("notice", "ops:page-on-call"),
    ]
    [proposal] = [e.event for e in log if isinstance(e.event, ProposalCreated)]
    notices = {
        e.actor.participant: e.event.content
        for e in log
        if isinstance(e.event, MessagePosted) and e.event.kind == "notice"
    }
    assert proposal.proposal_id in notices["external_agent:reflexr:ops:incident-scribe"]
    assert notices["external_agent:reflexr:ops:agent-replied"].startswith(
        f"follow-up: the agent answered: {REPLY[:40]}"
    )
    runs = {run.rule: run for run in await rules.runs()}
    assert {rule: run.status for rule, run in runs.items()} == {
        "ops:incident-triage": "succeeded",
        "ops:agent-replied": "succeeded",
        "ops:page-on-call": "succeeded",
        "ops:incident-scribe": "succeeded",
    }
    assert runs["ops:incident-scribe"].output["tool_calls"] == SCRIBE_TOOL_CALLS  # type: ignore[index]
    triage = runs["ops:incident-triage"]
    for rule in ("ops:agent-replied", "ops:page-on-call", "ops:incident-scribe"):
        assert (runs[rule].correlation_id, runs[rule].depth) == (triage.correlation_id, 1)


def test_the_demo_counts_the_example_s_inbound_rules_as_they_are() -> None:
    """:mod:`relayr.demo` keeps its own copies of the example's names and counts (the engine
    imports no application): they are the example's."""
    assert tuple(rule.name for rule in INBOUND_RULES) == demo.INBOUND_RULES
    assert INCIDENT_SCRIBE.name == demo.SCRIBE_RULE
    assert demo.TOOL_CALLS_PER_INCIDENT == SCRIBE_TOOL_CALLS
