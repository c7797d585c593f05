"""The ops tests' world on real storage: rules whose runs die, executed by relayr's executor over
reflexr and artifactr on SQLite (and PostgreSQL).

``ops:flaky`` posts a notice, then fails (``backup_down``) until the test sets ``WORLD.fixed``;
``ops:crash`` commits its message as send would and dies before asking for the turn, on its
first attempt. :class:`Ops` fires them, executes a run as a worker would until it ended, and
reads what was posted and which turns started; ``enqueue`` only notes the ids, so what a retry
enqueues is executed by the test. Used by :mod:`tests.ops.test_ops_retry` and
:mod:`tests.ops.test_ops_reads`.
"""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from artifactr import UserActor
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.agent import ArtifactWorkspace, Session, function_model
from artifactr.core import MessagePosted, PostMessage, RunStarted
from artifactr.sql import SqlStorage as ArtifactSql
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo
from reflexr import Event, RetryPolicy, Rule, SourceActor, on, run
from reflexr.sql import SqlStorage as RuleSql
from reflexr.workspace import Reaction, Reactor, RunFailure, Workspaces

from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.ids import IdDeriver, digest
from relayr.execution.actions import acting
from relayr.execution.executor import execute_run
from relayr.ledger import WorkspaceKey
from relayr.runtime.application import Application, create_engine, migrate
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tests.execution.test_actions import Note

TENANT, WORKSPACE = "acme", "ops"
KEY = WorkspaceKey(TENANT, WORKSPACE)


class OpsTestEvent(Event, abstract=True, event_namespace="opstest"):
    pass


class Flaked(OpsTestEvent, name="flaked"):
    thread_id: str


class Crashed(OpsTestEvent, name="crashed"):
    thread_id: str


@dataclass
class World:
    """What the actions consult: whether the flaky one may succeed yet, and what crashed."""

    fixed: bool = False
    crashed: set[str] = field(default_factory=set)


WORLD = World()


async def flaky(reaction: Reaction[Any]) -> None:
    await acting(reaction).notice("checking the backup")
    if not WORLD.fixed:
        raise RunFailure("the backup host is down", reason="backup_down")


async def crashing_send(reaction: Reaction[Any]) -> None:
    """Commits its message as send would, then dies before asking, on its first attempt."""
    content = "Triage incident: backup down"
    actions = acting(reaction)
    if reaction.run_id not in WORLD.crashed:
        WORLD.crashed.add(reaction.run_id)
        thread = actions.threads[0]
        message_id = IdDeriver(reaction.run_id).next(
            "msg", segment=0, operation="post_message", subject=(thread, digest(content))
        )
        died = await reaction.deps.artifacts.open(TENANT, WORKSPACE, actor=actions.actor)
        await died.commit(PostMessage(thread_id=thread, content=content, message_id=message_id))
        raise RunFailure("the worker died between commit and ask", reason="crash", permanent=True)
    await actions.send(content)


RULES = [
    Rule(
        name="ops:flaky",
        when=on(Flaked),
        then=run("flaky"),
        start="beginning",
        retry=RetryPolicy(max_attempts=2, backoff=timedelta(milliseconds=1)),
    ),
    Rule(name="ops:crash", when=on(Crashed), then=run("crash"), start="beginning"),
]


async def _respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    return ModelResponse(parts=[TextPart("looking")])


AGENT = Agent(
    function_model(_respond),
    deps_type=Session[None],
    capabilities=[ArtifactWorkspace(types=[Note])],
)


@dataclass
class Ops:
    runtime: Runtime
    reactor: Reactor[Any]
    enqueued: list[str] = field(default_factory=list)

    @property
    def rules(self) -> Workspaces:
        return self.runtime.application.rules

    async def enqueue(self, tenant_id: str, workspace_id: str, run_id: str) -> None:
        self.enqueued.append(run_id)

    async def until_ended(self, run_id: str) -> str:
        for _ in range(50):
            await execute_run(self.runtime, TENANT, WORKSPACE, run_id)
            current = await self.rules.storage.run(_ref(), run_id)
            assert current is not None
            if current.status in ("succeeded", "dead", "cancelled", "skipped"):
                return current.status
            await asyncio.sleep(0.01)
        raise AssertionError(f"run {run_id} did not end")

    async def fire(self, event: Event, workspace: str = WORKSPACE) -> str:
        handle = await self.rules.open(TENANT, workspace, actor=SourceActor(name="test"))
        published = await handle.publish(event)
        await self.reactor.evaluate()
        [fired] = [r for r in await handle.runs() if published.envelope.seq in r.matched]
        return fired.id

    async def thread(self) -> str:
        handle = await self.runtime.application.artifacts.open(
            TENANT, WORKSPACE, actor=UserActor(id="alice")
        )
        return (await handle.create_thread("backups")).id

    async def posted(self, thread: str) -> list[tuple[MessagePosted, str]]:
        handle = await self.runtime.application.artifacts.open(
            TENANT, WORKSPACE, actor=UserActor(id="alice")
        )
        return [
            (e.event, e.actor.participant)
            for e in await handle.read(threads={thread})
            if isinstance(e.event, MessagePosted)
        ]

    async def turns(self, thread: str) -> list[RunStarted]:
        await self.runtime._grace(10)
        handle = await self.runtime.application.artifacts.open(
            TENANT, WORKSPACE, actor=UserActor(id="alice")
        )
        return [
            e.event for e in await handle.read(threads={thread}) if isinstance(e.event, RunStarted)
        ]


def _ref() -> Any:
    from reflexr.workspace import WorkspaceRef

    return WorkspaceRef(TENANT, WORKSPACE)


async def _ops(url: str, home: Path) -> Ops:
    engine = create_engine(url)
    await migrate(engine)
    actions = {"flaky": flaky, "crash": crashing_send}
    application = Application(
        artifacts=ArtifactWorkspaces(ArtifactSql(engine)),
        rules=Workspaces(RuleSql(engine), events=[Flaked, Crashed], rules=RULES),
        actions=actions,
        agent=AGENT,
        engines=(engine,),
    )
    settings = Settings(home=home, database_url=url, lease_ttl_s=5.0)
    allowlists = parse_allowlist('[rules."ops:crash"]\nturns = true\n')
    runtime = await Runtime.start(
        settings, role="cli", application=application, allowlists=lambda: allowlists
    )
    return Ops(runtime, Reactor(application.rules, actions=actions))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def ops(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Ops]:
    WORLD.fixed = False
    WORLD.crashed.clear()
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'relayr.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    subject = await _ops(url, tmp_path)
    try:
        yield subject
    finally:
        await subject.runtime.aclose()
