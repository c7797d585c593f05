"""The agent's turns across a worker's life: at start, a worker takes the turns asked for and
never taken; at shutdown, running turns finish within the grace, those that outlive it are
stopped, and those still asked for are named. With the example application on real SQLite and
PostgreSQL, its agent's reply held by the test where a turn must still run.
"""

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from artifactr import Runner
from artifactr.agent import ArtifactWorkspace, RunHandle, Session, function_model
from artifactr.core import RunEnded
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo
from reflexr import SourceActor
from structlog.testing import capture_logs

from relayr.observe import hooks
from relayr.observe.hooks import Fact, TurnStarted
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from rules.example import REPLY, DeployFinished, IncidentOpened, TriageNote, build_app, triage_agent
from tests.example_runtime import ALICE, TENANT, WORKSPACE, Example, settings_for
from tests.services import SQL_STORAGES, STORAGES, storage_url


@pytest.fixture(params=STORAGES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return storage_url(request, tmp_path)


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


async def turns_ended(settings: Settings, thread: str) -> list[str]:
    """How each turn in ``thread`` ended, read from the stores after the runtime closed."""
    check = await build_app(settings)
    try:
        handle = await check.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        return [
            e.event.status
            for e in await handle.read(threads={thread})
            if isinstance(e.event, RunEnded)
        ]
    finally:
        await check.aclose()


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

    assert await turns_ended(settings, thread) == ["completed"]


def relay_agent(
    replying: list[asyncio.Event], reply: list[asyncio.Event]
) -> Agent[Session[None], str]:
    """The example's agent, whose ``n``-th reply sets ``replying[n]``, then waits for
    ``reply[n]``."""
    calls = 0

    async def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        nonlocal calls
        call, calls = calls, calls + 1
        replying[call].set()
        await reply[call].wait()
        return ModelResponse(parts=[TextPart(REPLY)])

    return Agent(
        function_model(respond),
        deps_type=Session[None],
        capabilities=[ArtifactWorkspace(types=[TriageNote])],
    )


@pytest.fixture
def facts() -> Iterator[list[Fact]]:
    """What the path emits during the test (:mod:`relayr.observe.hooks`)."""
    seen: list[Fact] = []
    unsubscribe = hooks.subscribe(seen.append)
    yield seen
    unsubscribe()


async def test_shutdown_waits_for_the_turn_a_finished_turn_handed_its_thread_to(
    tmp_path: Path, facts: list[Fact]
) -> None:
    """A message sent while the rule's turn replies is left to the thread's next turn, which
    artifactr's Runner starts itself as the first ends (its hand-over). The grace waits for it,
    although it began before the shutdown and after the turn the worker started had ended. It
    is not a turn the run started: the count of those stays at one."""
    settings = settings_for(f"sqlite+aiosqlite:///{tmp_path}/relayr.db", tmp_path, turn_grace_s=60)
    replying, reply = [asyncio.Event(), asyncio.Event()], [asyncio.Event(), asyncio.Event()]
    application = dataclasses.replace(await build_app(settings), agent=relay_agent(replying, reply))
    runtime = await Runtime.start(settings, role="worker", application=application)
    runner = runtime.bridge.runner
    assert runner is not None
    example = Example(runtime)
    thread = await example.thread("incident")
    await example.publish(IncidentOpened(title="slow", thread_id=thread))
    [executed] = await example.work()
    assert executed.outcome == "succeeded"
    await asyncio.wait_for(replying[0].wait(), 30)
    person = await runtime.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
    assert (await runner.send(person, thread, "and the queue?")).run is None  # left to the next
    reply[0].set()
    await asyncio.wait_for(replying[1].wait(), 30)  # the Runner's own turn, handed the thread

    closing = asyncio.create_task(runtime.aclose())
    await asyncio.sleep(0)  # aclose runs up to its first wait: the grace, for that turn
    assert not closing.done()
    reply[1].set()
    await asyncio.wait_for(closing, 30)

    assert await turns_ended(settings, thread) == ["completed", "completed"]
    assert sum(isinstance(fact, TurnStarted) for fact in facts) == 1


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

    assert await turns_ended(settings, thread) == ["stopped"]


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
        runtime.bridge.turns.started(handle, ask_again=again)
        await asyncio.wait_for(asked.wait(), 30)

        with capture_logs() as logs:
            await asyncio.wait_for(runtime.aclose(), 30)
    finally:
        answer.set()
        await asyncio.gather(*runtime.bridge.turns.asking)
        await runtime.aclose()

    [warned] = [e for e in logs if e["event"] == "turns still running after the grace period"]
    assert (warned["turns"], warned["asking"]) == (0, 1)
