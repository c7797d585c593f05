"""A transient fault at each step of a run is retried inside the attempt (relayr.runtime.transient).

On real storage (SQLite and PostgreSQL), one statement of the step fails once as the database
would fail it (an ``OperationalError``, raised by the driver hook SQLAlchemy offers,
``before_cursor_execute``): the transaction rolls back, relayr tries the step again, and the run
still succeeds in its first attempt, with one message and its ledger rows, none of the rule's
retries spent. The broker's publish is broken for real: the dispatcher reaches Redis through a
proxy of the test's own (``tests.runtime.proxy``), which drops its connection and refuses the next
one.
"""

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from artifactr import ExternalAgentActor, UserActor
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import MessagePosted, PostMessage
from reflexr import RetryPolicy, Rule, SourceActor, on
from reflexr import run as action
from reflexr.workspace import Reaction
from reflexr.workspace import Workspaces as RuleWorkspaces
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from relayr.core.ids import IdDeriver, digest
from relayr.core.run_messages import RunMessage
from relayr.dispatch.dispatcher import Dispatcher
from relayr.execution.actions import acting
from relayr.execution.executor import execute_runs
from relayr.ledger import WorkspaceKey
from relayr.runtime.allowlist_file import load_allowlist
from relayr.runtime.application import Application, open_storage
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from rules.example import (
    ACTIONS,
    DEPLOY_NOTICE,
    INCIDENT_TRIAGE,
    DeployFinished,
    IncidentOpened,
    TriageNote,
    triage_agent,
)
from tasks.app import create_celery
from tasks.runs import send_runs
from tests.runtime.proxy import Proxy
from tests.services import REDIS_PORT, forget_redis_queue
from tests.workers import ALLOWLIST, TURNS_SETTLE_S, relayr_environment, running_worker

TENANT, WORKSPACE = "acme", "ops"
KEY = WorkspaceKey(TENANT, WORKSPACE)
ALICE = UserActor(id="alice")
GATE_TIMEOUT_S = 30.0


@dataclass
class Injector:
    """Fails the next statement that matches, once, as the database driver would."""

    pattern: re.Pattern[str] | None = None
    skip: int = 0
    """Matching statements to let through before the one that fails."""
    fired: int = 0
    after: int = 0
    """Statements that matched and ran after the fault: the step tried again."""
    tried_again: asyncio.Event = field(default_factory=asyncio.Event)

    def arm(self, pattern: str, *, skip: int = 0) -> None:
        self.pattern, self.skip = re.compile(pattern), skip

    def before(self, connection: Any, cursor: Any, statement: str, *_: Any) -> None:
        if self.pattern is None or not self.pattern.search(statement):
            return
        if self.fired:
            self.after += 1
            self.tried_again.set()
            return
        if self.skip:
            self.skip -= 1
            return
        self.fired += 1
        raise connection.dialect.loaded_dbapi.OperationalError("database is locked (injected)")

    @contextmanager
    def attached(self, engine: AsyncEngine) -> Iterator["Injector"]:
        event.listen(engine.sync_engine, "before_cursor_execute", self.before)
        try:
            yield self
        finally:
            event.remove(engine.sync_engine, "before_cursor_execute", self.before)


@dataclass
class Gate:
    """Holds the gated rule's action until the test opens it."""

    entered: asyncio.Event = field(default_factory=asyncio.Event)
    opened: asyncio.Event = field(default_factory=asyncio.Event)


HELD = Rule(
    name="ops:held-notice",
    when=on(DeployFinished).where(status="held"),
    then=action("held_notice"),
    ordering="none",
    start="beginning",
    retry=RetryPolicy(max_attempts=5),
)


async def held_notice(reaction: Reaction[Any]) -> None:
    gate = reaction.deps.app
    assert isinstance(gate, Gate)
    gate.entered.set()
    await asyncio.wait_for(gate.opened.wait(), GATE_TIMEOUT_S)
    await acting(reaction).notice("held notice", thread_id=reaction.events[-1].event.thread_id)


@dataclass
class World:
    runtime: Runtime
    engine: AsyncEngine
    gate: Gate

    @property
    def application(self) -> Application:
        return self.runtime.application

    async def thread(self) -> str:
        handle = await self.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        return (await handle.create_thread("faults")).id

    async def run_of(self, event: DeployFinished | IncidentOpened, rule: Rule | None = None) -> str:
        """Publish ``event``; return the id of the run of ``rule`` (or the only one) it made."""
        source = await self.application.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="t"))
        await source.publish(event)
        batches: list[RunMessage] = []

        async def enqueue(batch: RunMessage) -> None:
            batches.append(batch)

        await Dispatcher(self.runtime).pass_once(enqueue)
        made = {run_id for batch in batches for run_id in batch.run_ids}
        if rule is not None:
            made &= {r.id for r in await source.runs(rule=rule.name)}
        [run_id] = made
        return run_id

    async def run(self, run_id: str) -> Any:
        source = await self.application.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="t"))
        return await source.run(run_id)

    async def rule_messages(self, thread_id: str) -> list[MessagePosted]:
        handle = await self.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        return [
            e.event
            for e in await handle.read(threads={thread_id})
            if isinstance(e.event, MessagePosted) and "reflexr" in e.actor.participant
        ]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[World]:
    url = (
        f"sqlite+aiosqlite:///{tmp_path}/relayr.db"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    settings = Settings(home=tmp_path, database_url=url, lease_ttl_s=1.5, turn_grace_s=10)
    storage = await open_storage(settings)
    assert storage.engine is not None
    gate = Gate()
    application = Application(
        artifacts=ArtifactWorkspaces(storage.artifacts, types=[TriageNote]),
        rules=RuleWorkspaces(
            storage.rules,
            events=[DeployFinished, IncidentOpened],
            rules=[DEPLOY_NOTICE, INCIDENT_TRIAGE, HELD],
        ),
        actions={**ACTIONS, "held_notice": held_notice},
        agent=triage_agent(),
        app_deps=gate,
        engines=storage.engines,
    )
    allowlist = load_allowlist(ALLOWLIST)
    runtime = await Runtime.start(
        settings, role="worker", application=application, allowlists=lambda: allowlist
    )
    try:
        yield World(runtime, storage.engine, gate)
    finally:
        await runtime.aclose()


async def _succeeds_once(world: World, run_id: str, thread_id: str, kind: str) -> None:
    run = await world.run(run_id)
    assert (run.status, run.attempts) == ("succeeded", 1), (run.status, run.attempts, run.error)
    [message] = await world.rule_messages(thread_id)
    assert message.kind == kind
    assert await world.runtime.bridge.ledger.cause(KEY, "message", message.message_id)
    [record] = await world.runtime.bridge.ledger.emissions(KEY, run_id)
    assert record.message_id == message.message_id


NOTICE_STEPS = {
    "claim": r"reflexr_runs",
    "notice commit": r"INSERT INTO artifactr_events",
    "completion": r"UPDATE reflexr_runs",
}

SEND_STEPS = {
    "cause before the send": r"INSERT INTO relayr_causes",
    "Runner.send": r"INSERT INTO artifactr_events",
    "completion with the send's record": r"INSERT INTO relayr_emissions",
}


@pytest.mark.parametrize("step", sorted(NOTICE_STEPS))
async def test_a_notice_run_survives_one_fault_at(world: World, step: str) -> None:
    thread = await world.thread()
    run_id = await world.run_of(DeployFinished(service="api", status="ok", thread_id=thread))

    with Injector().attached(world.engine) as injector:
        injector.arm(NOTICE_STEPS[step])
        [executed] = await execute_runs(world.runtime, TENANT, WORKSPACE, [run_id])

    assert (injector.fired, executed.outcome) == (1, "succeeded")
    assert injector.after >= 1
    await _succeeds_once(world, run_id, thread, "notice")


@pytest.mark.parametrize("step", sorted(SEND_STEPS))
async def test_a_send_run_survives_one_fault_at(world: World, step: str) -> None:
    thread = await world.thread()
    run_id = await world.run_of(IncidentOpened(title="db down", thread_id=thread))

    with Injector().attached(world.engine) as injector:
        injector.arm(SEND_STEPS[step])
        [executed] = await execute_runs(world.runtime, TENANT, WORKSPACE, [run_id])

    assert (injector.fired, executed.outcome) == (1, "succeeded")
    await _succeeds_once(world, run_id, thread, "message")
    await _turns_end(world)


async def test_a_turn_that_fails_to_start_is_asked_for_again(world: World) -> None:
    """The send's message commits; the turn's own first write fails once: the turn ends
    without taking the message, and artifactr leaves it to the thread's next command. relayr
    asks again, so the message is still answered, by one turn."""
    thread = await world.thread()
    run_id = await world.run_of(IncidentOpened(title="db down", thread_id=thread))

    with Injector().attached(world.engine) as injector:
        # the first insert of an event is the message; the next one is the turn's
        injector.arm(r"INSERT INTO artifactr_events", skip=1)
        [executed] = await execute_runs(world.runtime, TENANT, WORKSPACE, [run_id])
        await _turns_end(world)

    assert (injector.fired, executed.outcome) == (1, "succeeded")
    handle = await world.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
    log = [e for e in await handle.read(threads={thread})]
    [message] = await world.rule_messages(thread)
    started = [e.event for e in log if e.event.type == "run_started"]
    replies = [e for e in log if isinstance(e.event, MessagePosted) and e.actor.kind == "agent"]
    assert [message.message_id in s.message_ids for s in started] == [True]
    assert len(replies) == 1


async def test_runner_ask_survives_one_fault(world: World) -> None:
    """An earlier attempt committed the message and died before asking: the retry asks."""
    thread = await world.thread()
    content = "Triage incident: disk full"
    run_id = await world.run_of(IncidentOpened(title="disk full", thread_id=thread))
    message_id = IdDeriver(run_id).next(
        "msg", segment=0, operation="post_message", subject=(thread, digest(content))
    )
    rule_actor = ExternalAgentActor(
        client_id=f"reflexr:{INCIDENT_TRIAGE.name}", name=INCIDENT_TRIAGE.name
    )
    died = await world.application.artifacts.open(TENANT, WORKSPACE, actor=rule_actor)
    await died.commit(PostMessage(thread_id=thread, content=content, message_id=message_id))

    with Injector().attached(world.engine) as injector:
        injector.arm(r"artifactr_(cursors|leases)")
        [executed] = await execute_runs(world.runtime, TENANT, WORKSPACE, [run_id])

    assert (injector.fired, executed.outcome) == (1, "succeeded")
    run = await world.run(run_id)
    assert (run.status, run.attempts) == ("succeeded", 1)
    [record] = await world.runtime.bridge.ledger.emissions(KEY, run_id)
    assert record.outcome == "asked"
    await _turns_end(world)
    handle = await world.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
    started = [
        e.event for e in await handle.read(threads={thread}) if e.event.type == "run_started"
    ]
    assert [message_id in s.message_ids for s in started] == [True]


async def test_a_lease_renewal_survives_one_fault(world: World) -> None:
    """The renewal is tried again, so the lease holds and the action is not interrupted."""
    thread = await world.thread()
    held = DeployFinished(service="api", status="held", thread_id=thread)
    run_id = await world.run_of(held, HELD)

    with Injector().attached(world.engine) as injector:
        executing = asyncio.create_task(execute_runs(world.runtime, TENANT, WORKSPACE, [run_id]))
        await asyncio.wait_for(world.gate.entered.wait(), GATE_TIMEOUT_S)
        injector.arm(r"UPDATE reflexr_leases")
        await asyncio.wait_for(injector.tried_again.wait(), GATE_TIMEOUT_S)
        world.gate.opened.set()
        [executed] = await asyncio.wait_for(executing, GATE_TIMEOUT_S)

    assert (injector.fired, executed.outcome) == (1, "succeeded")
    run = await world.run(run_id)
    assert (run.status, run.attempts) == ("succeeded", 1)
    messages = await world.rule_messages(thread)
    assert [m.content for m in messages].count("held notice") == 1


async def _turns_end(world: World) -> None:
    assert await world.runtime.bridge.turns.settled(TURNS_SETTLE_S) == (0, 0)


@pytest.mark.worker
@pytest.mark.redis
async def test_a_publish_that_meets_an_unreachable_broker_is_sent(
    tmp_path: Path, redis_url: str
) -> None:
    """The dispatcher's connection is dropped and its next connection refused, once; the pass
    still hands the run to the queue, and a worker runs it once."""
    environment = relayr_environment(tmp_path, broker_url=redis_url)
    proxy = Proxy(upstream=REDIS_PORT)
    settings = Settings.from_env(
        {**environment, "RELAYR_BROKER_URL": f"redis://127.0.0.1:{proxy.port}/0"}
    )
    runtime = await Runtime.start(settings, role="dispatcher")
    app = create_celery(settings)
    try:
        handle = await runtime.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        thread = (await handle.create_thread("publish")).id
        source = await runtime.application.rules.open(
            TENANT, WORKSPACE, actor=SourceActor(name="t")
        )
        dispatcher = Dispatcher(runtime)

        async def enqueue(batch: RunMessage) -> None:
            send_runs(app, settings.queue, batch)

        await source.publish(DeployFinished(service="warm", status="ok", thread_id=thread))
        assert (await dispatcher.pass_once(enqueue)).enqueued == 1
        proxy.drop(refuse=1)
        await source.publish(DeployFinished(service="api", status="ok", thread_id=thread))
        done = await dispatcher.pass_once(enqueue)
        assert (done.enqueued, done.failed, proxy.refused) == (1, 0, 1)
        with running_worker(environment, tmp_path) as worker:
            async with asyncio.timeout(120):
                while True:
                    if [r.status for r in await source.runs()] == ["succeeded"] * 2:
                        break
                    await asyncio.sleep(0.2)
            assert worker.alive()
        assert [r.attempts for r in await source.runs()] == [1, 1]
        assert len(await world_messages(handle, thread)) == 2
    finally:
        proxy.close()
        app.close()
        await runtime.aclose()
        forget_redis_queue(settings.queue, redis_url)


async def world_messages(handle: Any, thread_id: str) -> list[MessagePosted]:
    return [
        e.event
        for e in await handle.read(threads={thread_id})
        if isinstance(e.event, MessagePosted) and "reflexr" in e.actor.participant
    ]
