"""A notice resumes no paused agent run: neither a rule's nor a person's (``relayr thread post``).

A real Runner's turn pauses on the agent's ``ask_user`` (a deferred question). A rule's notice
(``RunActions.notice``) and a person's (``relayr thread post --notice``, the command a person
types, in its own process on the same SQLite file) leave it paused, and ``Runner.ask`` finds
nothing to take; a person's message then answers the question and resumes it, so the test sees
a resumption when there is one.
"""

import asyncio
from pathlib import Path
from typing import Any

import pytest
from artifactr import MarkdownArtifact
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.agent import ArtifactWorkspace, Runner, Session, function_model
from artifactr.core import MessagePosted, RunStarted
from artifactr.sql import SqlStorage, create_sqlite_engine, migrate
from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo

from relayr.execution.actions import acting
from relayr.runtime.bridge import Bridge
from tests.execution.test_actions import NOW, TENANT, WORKSPACE, Harness
from tests.workers import relayr_environment, relayr_output

pytestmark = pytest.mark.process

WHERE = f"{TENANT}/{WORKSPACE}"


class PausedNote(MarkdownArtifact):
    pass


def _respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Ask which host, once; thank whoever answered."""
    answered = any(
        isinstance(part, ToolReturnPart)
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
    )
    if answered:
        return ModelResponse(parts=[TextPart("thanks, restarting it")])
    return ModelResponse(parts=[ToolCallPart("ask_user", {"question": "which host?"})])


ASKING = Agent(
    function_model(_respond),
    deps_type=Session[None],
    output_type=[str, DeferredToolRequests],
    capabilities=[ArtifactWorkspace(types=[PausedNote], ask=True)],
)


def post_notice(environment: dict[str, str], thread: str, content: str) -> str:
    done = relayr_output(environment, "thread", "post", WHERE, thread, content, "--notice")
    return done.stdout.strip()


async def test_a_rules_notice_and_a_persons_resume_no_paused_run(tmp_path: Path) -> None:
    engine = create_sqlite_engine(f"sqlite+aiosqlite:///{tmp_path / 'relayr.db'}")
    await migrate(engine)
    harness = Harness(ArtifactWorkspaces(SqlStorage(engine)))
    await harness.runner.aclose()
    runner: Runner[None] = Runner(ASKING, app=None)
    harness.runner = runner
    harness.bridge = Bridge(
        artifacts=harness.artifacts,
        ledger=harness.ledger,
        allowlists=lambda: harness.allowlists,
        runner=runner,
        clock=lambda: NOW,
    )
    try:
        thread = await harness.thread()
        person = await harness.artifacts.open(TENANT, WORKSPACE, actor=harness.user)
        sent = await runner.send(person, thread, "restart the database")
        assert sent.run is not None
        await sent.run.wait()
        [paused] = await person.runs(thread_id=thread)
        assert paused.status == "paused"

        await acting(await harness.reaction("ops:notify", thread)).notice("db-2 is degraded")
        # in a thread: this process's loop goes on meanwhile, so no task of it holds the file
        environment = relayr_environment(tmp_path)
        person_notice = await asyncio.to_thread(post_notice, environment, thread, "on-call: alice")
        assert await runner.ask(person, thread) is None
        await runner.drain()

        assert [(run.id, run.status) for run in await person.runs(thread_id=thread)] == [
            (paused.id, "paused")
        ]
        envelopes = await person.read(threads={thread})
        assert [e.event.type for e in envelopes].count("run_started") == 1
        notices = [
            e.event
            for e in envelopes
            if isinstance(e.event, MessagePosted) and e.event.kind == "notice"
        ]
        assert [n.content for n in notices] == ["db-2 is degraded", "on-call: alice"]
        assert notices[1].message_id == person_notice

        answer = await runner.send(person, thread, "db-2", message_id="msg-answer")
        assert answer.run is not None  # a message does resume it
        await answer.run.wait()
        await runner.drain()
        runs: list[Any] = await person.runs(thread_id=thread)
        assert [(run.id, run.status) for run in runs] == [(paused.id, "completed")]
        events = [e.event for e in await person.read(threads={thread})]
        resumed = [e.message_ids for e in events if isinstance(e, RunStarted)]
        assert resumed[1:] == [("msg-answer",)]
    finally:
        await runner.aclose()
        await engine.dispose()


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["thr_x", "hello"], "only a notice can be posted"),
        (["thr_x", " ", "--notice"], "CONTENT is empty"),
        (["thr_nope", "hello", "--notice"], "thread thr_nope does not exist"),
    ],
)
def test_thread_post_refuses_bad_input_with_exit_2(
    tmp_path: Path, args: list[str], problem: str
) -> None:
    done = relayr_output(relayr_environment(tmp_path), "thread", "post", WHERE, *args, check=False)
    assert done.returncode == 2, done.stderr
    assert problem in done.stderr
