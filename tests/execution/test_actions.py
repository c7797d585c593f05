"""RunActions on real artifactr storage (in-memory and SQLite) with a real Runner.

Each attempt of a run gets a fresh RunActions, as the executor gives it, over the same run: the
tests check what artifactr's log holds afterwards, not what relayr says it did.
"""

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from artifactr import MarkdownArtifact, UserActor
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.agent import ArtifactWorkspace, Runner, Session, function_model
from artifactr.core import MessagePosted, PostMessage, RunStarted
from artifactr.sql import SqlStorage, create_sqlite_engine, migrate
from artifactr.workspace import InMemoryStorage as ArtifactMemory
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo
from reflexr import Event, Rule, SourceActor, on, run
from reflexr.core import start
from reflexr.workspace import InMemoryStorage, Reaction, Reactor, RunFailure, Workspaces

from relayr.core.allowlist import Allowlists
from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.emissions import EmissionRecord
from relayr.execution.actions import RunActions, acting
from relayr.ledger import Cause, InMemoryLedger, WorkspaceKey
from relayr.ledger.turns import turn_cause
from relayr.runtime.bridge import Bridge
from tests.workers import TURNS_SETTLE_S

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
TENANT, WORKSPACE = "acme", "ops"
KEY = WorkspaceKey(TENANT, WORKSPACE)


class ActionsTestEvent(Event, abstract=True, event_namespace="actionstest"):
    pass


class Happened(ActionsTestEvent, name="happened"):
    thread_id: str
    text: str = ""


class Note(MarkdownArtifact):
    pass


class Timeline(MarkdownArtifact):
    pass


RULES = [
    Rule(name="ops:notify", when=on(Happened), then=run("act"), start="beginning"),
    Rule(name="ops:triage", when=on(Happened), then=run("act"), start="beginning"),
    Rule(name="team:other", when=on(Happened), then=run("act"), start="beginning"),
]

ALLOWLIST = """
[rules."ops:triage"]
turns = true
create_threads = true
direct = ["timeline"]
"""


async def _respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    return ModelResponse(parts=[TextPart("on it")])


AGENT = Agent(
    function_model(_respond),
    deps_type=Session[None],
    capabilities=[ArtifactWorkspace(types=[Note, Timeline])],
)


async def _noop(reaction: Reaction[Any]) -> None:
    return None


class Harness:
    """Real artifactr and reflexr workspaces, a ledger, a Runner, and a way to attempt a run."""

    def __init__(self, artifacts: ArtifactWorkspaces) -> None:
        self.artifacts = artifacts
        self.rules = Workspaces(InMemoryStorage(), events=[Happened], rules=RULES)
        self.ledger = InMemoryLedger()
        self.allowlists: Allowlists = parse_allowlist(ALLOWLIST)
        self.runner: Runner[None] = Runner(AGENT, app=None)
        self.bridge = Bridge(
            artifacts=artifacts,
            ledger=self.ledger,
            allowlists=lambda: self.allowlists,
            runner=self.runner,
            clock=lambda: NOW,
        )
        self.user = UserActor(id="alice")
        self.reactor = Reactor(self.rules, actions={"act": _noop})
        self.attempts: list[RunActions] = []

    async def thread(self, title: str = "incident") -> str:
        handle = await self.artifacts.open(TENANT, WORKSPACE, actor=self.user)
        return (await handle.create_thread(title)).id

    async def reaction(self, rule: str, thread_id: str, attempt: int = 1) -> Reaction[Bridge]:
        """An attempt of the run that ``rule`` makes of one event in ``thread_id``."""
        workspace = await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
        published = await workspace.publish(
            Happened(thread_id=thread_id), id=f"evt-{rule}-{thread_id}"
        )
        found = self.rules.rules[rule]
        await self.reactor.evaluate()
        [pending] = [
            r for r in await workspace.runs(rule=rule) if published.envelope.seq in r.matched
        ]
        started, _ = start(pending, now=NOW)
        started = started.model_copy(update={"attempts": attempt, "epoch": attempt})
        return Reaction(
            workspace=workspace,
            run=started,
            rule=found,
            events=(published.envelope,),
            deps=self.bridge,
        )

    async def attempt(self, rule: str, thread_id: str, attempt: int = 1) -> RunActions:
        actions = acting(await self.reaction(rule, thread_id, attempt))
        self.attempts.append(actions)
        return actions

    async def records(self, run_id: str) -> list[EmissionRecord]:
        """The run's emission records, once the attempts so far completed: completing an
        attempt commits what its actions left for it (as the executor does)."""
        for actions in self.attempts:
            await self.ledger.write(actions.pending)
        self.attempts.clear()
        return await self.ledger.emissions(KEY, run_id)

    async def messages(self, thread_id: str) -> list[tuple[MessagePosted, str]]:
        handle = await self.artifacts.open(TENANT, WORKSPACE, actor=self.user)
        return [
            (envelope.event, envelope.actor.participant)
            for envelope in await handle.read(threads={thread_id})
            if isinstance(envelope.event, MessagePosted)
        ]

    async def turns(self, thread_id: str) -> list[RunStarted]:
        await self.settle_turns()
        handle = await self.artifacts.open(TENANT, WORKSPACE, actor=self.user)
        return [
            envelope.event
            for envelope in await handle.read(threads={thread_id})
            if isinstance(envelope.event, RunStarted)
        ]

    async def settle_turns(self) -> None:
        """Wait until no turn runs: those the runs started, and those the Runner started itself
        when one of them ended with a message left for the next (its hand-over)."""
        assert await self.bridge.turns.settled(TURNS_SETTLE_S) == (0, 0), "turns did not settle"


@pytest.fixture(params=["memory", "sqlite"])
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    if request.param == "memory":
        subject = Harness(ArtifactWorkspaces(ArtifactMemory()))
        yield subject
        await subject.runner.aclose()
        return
    engine = create_sqlite_engine(f"sqlite+aiosqlite:///{tmp_path / 'artifacts.db'}")
    await migrate(engine)
    subject = Harness(ArtifactWorkspaces(SqlStorage(engine)))
    try:
        yield subject
    finally:
        await subject.runner.aclose()
        await engine.dispose()


async def test_a_notice_attempted_three_times_posts_once(harness: Harness) -> None:
    thread = await harness.thread()
    ids = []
    for attempt in (1, 2, 3):
        actions = await harness.attempt("ops:notify", thread, attempt)
        ids.append(await actions.notice("deploy of api finished: ok"))
    assert len(set(ids)) == 1
    [(message, author)] = await harness.messages(thread)
    assert (message.kind, author, message.message_id) == (
        "notice",
        "external_agent:reflexr:ops:notify",
        ids[0],
    )
    run_id = (await harness.reaction("ops:notify", thread)).run_id
    records = await harness.records(run_id)
    assert [(r.attempt, r.outcome, r.policy) for r in records] == [
        (1, "posted", "notice"),
        (2, "already_posted", "notice"),
        (3, "already_posted", "notice"),
    ]


async def test_b_send_without_turns_is_not_allowed_and_writes_nothing(harness: Harness) -> None:
    thread = await harness.thread()
    actions = await harness.attempt("ops:notify", thread)
    with pytest.raises(RunFailure) as refused:
        await actions.send("wake up")
    assert (refused.value.reason, refused.value.permanent) == ("not_allowed", True)
    assert "ops:notify may not start turns" in refused.value.message
    assert await harness.messages(thread) == []
    run_id = (await harness.reaction("ops:notify", thread)).run_id
    assert await harness.records(run_id) == []


async def test_c_allowlisted_send_starts_one_turn_and_a_retry_asks_for_nothing_more(
    harness: Harness,
) -> None:
    thread = await harness.thread()
    first = await harness.attempt("ops:triage", thread, 1)
    message_id = await first.send("Triage incident: db down")
    assert len(await harness.turns(thread)) == 1
    again = await harness.attempt("ops:triage", thread, 2)
    assert await again.send("Triage incident: db down") == message_id
    turns = await harness.turns(thread)
    assert len(turns) == 1
    mine = [m for m, author in await harness.messages(thread) if author.startswith("external")]
    assert [(m.kind, m.message_id) for m in mine] == [("message", message_id)]
    run_id = (await harness.reaction("ops:triage", thread)).run_id
    records = await harness.records(run_id)
    assert [(r.kind, r.policy, r.outcome) for r in records] == [
        ("message", "turn", "posted"),
        ("message", "turn", "asked"),
    ]


async def test_d_crash_between_commit_and_ask_gets_its_turn_on_retry(harness: Harness) -> None:
    thread = await harness.thread()
    reaction = await harness.reaction("ops:triage", thread, 1)
    content = "Triage incident: disk full"
    from relayr.core.ids import IdDeriver, digest

    message_id = IdDeriver(reaction.run_id).next(
        "msg", segment=0, operation="post_message", subject=(thread, digest(content))
    )
    died = await harness.artifacts.open(TENANT, WORKSPACE, actor=acting(reaction).actor)
    await died.commit(PostMessage(thread_id=thread, content=content, message_id=message_id))
    assert await harness.turns(thread) == []

    retried = await harness.attempt("ops:triage", thread, 2)
    assert await retried.send(content) == message_id
    [turn] = await harness.turns(thread)
    assert message_id in turn.message_ids
    cause = await turn_cause(harness.ledger, KEY, turn.message_ids)
    assert cause == Cause(
        correlation_id=reaction.run.correlation_id,
        firing_id=reaction.run_id,
        run_id=reaction.run_id,
        depth=reaction.run.depth,
    )


async def test_e_identical_notices_get_two_ids_and_the_same_two_on_retry(
    harness: Harness,
) -> None:
    thread = await harness.thread()
    first = await harness.attempt("ops:notify", thread, 1)
    ids = [await first.notice("same"), await first.notice("same")]
    again = await harness.attempt("ops:notify", thread, 2)
    assert [await again.notice("same"), await again.notice("same")] == ids
    assert len(set(ids)) == 2
    assert len(await harness.messages(thread)) == 2


async def test_f_chain_threads_only_and_never_another_workspace(harness: Harness) -> None:
    thread, elsewhere = await harness.thread(), await harness.thread("other")
    actions = await harness.attempt("ops:notify", thread)
    with pytest.raises(RunFailure) as refused:
        await actions.notice("hello", thread_id=elsewhere)
    assert refused.value.reason == "not_allowed"
    assert await harness.messages(elsewhere) == []
    other = await harness.artifacts.open(TENANT, "other-workspace", actor=harness.user)
    foreign = (await other.create_thread("foreign")).id
    with pytest.raises(RunFailure):
        await actions.notice("hello", thread_id=foreign)
    harness.allowlists = parse_allowlist('[rules."ops:notify"]\nthreads = "any"\n')
    with pytest.raises(RunFailure) as missing:
        await actions.notice("hello", thread_id=foreign)
    assert (missing.value.reason, missing.value.permanent) == ("thread_not_found", True)
    assert [
        e for e in await other.read(threads={foreign}) if e.event.type == "message_posted"
    ] == []
    assert await actions.notice("hello", thread_id=elsewhere)


async def test_h_post_is_routed_by_the_allowlist(harness: Harness) -> None:
    thread = await harness.thread()
    triage = await harness.attempt("ops:triage", thread)
    await triage.post("look at this")
    notify = await harness.attempt("ops:notify", thread)
    await notify.post("fyi")
    kinds = {
        m.content: m.kind for m, author in await harness.messages(thread) if "reflexr" in author
    }
    assert kinds == {"look at this": "message", "fyi": "notice"}
    assert len(await harness.turns(thread)) == 1
    for rule, policy in (("ops:triage", "turn"), ("ops:notify", "notice")):
        run_id = (await harness.reaction(rule, thread)).run_id
        [record] = await harness.records(run_id)
        assert record.policy == policy


async def test_revoking_turns_downgrades_post_and_keeps_the_same_id(harness: Harness) -> None:
    thread = await harness.thread()
    first = await harness.attempt("ops:triage", thread, 1)
    message_id = await first.post("look at this")
    harness.allowlists = Allowlists.empty()
    again = await harness.attempt("ops:triage", thread, 2)
    assert await again.post("look at this") == message_id
    with pytest.raises(RunFailure):
        await again.send("now forbidden")
    assert len([m for m, a in await harness.messages(thread) if "reflexr" in a]) == 1


async def test_notice_refuses_empty_content_without_writing(harness: Harness) -> None:
    thread = await harness.thread()
    actions = await harness.attempt("ops:notify", thread)
    for content in ("", "   \n"):
        with pytest.raises(RunFailure) as refused:
            await actions.notice(content)
        assert (refused.value.reason, refused.value.permanent) == ("empty_content", True)
    with pytest.raises(RunFailure) as nul:
        await actions.notice("a\x00b")
    assert (nul.value.reason, nul.value.permanent) == ("invalid_content", True)
    assert await harness.messages(thread) == []


async def test_a_run_without_a_thread_fails_permanently(harness: Harness) -> None:
    actions = await harness.attempt("ops:notify", "")
    with pytest.raises(RunFailure) as refused:
        await actions.notice("where?")
    assert (refused.value.reason, refused.value.permanent) == ("no_thread", True)


async def test_create_thread_needs_permission_and_joins_the_chain(harness: Harness) -> None:
    thread = await harness.thread()
    notify = await harness.attempt("ops:notify", thread)
    with pytest.raises(RunFailure):
        await notify.create_thread("postmortem")
    first = await harness.attempt("ops:triage", thread, 1)
    created = await first.create_thread("postmortem")
    assert created in first.threads
    await first.notice("notes go here", thread_id=created)
    again = await harness.attempt("ops:triage", thread, 2)
    assert await again.create_thread("postmortem") == created
    await again.notice("notes go here", thread_id=created)
    assert len(await harness.messages(created)) == 1
    assert await harness.ledger.cause(KEY, "thread", created) is not None


async def test_artifacts_are_proposals_unless_direct_and_retries_make_each_once(
    harness: Harness,
) -> None:
    thread = await harness.thread()
    handle = await harness.artifacts.open(TENANT, WORKSPACE, actor=harness.user)
    for attempt in (1, 2):
        actions = await harness.attempt("ops:triage", thread, attempt)
        proposal = await actions.create(Note(text="# postmortem"), thread_id=thread)
        direct = await actions.create(Timeline(text="# timeline"))
    assert proposal.startswith("prp_")
    assert direct.startswith("art_")
    assert [p.id for p in await handle.proposals()] == [proposal]
    timeline = await handle.get(Timeline, direct)
    assert timeline.data.text == "# timeline"

    for attempt in (3, 4):
        actions = await harness.attempt("ops:triage", thread, attempt)
        edited = await actions.edit(direct, "/text", "# timeline v2")
    assert edited == direct  # the second attempt finds the first one's edit in the ledger
    assert (await handle.get(Timeline, direct)).version == 2

    actions = await harness.attempt("ops:triage", thread, 5)
    assert await actions.edit(direct, "/text", "# v3") == direct
    note = (await handle.artifacts(Note))[0] if await handle.artifacts(Note) else None
    assert note is None  # the note is still only proposed
    assert await actions.archive(direct) == direct
    assert (await handle.artifact(direct)).archived
    assert await actions.archive(direct) is None
    assert {p.status for p in await handle.proposals()} == {"pending"}


async def test_edit_of_a_missing_artifact_is_retried(harness: Harness) -> None:
    thread = await harness.thread()
    actions = await harness.attempt("ops:triage", thread)
    with pytest.raises(RunFailure) as missing:
        await actions.edit("art_missing", "/text", "x")
    assert (missing.value.reason, missing.value.permanent) == ("not_found", False)


async def test_acting_needs_a_relayr_run() -> None:
    harness = Harness(ArtifactWorkspaces(ArtifactMemory()))
    reaction = await harness.reaction("ops:notify", "thr_x")
    reaction.deps = None  # type: ignore[assignment]
    with pytest.raises(TypeError, match="not executed by relayr"):
        acting(reaction)
    await harness.runner.aclose()
