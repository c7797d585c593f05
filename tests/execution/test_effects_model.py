"""One run's effects against a model, by hypothesis's stateful testing, on SQLite and PostgreSQL.

Each example draws a run's program: notices, sends and posts, a thread, an artifact written
directly and one proposed, edits and the archive of the direct one, each step through the run's
actions or through its agent's tools. The machine's rules are what befalls the run meanwhile:

- an attempt that dies, as its worker would (nothing after runs, and what it left for its
  completion is lost), before or after the N-th commit it makes: artifactr's, through the rule's
  workspace handle, or the ledger's own; or an attempt that goes through (a redelivery);
- the operators granting or revoking ``turns`` between attempts (a send then fails
  ``not_allowed``, a post goes as a notice);
- a person editing the direct artifact between attempts.

After every rule artifactr holds no effect of a step twice, and every effect has exactly one
record that says it made it: a message its one ``posted`` emission record (validated when read),
a thread, a proposal and a revision the ledger's cause of this run. At the end an operator's
retry with turns granted completes the run: then every step's effect is there exactly once, and
every message the rule sent was taken by a turn.
"""

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
from artifactr.core import EditArtifact, JsonPatch, MessagePosted
from artifactr.sql import SqlStorage, create_sqlite_engine, migrate
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from reflexr.workspace import RunFailure
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from relayr.core import reasons
from relayr.core.allowlist_toml import parse_allowlist
from relayr.execution.actions import RunActions, acting
from relayr.execution.agent_tools import RuleCapability, RuleTools
from relayr.ledger.port import WriteKind, revision_key
from relayr.ops.report import TAKEN_CURSOR
from tests.execution.test_actions import ALLOWLIST, KEY, TENANT, WORKSPACE, Note, Timeline
from tests.execution.test_effects_once import OnceHarness

RULE = "ops:triage"
AUTHOR = f"external_agent:reflexr:{RULE}"
GRANTED = parse_allowlist(ALLOWLIST)
REVOKED = parse_allowlist(ALLOWLIST.replace("turns = true\n", ""))

type Op = Literal["notice", "send", "post", "thread", "note", "timeline", "edit", "archive"]
MESSAGES: frozenset[Op] = frozenset({"notice", "send", "post"})
TOOLS: dict[Op, str] = {
    "notice": "post_notice",
    "post": "post_message",
    "thread": "create_thread",
    "note": "create_artifact",
    "edit": "edit_artifact",
    "archive": "archive_artifact",
}
"""The agent's tool for each step it can take; a send and the direct artifact's creation are
the actions' alone (the tool posts as the allowlist routes, and the artifact's id is needed)."""


class Died(BaseException):
    """The attempt's worker died here (injected): nothing after it runs, nothing catches it."""


@dataclass(frozen=True)
class Step:
    op: Op
    text: str
    tools: bool
    """Taken by the run's agent through its tools, not by the actions."""


@st.composite
def programs(draw: st.DrawFn) -> tuple[Step, ...]:
    """A run's steps: the direct artifact first, its edits only after it (drawn as often as
    any two other steps: they are where a person's change can be lost), its archive last or
    never; every text its step's own."""
    middle: list[Op] = ["notice", "send", "post", "thread", "note", "edit", "edit"]
    ops: list[Op] = ["timeline", *draw(st.lists(st.sampled_from(middle), min_size=1, max_size=5))]
    if draw(st.booleans()):
        ops.append("archive")
    return tuple(
        Step(op, f"{op} {index}", op in TOOLS and draw(st.booleans()))
        for index, op in enumerate(ops)
    )


@dataclass
class Faults:
    """Where the next attempt dies: before or after its ``at``-th commit, counted from 1."""

    at: int = 0
    when: Literal["before", "after"] = "before"
    counted: int = 0

    async def commit[T](self, write: Callable[[], Awaitable[T]]) -> T:
        self.counted += 1
        if (self.counted, "before") == (self.at, self.when):
            raise Died(f"before commit {self.counted}")
        made = await write()
        if (self.counted, "after") == (self.at, self.when):
            raise Died(f"after commit {self.counted}")
        return made


def _script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The agent calls the one tool its prompt names, then answers; a refusal told back to it
    is not in the model, so it fails the example."""
    for message in messages:
        for part in message.parts if isinstance(message, ModelRequest) else ():
            if isinstance(part, RetryPromptPart):
                raise AssertionError(f"a tool was refused: {part.content}")
    if len(messages) > 1:
        return ModelResponse(parts=[TextPart("done")])
    first = messages[0]
    assert isinstance(first, ModelRequest)
    prompt = next(part.content for part in first.parts if part.part_kind == "user-prompt")
    call = json.loads(str(prompt))
    return ModelResponse(parts=[ToolCallPart(tool_name=call["tool"], args=call["args"])])


AGENT = Agent(
    FunctionModel(_script),
    deps_type=RuleTools,
    capabilities=[RuleCapability(types=[Note, Timeline])],
)


class Store:
    """The harness on one SQL storage, opened on the test's own event loop for every example,
    its commits through the rule's handle and the ledger's own transactions counted by
    ``faults``."""

    def __init__(self, harness: OnceHarness) -> None:
        self.harness = harness
        self.faults = Faults()
        artifacts, ledger = harness.artifacts, harness.ledger
        opening, record_cause, write = artifacts.open, ledger.record_cause, ledger.write

        async def open_handle(tenant: str, workspace: str, *, actor: Any) -> Any:
            handle = await opening(tenant, workspace, actor=actor)
            if actor.kind == "external_agent":
                commit = handle.commit
                handle.commit = lambda command: self.faults.commit(lambda: commit(command))
            return handle

        artifacts.open = open_handle  # type: ignore[method-assign]
        ledger.record_cause = lambda *args: self.faults.commit(  # type: ignore[method-assign]
            lambda: record_cause(*args)
        )
        ledger.write = lambda writes: self.faults.commit(lambda: write(writes))  # type: ignore[method-assign]


class RunModel(RuleBasedStateMachine):
    """One run of ``ops:triage`` in a thread of its own, attempted as the rules say."""

    def __init__(self, loop: asyncio.AbstractEventLoop, store: Store) -> None:
        super().__init__()
        self.loop, self.store, self.harness = loop, store, store.harness
        self.program: tuple[Step, ...] = ()
        self.thread = ""
        self.attempts = 0
        self.timeline: str | None = None
        self.persons_edits = 0
        self.commits = 0
        """The most commits one attempt made, or two per step before one went through."""
        self.granted: dict[int, bool] = {}
        """Whether the allowlist granted turns, by attempt."""

    def run[T](self, work: Awaitable[T]) -> T:
        return self.loop.run_until_complete(work)

    @initialize(program=programs())
    def start(self, program: tuple[Step, ...]) -> None:
        self.program = program
        self.commits = 2 * len(program)
        self.harness.allowlists = GRANTED
        self.thread = self.run(self.harness.thread())

    @rule(data=st.data(), when=st.sampled_from(["before", "after"]))
    def attempt_that_dies(self, data: st.DataObject, when: Literal["before", "after"]) -> None:
        """Dies at one of the commits an attempt makes (as many as the most one made, or two
        per step before any did)."""
        at = data.draw(st.integers(min_value=1, max_value=self.commits), label="at")
        self.run(self._attempt(Faults(at, when)))

    @rule()
    def attempt(self) -> None:
        self.run(self._attempt(Faults()))

    @rule()
    def grant_or_revoke_turns(self) -> None:
        granted = self.harness.allowlists is GRANTED
        self.harness.allowlists = REVOKED if granted else GRANTED

    @precondition(lambda self: self.timeline is not None)
    @rule()
    def a_person_edits_the_artifact(self) -> None:
        self.run(self._persons_edit())

    @invariant()
    def each_effect_once_and_recorded(self) -> None:
        if self.thread:
            self.run(self._check(complete=False))

    def teardown(self) -> None:
        """An operator's retry with turns granted: the run completes, with every effect."""
        if not self.thread:
            return
        self.harness.allowlists = GRANTED
        self.run(self._attempt(Faults()))
        self.run(self._check(complete=True))

    async def _attempt(self, faults: Faults) -> None:
        self.attempts += 1
        self.granted[self.attempts] = self.harness.allowlists is GRANTED
        reaction = await self.harness.reaction(RULE, self.thread, self.attempts)
        actions = acting(reaction)
        self.store.faults = faults
        try:
            for step in self.program:
                await self._take(step, actions, reaction)
        except Died:
            return  # the worker died: what the attempt left for its completion is lost
        except RunFailure as failed:
            revoked = self.harness.allowlists is REVOKED
            if failed.reason != reasons.NOT_ALLOWED or not revoked:
                raise
        finally:
            self.commits = max(self.commits, faults.counted)
            self.store.faults = Faults()
            await self.harness.settle_turns()
        await self.harness.ledger.write(actions.pending)

    async def _take(self, step: Step, actions: RunActions, reaction: Any) -> None:
        if step.tools:
            await self._tool(step, reaction)
            return
        match step.op:
            case "notice":
                await actions.notice(step.text)
            case "send":
                await actions.send(step.text)
            case "post":
                await actions.post(step.text)
            case "thread":
                await actions.create_thread(step.text)
            case "note":
                await actions.create(Note(text=step.text))
            case "timeline":
                self.timeline = await actions.create(Timeline(text=step.text))
            case "edit":
                assert self.timeline is not None
                await actions.edit(self.timeline, "/text", step.text)
            case "archive":
                assert self.timeline is not None
                await actions.archive(self.timeline)

    async def _tool(self, step: Step, reaction: Any) -> None:
        args: dict[str, Any] = {
            "notice": {"content": step.text},
            "post": {"content": step.text},
            "thread": {"title": step.text},
            "note": {"kind": Note.kind, "data": {"text": step.text}},
            "edit": {"artifact_id": self.timeline, "path": "/text", "value": step.text},
            "archive": {"artifact_id": self.timeline},
        }[step.op]
        prompt = json.dumps({"tool": TOOLS[step.op], "args": args})
        await AGENT.run(prompt, deps=RuleTools.of(reaction))

    async def _persons_edit(self) -> None:
        assert self.timeline is not None
        handle = await self.harness.artifacts.open(TENANT, WORKSPACE, actor=self.harness.user)
        current = await handle.artifact(self.timeline)
        if current.archived:
            return
        self.persons_edits += 1
        await handle.commit(
            _edit(self.timeline, current.version, f"a person's text {self.persons_edits}")
        )

    async def _check(self, *, complete: bool) -> None:
        harness = self.harness
        run_id = (await harness.reaction(RULE, self.thread)).run_id
        planned = Counter(step.op for step in self.program)
        handle = await harness.artifacts.open(TENANT, WORKSPACE, actor=harness.user)
        log = await handle.read(threads={self.thread})
        sent = {
            envelope.event.message_id: (envelope.event.kind, envelope.seq)
            for envelope in log
            if isinstance(envelope.event, MessagePosted) and envelope.actor.participant == AUTHOR
        }
        messages = sum(planned[op] for op in MESSAGES)
        assert len(sent) == messages if complete else len(sent) <= messages, sent

        records = await harness.ledger.emissions(KEY, run_id)
        made = Counter(record.message_id for record in records if record.outcome == "posted")
        assert made == Counter(sent.keys()), (made, sent)  # one record that made each, none without
        for record in records:
            held = "notice" if sent[record.message_id][0] == "notice" else "message"
            assert record.kind == held, record  # what artifactr holds
            op = record.content.split()[0]
            routed = op != "notice" and self.granted[record.attempt]
            assert record.policy == ("turn" if routed else "notice"), record  # the route taken

        causes = Causes(harness, run_id)
        threads = [t for t in await handle.threads() if t.title.startswith("thread ")]
        mine = [t for t in threads if await causes.ours("thread", t.id)]
        assert len(mine) == planned["thread"] if complete else len(mine) <= planned["thread"]
        proposals = [p for p in await handle.proposals() if await causes.ours("proposal", p.id)]
        assert len(proposals) == planned["note"] if complete else len(proposals) <= planned["note"]
        if self.timeline is not None:
            await self._check_timeline(handle, causes, complete=complete)
        if complete:
            taken = await handle.cursor(TAKEN_CURSOR.format(thread=self.thread))
            untaken = [m for m, (kind, seq) in sent.items() if kind == "message" and seq > taken]
            assert untaken == [], (untaken, taken)

    async def _check_timeline(self, handle: Any, causes: "Causes", *, complete: bool) -> None:
        assert self.timeline is not None
        revisions = await handle.revisions(self.timeline)
        by_rule = [r for r in revisions if r.actor.participant == AUTHOR]
        for revision in by_rule:
            assert await causes.ours("revision", revision_key(self.timeline, revision.version))
        texts = Counter(r.data.get("text") for r in by_rule if r.patch is not None)
        assert all(count == 1 for count in texts.values()), texts  # no edit made twice
        assert sum(r.version == 1 for r in by_rule) == 1
        assert sum(r.archived for r in by_rule) <= 1
        archived = "archive" in {step.op for step in self.program}
        if complete:
            assert revisions[-1].archived == archived


class Causes:
    """The ledger's causes, read as this run's or not."""

    def __init__(self, harness: OnceHarness, run_id: str) -> None:
        self.harness, self.run_id = harness, run_id

    async def ours(self, kind: WriteKind, key: str) -> bool:
        found = await self.harness.ledger.cause(KEY, kind, key)
        return found is not None and found.run_id == self.run_id


def _edit(artifact_id: str, version: int, text: str) -> EditArtifact:
    patch = JsonPatch(ops=({"op": "replace", "path": "/text", "value": text},))
    return EditArtifact(artifact_id=artifact_id, base_version=version, patch=patch)


async def _open(stack: AsyncExitStack, url: str) -> OnceHarness:
    engine: AsyncEngine = (
        create_sqlite_engine(url) if url.startswith("sqlite") else create_async_engine(url)
    )
    stack.push_async_callback(engine.dispose)
    await migrate(engine)
    harness = OnceHarness(SqlStorage(engine), engine)
    stack.push_async_callback(harness.runner.aclose)
    return harness


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'relayr.db'}"
    else:
        yield request.getfixturevalue("postgres_url")


@pytest.mark.slow
def test_a_runs_effects_are_one_executions_and_each_has_one_record(database_url: str) -> None:
    loop = asyncio.new_event_loop()
    stack = AsyncExitStack()
    try:
        store = Store(loop.run_until_complete(_open(stack, database_url)))
        run_state_machine_as_test(
            lambda: RunModel(loop, store),
            settings=settings(
                max_examples=30,
                stateful_step_count=8,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        loop.run_until_complete(stack.aclose())
        loop.close()
