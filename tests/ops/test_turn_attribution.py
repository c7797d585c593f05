"""Which turn took each message, as ``runs show`` names it: artifactr's own Runner, a turn held
open by a gate, messages that steer it, and another author's message that waits for the next."""

import asyncio
from typing import Any

from artifactr import InMemoryStorage, UserActor, Workspaces
from artifactr.agent import ArtifactWorkspace, Runner, Session, function_model
from artifactr.core import RunStarted
from pydantic_ai import Agent, ModelResponse, TextPart
from pydantic_ai.messages import ModelMessage
from pydantic_ai.models.function import AgentInfo

from relayr.ops.report import TAKEN_CURSOR, who_took
from rules.example.agent import TriageNote

WAIT_S = 30.0


async def test_a_running_turn_takes_its_authors_messages_and_not_anothers() -> None:
    inside, gate = asyncio.Event(), asyncio.Event()

    async def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        inside.set()  # the turn started (its run_started is in the log) and asks the model
        await gate.wait()
        return ModelResponse(parts=[TextPart("on it")])

    agent = Agent(
        function_model(respond),
        deps_type=Session[None],
        capabilities=[ArtifactWorkspace(types=[TriageNote])],
    )
    alice = await Workspaces(InMemoryStorage()).open("t", "w", actor=UserActor(id="alice"))
    bob = alice.as_actor(UserActor(id="bob"))
    thread = (await alice.create_thread()).id
    runner = Runner(agent, app=None)
    try:
        first = await runner.send(alice, thread, "first", message_id="a-1")
        assert first.run is not None

        await asyncio.wait_for(inside.wait(), WAIT_S)  # the turn is running, held by the gate
        await runner.send(alice, thread, "more", message_id="a-2")  # steers it
        await runner.send(bob, thread, "mine", message_id="b-1")  # waits for the next turn
        await runner.send(alice, thread, "again", message_id="a-3")  # after bob's: next too
        gate.set()

        async def settled() -> None:
            await first.run.wait()  # type: ignore[union-attr]
            await runner.drain()
            while (running := runner.running(thread)) is not None:
                await running.wait()
                await runner.drain()

        await asyncio.wait_for(settled(), WAIT_S)
        log = await alice.read(threads={thread})
        taken = await alice.cursor(TAKEN_CURSOR.format(thread=thread))
    finally:
        await runner.aclose()

    took = who_took(log, {thread: taken})
    turns = [e.event.run_id for e in log if isinstance(e.event, RunStarted)]
    assert len(turns) >= 2
    assert took["a-1"] == (turns[0], "started")
    assert took["a-2"] == (turns[0], "steered")
    assert took["b-1"] == (turns[1], "started")
    assert took["a-3"][0] != turns[0]  # bob's message closed the first turn to more
    assert set(took) == {"a-1", "a-2", "b-1", "a-3"}  # the agent's replies are no one's


def test_a_message_past_the_taken_cursor_was_taken_by_no_turn() -> None:
    """The log alone would give a-2 to the running turn; the cursor says the watcher had not
    taken it yet (its process died first), so no turn took it."""
    from artifactr import AgentActor

    alice = UserActor(id="alice")
    agent = AgentActor(thread_id="thr_1", run_id="run_1", on_behalf_of=alice)
    log = _envelopes(
        [
            (alice, "message", "a-1"),
            (agent, "run_started", ("run_1", ("a-1",))),
            (alice, "message", "a-2"),
        ]
    )
    took = who_took(log, {"thr_1": 2})
    assert took == {"a-1": ("run_1", "started")}


def _envelopes(entries: list[tuple[Any, str, Any]]) -> list[Any]:
    from datetime import UTC, datetime

    from artifactr.core import Envelope, MessagePosted

    made = []
    for seq, (actor, kind, detail) in enumerate(entries, start=1):
        if kind == "message":
            event: Any = MessagePosted(thread_id="thr_1", message_id=detail, content="x")
        else:
            run_id, message_ids = detail
            event = RunStarted(thread_id="thr_1", run_id=run_id, message_ids=message_ids)
        made.append(
            Envelope(
                seq=seq,
                id=f"evt_{seq}",
                ts=datetime.now(UTC),
                workspace_id="w",
                actor=actor,
                thread_id="thr_1",
                event=event,
            )
        )
    return made
