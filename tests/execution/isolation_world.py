"""The world of the write-isolation tests: a rule's run in its workspace, with twins next door.

Real artifactr storage (in memory, or SQLite from a migrated template copied for each example),
reflexr's rules in memory, the real ledger behind a spy that notes the workspaces every write
and read named (:class:`RecordingLedger`), a real Runner, and the allowlist the test sets.
Three workspaces: the run's own (``HOME``), another of its tenant (``NEIGHBOUR``) and one of
another tenant (``STRANGER``). Used by :mod:`tests.execution.test_write_isolation`,
:mod:`tests.execution.test_hostile_ids` and :mod:`tests.execution.test_content_edges`.
"""

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import pytest
from artifactr import MarkdownArtifact, UserActor
from artifactr import Workspace as ArtifactWorkspace
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.agent import ArtifactWorkspace as ArtifactCapability
from artifactr.agent import Runner, Session, function_model
from artifactr.core import Envelope
from artifactr.sql import SqlStorage, create_sqlite_engine, migrate
from artifactr.workspace import InMemoryStorage as ArtifactMemory
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo
from reflexr import Event, Rule, SourceActor, on, run
from reflexr.core import start
from reflexr.workspace import InMemoryStorage, Reaction, Reactor, Workspaces
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from relayr.core.allowlist import Allowlists
from relayr.core.emissions import EmissionRecord
from relayr.execution.actions import RunActions, acting
from relayr.ledger import (
    Cause,
    InMemoryLedger,
    Ledger,
    LedgerWrites,
    SqlLedger,
    WorkspaceKey,
    WriteKind,
)
from relayr.runtime.bridge import Bridge
from tests.workers import TURNS_SETTLE_S

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
HOME = WorkspaceKey("acme", "ops")
NEIGHBOUR = WorkspaceKey("acme", "other")
STRANGER = WorkspaceKey("evil", "ops")
RULE = "ops:fuzz"
RULE_AUTHOR = f"external_agent:reflexr:{RULE}"
USER = UserActor(id="alice")


class IsolationEvent(Event, abstract=True, event_namespace="isolationtest"):
    pass


class Happened(IsolationEvent, name="happened"):
    thread_id: str


class IsolationNote(MarkdownArtifact):
    pass


class IsolationTimeline(MarkdownArtifact):
    pass


KINDS = ("isolation_note", "isolation_timeline")
RULES = [Rule(name=RULE, when=on(Happened), then=run("act"), start="beginning")]


async def _reply(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    return ModelResponse(parts=[TextPart("noted")])


AGENT = Agent(
    function_model(_reply),
    deps_type=Session[None],
    capabilities=[ArtifactCapability(types=[IsolationNote, IsolationTimeline])],
)


async def _noop(reaction: Reaction[Any]) -> None:
    return None


class RecordingLedger:
    """The real ledger, and the workspaces every write to it and every read of it named (a spy,
    not a fake)."""

    def __init__(self, inner: Ledger) -> None:
        self.inner = inner
        self.written: list[WorkspaceKey] = []
        self.read: list[WorkspaceKey] = []

    async def record_cause(
        self, workspace: WorkspaceKey, kind: WriteKind, key: str, cause: Cause
    ) -> Cause:
        self.written.append(workspace)
        return await self.inner.record_cause(workspace, kind, key, cause)

    async def cause(self, workspace: WorkspaceKey, kind: WriteKind, key: str) -> Cause | None:
        self.read.append(workspace)
        return await self.inner.cause(workspace, kind, key)

    async def causes(
        self, workspace: WorkspaceKey, keys: Collection[tuple[WriteKind, str]]
    ) -> dict[tuple[WriteKind, str], Cause]:
        self.read.append(workspace)
        return await self.inner.causes(workspace, keys)

    async def record_emission(self, record: EmissionRecord) -> None:
        self.written.append(WorkspaceKey(record.tenant_id, record.workspace_id))
        await self.inner.record_emission(record)

    async def emissions(self, workspace: WorkspaceKey, run_id: str) -> list[EmissionRecord]:
        self.read.append(workspace)
        return await self.inner.emissions(workspace, run_id)

    async def write(self, writes: LedgerWrites) -> None:
        self._saw(writes)
        await self.inner.write(writes)

    @asynccontextmanager
    async def alongside(self, writes: LedgerWrites) -> AsyncIterator[None]:
        self._saw(writes)
        async with self.inner.alongside(writes):
            yield

    def _saw(self, writes: LedgerWrites) -> None:
        self.written += [cause.workspace for cause in writes.causes]
        self.written += [WorkspaceKey(r.tenant_id, r.workspace_id) for r in writes.emissions]

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class World:
    """Real artifactr storage, reflexr rules in memory, a ledger, a Runner, and the allowlist."""

    artifacts: ArtifactWorkspaces
    ledger: RecordingLedger
    engine: AsyncEngine | None = None
    allowlists: Allowlists = field(default_factory=Allowlists.empty)
    rules: Workspaces = field(
        default_factory=lambda: Workspaces(InMemoryStorage(), events=[Happened], rules=RULES)
    )
    runner: Runner[None] = field(default_factory=lambda: Runner(AGENT, app=None))
    logs: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[RunActions] = field(default_factory=list)
    _runs: dict[tuple[WorkspaceKey, str], Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.bridge = Bridge(
            artifacts=self.artifacts,
            ledger=self.ledger,
            allowlists=lambda: self.allowlists,
            runner=self.runner,
            clock=lambda: NOW,
        )
        self.reactor = Reactor(self.rules, actions={"act": _noop})

    async def handle(self, key: WorkspaceKey) -> ArtifactWorkspace:
        return await self.artifacts.open(key.tenant_id, key.workspace_id, actor=USER)

    async def log(self, key: WorkspaceKey) -> list[Envelope]:
        return list(await (await self.handle(key)).read())

    async def reaction(self, key: WorkspaceKey, thread_id: str, attempt: int = 1) -> Reaction[Any]:
        """An attempt of the run the rule makes of the workspace's event in ``thread_id``."""
        workspace = await self.rules.open(
            key.tenant_id, key.workspace_id, actor=SourceActor(name="test")
        )
        published = await workspace.publish(Happened(thread_id=thread_id), id=f"evt-{thread_id}")
        if (key, thread_id) not in self._runs:
            await self.reactor.evaluate()
            [pending] = [
                found
                for found in await workspace.runs(rule=RULE)
                if published.envelope.seq in found.matched
            ]
            self._runs[(key, thread_id)] = pending
        started, _ = start(self._runs[(key, thread_id)], now=NOW)
        started = started.model_copy(update={"attempts": attempt, "epoch": attempt})
        return Reaction(
            workspace=workspace,
            run=started,
            rule=self.rules.rules[RULE],
            events=(published.envelope,),
            deps=self.bridge,
        )

    async def attempt(self, key: WorkspaceKey, thread_id: str, attempt: int = 1) -> RunActions:
        actions = acting(await self.reaction(key, thread_id, attempt))
        self.attempts.append(actions)
        return actions

    async def records(self, key: WorkspaceKey, run_id: str) -> list[EmissionRecord]:
        """The run's emission records, once the attempts so far completed: completing an
        attempt commits what its actions left for it (as the executor does)."""
        for actions in self.attempts:
            await self.ledger.write(actions.pending)
        self.attempts.clear()
        return await self.ledger.emissions(key, run_id)

    async def settle(self) -> None:
        """Wait until no turn runs: those the runs started, and those they handed over to."""
        assert await self.bridge.turns.settled(TURNS_SETTLE_S) == (0, 0), "turns did not settle"


type StorageKind = Literal["memory", "sqlite"]

POLL_INTERVAL = timedelta(milliseconds=20)
"""How often a turn's watcher polls SQLite: one process writes here, so a short poll only
makes turns end sooner than artifactr's default half second would."""


async def migrated_template(folder: Path) -> Path:
    """A SQLite file with artifactr's and the ledger's tables, copied for each example."""
    path = folder / "template.db"
    engine = create_sqlite_engine(f"sqlite+aiosqlite:///{path}")
    try:
        await migrate(engine)
        await SqlLedger.open(engine)
    finally:
        await engine.dispose()
    return path


@asynccontextmanager
async def opened(kind: StorageKind, template: Path | None) -> AsyncIterator[World]:
    """A fresh world on ``kind`` storage, its log lines captured in ``world.logs``.

    Captured rather than printed: structlog unconfigured prints to stdout, which cannot encode
    the lone surrogates some hostile ids carry (a worker's configured logging escapes them).
    """
    with capture_logs() as logs:
        async with _opened(kind, template) as world:
            world.logs = logs
            yield world


@asynccontextmanager
async def _opened(kind: StorageKind, template: Path | None) -> AsyncIterator[World]:
    """A fresh world on ``kind`` storage; SQLite starts from a copy of ``template``."""
    if kind == "memory":
        world = World(ArtifactWorkspaces(ArtifactMemory()), RecordingLedger(InMemoryLedger()))
        try:
            yield world
        finally:
            await world.runner.aclose()
        return
    assert template is not None
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "world.db"
        shutil.copyfile(template, path)
        engine = create_sqlite_engine(f"sqlite+aiosqlite:///{path}")
        world = World(
            ArtifactWorkspaces(SqlStorage(engine, poll_interval=POLL_INTERVAL)),
            RecordingLedger(await SqlLedger.open(engine)),
            engine=engine,
        )
        try:
            yield world
        finally:
            await world.runner.aclose()
            await engine.dispose()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return asyncio.run(migrated_template(tmp_path_factory.mktemp("isolation")))
