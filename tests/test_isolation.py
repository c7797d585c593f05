"""A rule writes only in its run's tenant and workspace, and only in its chain under ``chain``.

Hypothesis draws the rule's allowlist and a sequence of what its action asks (notice, send,
post, create_thread, create, edit, archive) with targets from: its chain thread, other threads
of its workspace, a thread and an artifact of another workspace of its tenant and of another
tenant, ids that do not exist, and garbage. Storage is real artifactr (in memory and SQLite)
with a real Runner; the run is attempted once or twice, as a retry would.

The hostile twist: the other workspace and the other tenant each hold a twin of the run, with
the same run id (reflexr derives it from the rule and the event's seq, not the workspace) and
a thread with the same id as the run's chain thread, and the twin has made the same writes
first. So every id the run derives is already used next door. Afterwards:

- the other workspace's and the other tenant's logs are exactly as before, and the ledger was
  only written under the run's own workspace;
- every id an operation returned names a write in the run's own workspace;
- with ``threads = "chain"``, no thread of the workspace outside the chain (and the threads
  the run created) got any event, from the rule or from a turn it started;
- the rule never resolves a proposal.

A table test then pins how each hostile id is refused: a ``RunFailure`` with a stable reason,
logged once as "write refused".
"""

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Collection
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
from artifactr.core import CreateThread, Envelope, ProposalResolved
from artifactr.sql import SqlStorage, create_sqlite_engine, migrate
from artifactr.workspace import InMemoryStorage as ArtifactMemory
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo
from reflexr import Event, Rule, SourceActor, on, run
from reflexr.core import start
from reflexr.workspace import InMemoryStorage, Reaction, Reactor, RunFailure, Workspaces
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from relayr.actions import RunActions, acting
from relayr.bridge import Bridge
from relayr.core.allowlist import Allowlists
from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.emissions import EmissionRecord
from relayr.ledger import (
    Cause,
    InMemoryLedger,
    Ledger,
    LedgerWrites,
    SqlLedger,
    WorkspaceKey,
    WriteKind,
)

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
        for _ in range(50):
            running = self.bridge.turns.running()
            if not running:
                await self.runner.drain()
                if not self.bridge.turns.running():
                    return
            await asyncio.gather(*(handle.task for handle in running), return_exceptions=True)
        raise AssertionError("turns did not settle")


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


# ─── the places a rule may be asked to write ──────────────────────────────────


@dataclass
class Places:
    """The ids of one world: threads and artifacts here, next door and in another tenant."""

    chain: str
    others: tuple[str, str]
    neighbour_thread: str
    stranger_thread: str
    artifacts: dict[str, str]

    def thread(self, target: str, created: list[str]) -> str | None:
        match target:
            case "none":
                return None
            case "chain":
                return self.chain
            case "other":
                return self.others[0]
            case "other2":
                return self.others[1]
            case "created":
                return created[-1] if created else self.others[1]
            case "neighbour":
                return self.neighbour_thread
            case "stranger":
                return self.stranger_thread
            case "missing":
                return "thr_0000000000000000"
        return target.removeprefix("garbage:")

    def artifact(self, target: str, made: list[str]) -> str:
        if target == "made":
            return made[-1] if made else self.artifacts["free"]
        if target.startswith("garbage:"):
            return target.removeprefix("garbage:")
        return self.artifacts[target]


async def furnish(world: World) -> Places:
    """Threads and artifacts in the three workspaces; the chain thread's id is in all three."""
    home = await world.handle(HOME)
    chain = (await home.create_thread("incident")).id
    others = ((await home.create_thread("billing")).id, (await home.create_thread("chat")).id)
    artifacts = {
        "in_chain": await _create(home, IsolationNote(text="chain notes"), chain),
        "in_other": await _create(home, IsolationNote(text="billing notes"), others[0]),
        "free": await _create(home, IsolationNote(text="free notes"), None),
        "timeline": await _create(home, IsolationTimeline(text="timeline"), None),
    }
    far: dict[str, str] = {}
    for key, name in ((NEIGHBOUR, "neighbour"), (STRANGER, "stranger")):
        there = await world.handle(key)
        await there.commit(CreateThread(thread_id=chain, title="same id, elsewhere"))
        far[name] = (await there.create_thread(f"{name} thread")).id
        artifacts[name] = await _create(there, IsolationNote(text=f"{name} notes"), far[name])
    artifacts["missing"] = "art_0000000000000000"
    return Places(chain, others, far["neighbour"], far["stranger"], artifacts)


async def _create(handle: ArtifactWorkspace, artifact: Any, thread_id: str | None) -> str:
    applied = await handle.create(artifact, thread_id=thread_id)
    artifact_id = getattr(applied, "artifact_id", None)
    assert isinstance(artifact_id, str)
    return artifact_id


# ─── operations ───────────────────────────────────────────────────────────────

GARBAGE = [
    "garbage:",
    "garbage: ",
    "garbage:../ops",
    "garbage:thr_" + "f" * 300,
    "garbage:\x00",
    "garbage:%s",
    "garbage:" + chr(0xD800),
]
THREAD_TARGETS = [
    "none",
    "chain",
    "other",
    "other2",
    "created",
    "neighbour",
    "stranger",
    "missing",
    *GARBAGE,
]
ARTIFACT_TARGETS = [
    "in_chain",
    "in_other",
    "free",
    "timeline",
    "made",
    "neighbour",
    "stranger",
    "missing",
    *GARBAGE,
]


@dataclass(frozen=True)
class Op:
    name: str
    target: str
    text: str


texts = st.sampled_from(["status: ok", "status: ok", "é 🚀 שלום", "postmortem"])
thread_targets = st.sampled_from(THREAD_TARGETS)
operations = st.one_of(
    st.builds(Op, st.sampled_from(["notice", "send", "post"]), thread_targets, texts),
    st.builds(Op, st.just("create_thread"), st.just("none"), texts),
    st.builds(Op, st.just("create"), thread_targets, texts),
    st.builds(Op, st.sampled_from(["edit", "archive"]), st.sampled_from(ARTIFACT_TARGETS), texts),
)


@st.composite
def allowlist_texts(draw: st.DrawFn) -> str:
    lines = [f'[rules."{RULE}"]']
    if draw(st.booleans()):
        lines.append(f"turns = {'true' if draw(st.booleans()) else 'false'}")
    if draw(st.booleans()):
        lines.append(f'threads = "{draw(st.sampled_from(["chain", "any"]))}"')
    if draw(st.booleans()):
        lines.append("create_threads = true")
    direct = draw(st.lists(st.sampled_from(KINDS), unique=True))
    lines.append(f"direct = {direct!r}".replace("'", '"'))
    return "\n".join(lines) + "\n"


@dataclass
class Done:
    """What the operations returned and how they were refused."""

    threads: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    made: list[str] = field(default_factory=list)
    proposals: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


async def perform(actions: RunActions, ops: list[Op], places: Places, done: Done) -> None:
    """Ask for each operation; a refusal is noted, and the action goes on as a rule's might."""
    for op in ops:
        try:
            await _perform(actions, op, places, done)
        except RunFailure as refused:
            done.refusals.append(refused.reason or "none")
        except Exception as escaped:
            done.refusals.append(type(escaped).__name__)


async def _perform(actions: RunActions, op: Op, places: Places, done: Done) -> None:
    if op.name in ("notice", "send", "post"):
        write: Callable[..., Any] = getattr(actions, op.name)
        done.messages.append(await write(op.text, thread_id=places.thread(op.target, done.threads)))
    elif op.name == "create_thread":
        done.threads.append(await actions.create_thread(op.text))
    elif op.name == "create":
        thread = places.thread(op.target, done.threads)
        made = await actions.create(IsolationNote(text=op.text), thread_id=thread)
        (done.made if made.startswith("art_") else done.proposals).append(made)
    else:
        artifact = places.artifact(op.target, done.made)
        if op.name == "edit":
            changed = await actions.edit(artifact, "/text", op.text)
        else:
            changed = await actions.archive(artifact)
        if changed is not None:
            (done.made if changed.startswith("art_") else done.proposals).append(changed)


# ─── the property ─────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Story:
    """What one example asks: the rule's allowlist, the thread its event names (usually its
    own; a hostile publisher may name another tenant's or none that exists), and the writes."""

    allowlist: str
    fired_in: str
    ops: list[Op]
    attempts: int


stories = st.builds(
    Story,
    allowlist_texts(),
    st.sampled_from(["chain", "chain", "chain", "stranger", "missing"]),
    st.lists(operations, min_size=1, max_size=8),
    st.integers(min_value=1, max_value=2),
)


async def scenario(kind: StorageKind, template: Path | None, story: Story) -> None:
    async with opened(kind, template) as world:
        world.allowlists = parse_allowlist(story.allowlist)
        places = await furnish(world)
        fired_in = places.thread(story.fired_in, [])
        assert fired_in is not None
        for key in (NEIGHBOUR, STRANGER):  # the twins write first, with the same ids
            twin = await world.attempt(key, fired_in)
            await perform(twin, story.ops, places, Done())
        await world.settle()
        before = {key: await world.log(key) for key in (HOME, NEIGHBOUR, STRANGER)}
        world.ledger.written.clear()
        world.ledger.read.clear()

        done = Done()
        for attempt in range(1, story.attempts + 1):
            done = Done()
            actions = await world.attempt(HOME, fired_in, attempt)
            await perform(actions, story.ops, places, done)
        await world.settle()
        for reason in done.refusals:
            event(f"refused: {reason}")

        for key in (NEIGHBOUR, STRANGER):
            assert await world.log(key) == before[key], f"{key} changed"
        assert set(world.ledger.written) <= {HOME}
        assert set(world.ledger.read) <= {HOME}
        run_id = (await world.reaction(HOME, fired_in)).run_id
        for key in (NEIGHBOUR, STRANGER):
            twin = await world.records(key, run_id)
            assert all(record.tenant_id == key.tenant_id for record in twin)

        home = await world.handle(HOME)
        log = await world.log(HOME)
        new = log[len(before[HOME]) :]
        assert all(envelope.workspace_id == HOME.workspace_id for envelope in new)
        posted = {e.event.message_id for e in log if e.event.type == "message_posted"}
        assert set(done.messages) <= posted
        assert set(done.threads) <= {thread.id for thread in await home.threads()}
        for artifact_id in done.made:
            await home.artifact(artifact_id)
        assert set(done.proposals) <= {p.id for p in await home.proposals(status=None)}
        mine = [e for e in new if e.actor.participant == RULE_AUTHOR]
        assert not any(isinstance(e.event, ProposalResolved) for e in mine)

        if world.allowlists.for_rule(RULE).threads == "chain":
            allowed = {fired_in, *done.threads}
            strays = [e for e in new if e.thread_id is not None and e.thread_id not in allowed]
            assert strays == [], [(e.thread_id, e.event.type, e.actor.participant) for e in strays]
        event(f"rule events written: {min(len(mine), 5)}{'+' if len(mine) >= 5 else ''}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stories)
def test_in_memory_a_rule_writes_only_in_its_workspace_and_chain(story: Story) -> None:
    asyncio.run(scenario("memory", None, story))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stories)
def test_on_sqlite_a_rule_writes_only_in_its_workspace_and_chain(
    template: Path, story: Story
) -> None:
    asyncio.run(scenario("sqlite", template, story))


# ─── how each hostile id is refused ───────────────────────────────────────────

SURROGATE = "thr_" + chr(0xD800)
HOSTILE_THREADS = {
    "empty": "",
    "blank": " ",
    "nul": "thr_\x00",
    "lone surrogate": SURROGATE,
    "300 characters": "thr_" + "f" * 300,
    "a path": "../ops",
    "missing": "thr_0000000000000000",
}
REFUSED: dict[str, frozenset[str]] = {
    "empty": frozenset({"invalid_id"}),
    "nul": frozenset({"invalid_id"}),
    "lone surrogate": frozenset({"invalid_id"}),
}
"""The reasons a hostile id may be refused with, when the rule may act anywhere; else
``thread_not_found`` (``not_found`` for an artifact id). Under ``chain`` every one of them is
``not_allowed``. An id no storage can hold
is refused before storage is asked, a missing thread before a proposal could name it."""
OPERATIONS = ("notice", "create", "propose", "edit")


def hostile_cases() -> list[Any]:
    cases = []
    # A chain refusal comes before storage is asked, so memory is enough for it; an artifact id
    # is no thread, so the scope does not apply to edit; on SQLite, the ways ids reach storage.
    for kind, scope, operations_ in (
        ("memory", "chain", OPERATIONS[:3]),
        ("memory", "any", OPERATIONS),
        ("sqlite", "any", ("notice", "create", "edit")),
    ):
        for operation in operations_:
            for name in HOSTILE_THREADS:
                case_id = f"{kind}-{scope}-{operation}-{name}"
                cases.append(pytest.param(kind, scope, operation, name, id=case_id))
    return cases


@pytest.mark.parametrize(("kind", "scope", "operation", "name"), hostile_cases())
def test_a_hostile_id_is_refused_with_a_stable_reason(
    template: Path, kind: StorageKind, scope: str, operation: str, name: str
) -> None:
    asyncio.run(refusal(kind, template, scope, operation, HOSTILE_THREADS[name], name))


async def ask(actions: RunActions, operation: str, target: str) -> None:
    if operation == "notice":
        await actions.notice("hello", thread_id=target)
    elif operation in ("create", "propose"):
        await actions.create(IsolationNote(text="hello"), thread_id=target)
    else:
        await actions.edit(target, "/text", "hello")


async def refusal(
    kind: StorageKind, template: Path, scope: str, operation: str, target: str, name: str
) -> None:
    direct = '["isolation_note"]' if operation == "create" else "[]"
    async with opened(kind, template) as world:
        world.allowlists = parse_allowlist(
            f'[rules."{RULE}"]\nthreads = "{scope}"\ndirect = {direct}\n'
        )
        chain = (await (await world.handle(HOME)).create_thread("incident")).id
        before = await world.log(HOME)
        actions = await world.attempt(HOME, chain)
        with pytest.raises(RunFailure) as refused:
            await ask(actions, operation, target)
        missing = "not_found" if operation == "edit" else "thread_not_found"
        expected = {"not_allowed"} if scope == "chain" else REFUSED.get(name, {missing})
        assert refused.value.reason in expected
        assert await world.log(HOME) == before
        lines = [line for line in world.logs if line["event"].startswith("write refused")]
        assert [line.get("reason") for line in lines] == [refused.value.reason]
