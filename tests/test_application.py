"""Application wiring, the runtime's life cycle, and the example application, on real storage."""

import asyncio
import dataclasses
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from artifactr import Runner, UserActor
from artifactr.agent import ArtifactWorkspace, RunHandle, Session, function_model
from artifactr.core import MessagePosted, RunEnded
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo
from reflexr import SourceActor
from sqlalchemy import inspect
from structlog.testing import capture_logs

from relayr.application import (
    Application,
    create_engine,
    load_application,
    load_factory,
    open_storage,
)
from relayr.batch import RunBatch
from relayr.core.allowlist import Allowlists
from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.errors import InvalidAllowlist, InvalidApplication
from relayr.dispatch import Dispatcher
from relayr.executor import Executed, execute_run, execute_runs
from relayr.runtime import Role, Runtime
from relayr.settings import Settings
from rules.example import (
    DEPLOY_NOTICE,
    INCIDENT_TRIAGE,
    REPLY,
    DeployFinished,
    IncidentOpened,
    TriageNote,
    build_app,
    create_app,
    triage_agent,
)
from tests.services import SQL_STORAGES, STORAGES, storage_url

ROOT = Path(__file__).resolve().parents[1]
ALLOWLIST = ROOT / "rules" / "allowlist.toml"
TENANT, WORKSPACE = "acme", "ops"
ALICE = UserActor(id="alice")


@pytest.fixture(params=STORAGES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return storage_url(request, tmp_path)


def settings_for(url: str, tmp_path: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "home": tmp_path,
        "database_url": url,
        "allowlist": ALLOWLIST,
        "turn_grace_s": 5,
    }
    return Settings(**{**values, **overrides})  # type: ignore[arg-type]


@pytest.fixture
def factories(tmp_path: Path) -> Iterator[str]:
    """A module of application factories, some of them broken, importable as ``factories``."""
    (tmp_path / "factories.py").write_text(
        textwrap.dedent(
            """
            from reflexr import Rule, on, run
            from reflexr.workspace import InMemoryStorage, Workspaces
            from artifactr import Workspaces as ArtifactWorkspaces
            from artifactr.workspace import InMemoryStorage as ArtifactMemory
            from relayr.application import Application
            from rules.example import DeployFinished

            def not_async(settings):
                return None

            async def not_an_application(settings):
                return {"rules": []}

            async def missing_action(settings):
                rule = Rule(name="ops:orphan", when=on(DeployFinished), then=run("gone"))
                return Application(
                    artifacts=ArtifactWorkspaces(ArtifactMemory()),
                    rules=Workspaces(InMemoryStorage(), rules=[rule]),
                    actions={},
                )

            value = 42
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        yield "factories"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("factories", None)


# -- load_factory and load_application ---------------------------------------------------------


def test_the_default_factory_is_the_example() -> None:
    assert load_factory(Settings().app) is create_app


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("rules.example", "name it as package.module:function"),
        ("no_such_package.mod:create_app", "cannot be imported: No module named"),
        ("rules.example:no_such_factory", "rules.example has no no_such_factory"),
        ("factories:value", "is not an async function of the settings"),
        ("factories:not_async", "is not an async function of the settings"),
    ],
)
def test_a_factory_that_cannot_be_loaded_is_named(
    factories: str, reference: str, message: str
) -> None:
    with pytest.raises(InvalidApplication, match=message) as refused:
        load_factory(reference)

    assert refused.value.code == "invalid_application"
    assert repr(reference) in refused.value.message


async def test_a_factory_must_return_an_application(factories: str) -> None:
    with pytest.raises(InvalidApplication, match="returned dict, not an Application"):
        await load_application(Settings(app="factories:not_an_application"))


async def test_rules_must_have_their_actions(factories: str) -> None:
    with pytest.raises(InvalidApplication, match="rule ops:orphan runs 'gone', which is not"):
        await load_application(Settings(app="factories:missing_action"))


# -- storage -----------------------------------------------------------------------------------


@pytest.mark.parametrize("database_url", SQL_STORAGES, indirect=True)
async def test_both_libraries_share_one_migrated_database(
    database_url: str, tmp_path: Path
) -> None:
    settings = settings_for(database_url, tmp_path)

    first = await open_storage(settings)
    second = await open_storage(settings)  # migrating again is a no-op
    try:
        assert first.engine is not None
        async with first.engine.connect() as connection:
            tables = await connection.run_sync(lambda c: inspect(c).get_table_names())
        assert "artifactr_alembic_version" in tables
        assert "reflexr_alembic_version" in tables
        assert {t.split("_")[0] for t in tables} == {"artifactr", "reflexr"}
    finally:
        for storage in (first, second):
            for engine in storage.engines:
                await engine.dispose()


@pytest.mark.postgres
async def test_processes_that_start_together_migrate_one_at_a_time(postgres_url: str) -> None:
    settings = Settings(database_url=postgres_url)

    opened = await asyncio.gather(*(open_storage(settings) for _ in range(4)))

    for storage in opened:
        for engine in storage.engines:
            await engine.dispose()


async def test_a_sqlite_database_gets_its_folder(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path}/deep/er/relayr.db")
    try:
        assert (tmp_path / "deep" / "er").is_dir()
        assert engine.dialect.name == "sqlite"
    finally:
        await engine.dispose()


async def test_memory_storage_has_no_engine() -> None:
    storage = await open_storage(Settings(database_url="memory://"))

    assert storage.engine is None
    assert storage.engines == ()


# -- the runtime -------------------------------------------------------------------------------


async def test_a_runtime_refuses_a_missing_allowlist(tmp_path: Path) -> None:
    settings = settings_for("memory://", tmp_path, allowlist=tmp_path / "nope.toml")

    with pytest.raises(InvalidAllowlist, match="cannot read: no such file"):
        await Runtime.start(settings, role="worker")


@pytest.mark.parametrize("role", ["cli", "dispatcher"])
async def test_only_a_worker_needs_the_allowlist(tmp_path: Path, role: Role) -> None:
    broken = tmp_path / "allowlist.toml"
    broken.write_text('[rules."ops:x"]\nturns = "yes"\n')
    runtime = await Runtime.start(settings_for("memory://", tmp_path, allowlist=broken), role=role)
    try:
        assert runtime.allowlist_file is None
        assert runtime.bridge.allowlists().for_rule("ops:x").turns is False
    finally:
        await runtime.aclose()


async def test_a_runtime_without_an_agent_starts_no_turns(tmp_path: Path) -> None:
    application = dataclasses.replace(
        await create_app(Settings(database_url="memory://")), agent=None
    )

    runtime = await Runtime.start(
        settings_for("memory://", tmp_path), role="worker", application=application
    )
    try:
        assert runtime.bridge.runner is None
        assert runtime.recovered == []
    finally:
        await runtime.aclose()
        await runtime.aclose()  # a second close does nothing


async def test_runtimes_have_their_own_holders(tmp_path: Path) -> None:
    settings = settings_for("memory://", tmp_path)
    first = await Runtime.start(settings, role="cli")
    second = await Runtime.start(settings, role="dispatcher")
    try:
        assert first.holder != second.holder
        assert first.holder.startswith("relayr-cli:")
        assert second.holder.startswith("relayr-dispatcher:")
    finally:
        await first.aclose()
        await second.aclose()


# -- the example application, end to end -------------------------------------------------------


class Example:
    """The example application in a worker's runtime, with the dispatcher's pass."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.application = runtime.application
        self.dispatcher = Dispatcher(runtime)
        self.enqueued: list[RunBatch] = []

    async def enqueue(self, batch: RunBatch) -> None:
        self.enqueued.append(batch)

    async def thread(self, title: str) -> str:
        handle = await self.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        return (await handle.create_thread(title)).id

    async def publish(self, *events: DeployFinished | IncidentOpened) -> None:
        source = await self.application.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="ci"))
        for event in events:
            await source.publish(event)

    async def work(self) -> list[Executed]:
        """One dispatcher pass, then every run it enqueued executed."""
        self.enqueued.clear()
        await self.dispatcher.pass_once(self.enqueue)
        return [
            executed
            for batch in self.enqueued
            for executed in await execute_runs(
                self.runtime, batch.tenant_id, batch.workspace_id, batch.run_ids
            )
        ]

    async def transcript(self, thread_id: str) -> list[tuple[str, str, str]]:
        """(kind, author, content) of each message in the thread, in order."""
        handle = await self.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        return [
            (env.event.kind, env.actor.participant, env.event.content)
            for env in await handle.read(threads={thread_id})
            if isinstance(env.event, MessagePosted)
        ]

    async def turns_ended(self, thread_id: str) -> list[str]:
        handle = await self.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        return [
            env.event.status
            for env in await handle.read(threads={thread_id})
            if isinstance(env.event, RunEnded)
        ]


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
    turns = example.runtime.bridge.turns.running()
    await asyncio.wait_for(asyncio.gather(*(t.task for t in turns)), 10)

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


# -- turns across a worker's life: recovery at start, grace at shutdown ------------------------


@pytest.mark.parametrize("database_url", SQL_STORAGES, indirect=True)
async def test_a_worker_takes_the_turns_asked_for_and_never_taken(
    database_url: str, tmp_path: Path
) -> None:
    settings = settings_for(database_url, tmp_path)
    died = await build_app(settings)
    try:
        source = await died.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="ci"))
        await source.publish(DeployFinished(service="api", status="ok", thread_id="none"))
        handle = await died.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        thread = (await handle.create_thread("incident")).id
        closed: Runner[None] = Runner(triage_agent(), app=None)
        await closed.aclose()  # a worker that stops between its send's ask and the turn
        sent = await closed.send(handle, thread, "please triage", message_id="msg-asked")
        assert sent.run is None
    finally:
        await died.aclose()

    runtime = await Runtime.start(settings, role="worker")
    try:
        [recovered] = runtime.recovered
        await asyncio.wait_for(recovered.task, 10)
        example = Example(runtime)
        assert (await example.transcript(thread))[-1] == ("message", f"agent:{thread}", REPLY)
    finally:
        await runtime.aclose()


def gated_agent(replying: asyncio.Event, reply: asyncio.Event) -> Agent[Session[None], str]:
    """The example's agent, whose reply waits for the test: it sets ``replying``, then waits
    for ``reply``."""

    async def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        replying.set()
        await reply.wait()
        return ModelResponse(parts=[TextPart(REPLY)])

    return Agent(
        function_model(respond),
        deps_type=Session[None],
        capabilities=[ArtifactWorkspace(types=[TriageNote])],
    )


async def test_shutdown_lets_running_turns_finish_within_the_grace(tmp_path: Path) -> None:
    settings = settings_for(f"sqlite+aiosqlite:///{tmp_path}/relayr.db", tmp_path, turn_grace_s=60)
    replying, reply = asyncio.Event(), asyncio.Event()
    application = dataclasses.replace(await build_app(settings), agent=gated_agent(replying, reply))
    runtime = await Runtime.start(settings, role="worker", application=application)
    example = Example(runtime)
    thread = await example.thread("incident")
    await example.publish(IncidentOpened(title="slow", thread_id=thread))
    [executed] = await example.work()
    assert executed.outcome == "succeeded"
    await asyncio.wait_for(replying.wait(), 30)
    assert runtime.bridge.turns.running()  # it waits for the test, however fast the machine

    closing = asyncio.create_task(runtime.aclose())
    await asyncio.sleep(0)  # aclose runs up to its first wait: the grace, for the turn
    assert not closing.done()
    reply.set()
    await asyncio.wait_for(closing, 30)

    check = await build_app(settings)
    try:
        handle = await check.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        ended = [
            e.event.status
            for e in await handle.read(threads={thread})
            if isinstance(e.event, RunEnded)
        ]
        assert ended == ["completed"]
    finally:
        await check.aclose()


async def test_shutdown_stops_turns_that_outlive_the_grace(tmp_path: Path) -> None:
    settings = settings_for(f"sqlite+aiosqlite:///{tmp_path}/relayr.db", tmp_path, turn_grace_s=0.2)
    runtime = await Runtime.start(
        settings, role="worker", application=await build_app(settings, reply_delay_s=30)
    )
    example = Example(runtime)
    thread = await example.thread("incident")
    await example.publish(IncidentOpened(title="stuck", thread_id=thread))
    await example.work()

    await asyncio.wait_for(runtime.aclose(), 10)

    check = await build_app(settings)
    try:
        handle = await check.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        ended = [
            e.event.status
            for e in await handle.read(threads={thread})
            if isinstance(e.event, RunEnded)
        ]
        assert ended == ["stopped"]
    finally:
        await check.aclose()


async def test_shutdown_names_the_turns_still_asked_for_after_the_grace(tmp_path: Path) -> None:
    """A turn that failed to start on a transient fault is asked for again; one still being
    asked for when the grace ends is named in the warning, as a running one is."""
    settings = settings_for(f"sqlite+aiosqlite:///{tmp_path}/relayr.db", tmp_path, turn_grace_s=0.2)
    runtime = await Runtime.start(settings, role="worker", application=await build_app(settings))
    asked, answer = asyncio.Event(), asyncio.Event()

    async def failed() -> Any:
        raise ConnectionResetError("the turn's connection was dropped")

    async def again() -> RunHandle | None:
        asked.set()
        await answer.wait()
        return None

    try:
        handle = RunHandle("run-1", "thr-1", asyncio.create_task(failed()))
        runtime.bridge.turns.started(handle, again=again)
        await asyncio.wait_for(asked.wait(), 30)

        with capture_logs() as logs:
            await asyncio.wait_for(runtime.aclose(), 30)
    finally:
        answer.set()
        await asyncio.gather(*runtime.bridge.turns.asking)
        await runtime.aclose()

    [warned] = [e for e in logs if e["event"] == "turns still running after the grace period"]
    assert (warned["turns"], warned["asking"]) == (0, 1)


def test_the_allowlist_grants_turns_to_the_triage_rule_only() -> None:
    from relayr.allowlist_file import load_allowlist

    allowlists: Allowlists = load_allowlist(ALLOWLIST)

    assert allowlists.for_rule(INCIDENT_TRIAGE.name).turns
    assert not allowlists.for_rule(DEPLOY_NOTICE.name).turns


def test_an_application_is_frozen() -> None:
    assert dataclasses.is_dataclass(Application)
    assert Application.__dataclass_params__.frozen  # type: ignore[attr-defined]
