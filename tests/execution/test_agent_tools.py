"""A rule's agent acting through tools, on real storage with runs executed in-process.

The agent's model is a script: each event names the tool calls its run's agent makes, one per
model response, then a final answer. What the tests check is what artifactr's log and reflexr's
runs hold afterwards, and what the model was told back (a retry prompt, or a tool's result).
"""

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
from artifactr import MarkdownArtifact, UserActor, WritePolicy
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import MessagePosted, ProposalCreated, create_artifact
from pydantic import JsonValue
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from reflexr import Event, RetryPolicy, Rule, SourceActor, on, run
from reflexr.core import Run
from reflexr.workspace import Reaction
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.run_messages import RunMessage
from relayr.dispatch.dispatcher import DUE_READ_INTERVAL_S, Dispatcher
from relayr.execution.agent_tools import TOOL_RETRIES, RuleCapability, RuleTools
from relayr.execution.executor import execute_runs
from relayr.runtime.application import Application, open_storage
from relayr.runtime.bridge import Bridge
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tests.execution.test_outbound_defects import Down

TENANT, WORKSPACE = "acme", "ops"
RETRY_WAIT_S = 0.05
"""Longer than the rule's retry backoff: the next pass finds a failed run due again."""
RULE = "tools:scribe"
AUTHOR = f"external_agent:reflexr:{RULE}"


class ToolsTestEvent(Event, abstract=True, event_namespace="toolstest"):
    pass


class Scripted(ToolsTestEvent, name="scripted"):
    """Makes the rule's agent call ``calls`` (each ``[tool, args]``), one per response."""

    thread_id: str
    calls: list[tuple[str, dict[str, JsonValue]]]
    fail_first_attempt: bool = False


class ToolsNote(MarkdownArtifact):
    """The kind the agent may create: as proposals."""


class ToolsRecord(MarkdownArtifact):
    """A kind the rule writes directly (the allowlist's ``direct``)."""


class ToolsPlan(MarkdownArtifact):
    """A kind the allowlist makes ``direct`` whose write policy makes agents propose."""

    write_policy: ClassVar[WritePolicy] = "propose"


async def _script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Call the event's tools in turn (the script rides in the prompt), then answer."""
    first = messages[0]
    assert isinstance(first, ModelRequest)
    prompt = next(part.content for part in first.parts if part.part_kind == "user-prompt")
    calls = Scripted.model_validate_json(str(prompt)).calls
    made = sum(
        isinstance(part, ToolCallPart)
        for message in messages
        if isinstance(message, ModelResponse)
        for part in message.parts
    )
    if made < len(calls):
        tool, args = calls[made]
        return ModelResponse(parts=[ToolCallPart(tool_name=tool, args=args)])
    return ModelResponse(parts=[TextPart("done")])


AGENT = Agent(
    FunctionModel(_script),
    deps_type=RuleTools,
    capabilities=[RuleCapability(types=[ToolsNote, ToolsPlan])],
)


def _told(messages: list[ModelMessage]) -> list[str]:
    """What the tools told the model, in order: ``ok: <result>`` or ``retry: <prompt>``."""
    told = []
    for message in messages:
        for part in message.parts if isinstance(message, ModelRequest) else ():
            if isinstance(part, ToolReturnPart):
                told.append(f"{'retry' if part.outcome == 'retried' else 'ok'}: {part.content}")
    return told


async def scribe(reaction: Reaction[Bridge]) -> dict[str, Any]:
    event = reaction.events[-1].event
    assert isinstance(event, Scripted)
    result = await AGENT.run(event.model_dump_json(), deps=RuleTools.of(reaction))
    if event.fail_first_attempt and reaction.attempt == 1:
        raise RuntimeError("the attempt died after its agent's writes")
    return {"tool_calls": result.usage.tool_calls, "told": _told(result.all_messages())}


RULES = [
    Rule(
        name=RULE,
        when=on(Scripted),
        then=run("scribe"),
        ordering="none",
        start="beginning",
        retry=RetryPolicy(max_attempts=3, backoff=timedelta(milliseconds=10)),
    )
]

ALLOWLIST = f"""
[rules."{RULE}"]
threads = "chain"
direct = ["tools_record", "tools_plan"]
"""

FORBIDDEN_ACTION = "artifactr:archive_artifact"
"""What the artifactr workspaces refuse every rule (a direct archive; a proposed one is another
action): a refusal no retry prompt can fix."""


async def _authorize(tenant: str, workspace: str | None, actor: Any, access: Any) -> bool:
    return not (actor.kind == "external_agent" and access.action == FORBIDDEN_ACTION)


def stepping() -> Callable[[], float]:
    """A dispatcher's clock that moves a due-list interval at each reading, so every pass
    reads the due list and finds a run whose retry came due."""
    now = [0.0]

    def clock() -> float:
        now[0] += DUE_READ_INTERVAL_S
        return now[0]

    return clock


class Harness:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

        async def empty() -> int:
            return 0

        self.dispatcher = Dispatcher(runtime, queue_depth=empty, monotonic=stepping())
        self.person = UserActor(id="alice")

    async def artifacts(self) -> Any:
        return await self.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=self.person)

    async def thread(self) -> str:
        return (await (await self.artifacts()).create_thread("incident")).id

    async def script(self, thread: str, *calls: tuple[str, dict[str, Any]], **flags: Any) -> Run:
        """Publish a script, run it to the end (retries included); its run."""
        rules = await self.runtime.application.rules.open(
            TENANT, WORKSPACE, actor=SourceActor(name="test")
        )
        published = await rules.publish(Scripted(thread_id=thread, calls=list(calls), **flags))
        queue: list[RunMessage] = []

        async def enqueue(batch: RunMessage) -> None:
            queue.append(batch)

        for _ in range(10):
            queue.clear()
            await self.dispatcher.pass_once(enqueue)
            for batch in queue:
                await execute_runs(self.runtime, TENANT, WORKSPACE, list(batch.run_ids))
            [found] = [r for r in await rules.runs() if published.envelope.seq in r.matched]
            if found.status in ("succeeded", "dead"):
                return found
            await asyncio.sleep(RETRY_WAIT_S)
        raise AssertionError(f"run {found.id} did not end: {found.status}")

    async def written(self) -> list[tuple[str, str, str]]:
        """What the rule wrote in artifactr: (type, kind or change, content or artifact)."""
        found = []
        for envelope in await (await self.artifacts()).read():
            event = envelope.event
            if envelope.actor.participant != AUTHOR:
                continue
            if isinstance(event, MessagePosted):
                found.append(("message_posted", event.kind, event.content))
            elif isinstance(event, ProposalCreated):
                found.append(("proposal_created", event.change.type, event.change.artifact_id))
            else:
                found.append((event.type, "", ""))
        return found


@pytest.fixture(params=["memory", "sqlite"])
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    url = "memory://" if request.param == "memory" else f"sqlite+aiosqlite:///{tmp_path}/t.db"
    settings = Settings(home=tmp_path, database_url=url, turn_grace_s=0)
    storage = await open_storage(settings)
    application = Application(
        artifacts=ArtifactWorkspaces(
            storage.artifacts, types=[ToolsNote, ToolsRecord, ToolsPlan], authorize=_authorize
        ),
        rules=RuleWorkspaces(storage.rules, events=[Scripted], rules=RULES),
        actions={"scribe": scribe},
        engines=storage.engines,
    )
    allowlists = parse_allowlist(ALLOWLIST)
    runtime = await Runtime.start(
        settings, role="worker", application=application, allowlists=lambda: allowlists
    )
    try:
        yield Harness(runtime)
    finally:
        await runtime.aclose()


async def test_each_tool_writes_as_the_rule(harness: Harness) -> None:
    thread = await harness.thread()
    handle = await harness.artifacts()
    await handle.commit(create_artifact(ToolsNote(text="# runbook"), artifact_id="art_runbook"))

    done = await harness.script(
        thread,
        ("post_notice", {"content": "looking into it"}),
        ("post_message", {"content": "anyone on it?"}),
        ("read_artifact", {"artifact_id": "art_runbook"}),
        ("create_artifact", {"kind": "tools_note", "data": {"text": "# triage"}}),
        ("edit_artifact", {"artifact_id": "art_runbook", "path": "/text", "value": "# v2"}),
    )

    assert done.status == "succeeded", done.error
    assert done.output["tool_calls"] == 5  # type: ignore[index]
    told = done.output["told"]  # type: ignore[index]
    assert told[0].startswith("ok: posted notice msg_")
    assert told[1].startswith("ok: posted message msg_")
    assert "art_runbook (tools_note, v1)" in told[2]
    assert "# runbook" in told[2]
    assert told[3].startswith("ok: proposed: proposal prp_")
    assert told[4].startswith("ok: proposed: proposal prp_")
    written = await harness.written()
    assert written[:2] == [
        ("message_posted", "notice", "looking into it"),
        ("message_posted", "notice", "anyone on it?"),  # no turns granted: post is a notice
    ]
    assert [w[1] for w in written[2:]] == ["create_artifact", "edit_artifact"]


async def test_what_the_allowlist_refuses_goes_back_to_the_model(harness: Harness) -> None:
    thread = await harness.thread()
    elsewhere = await harness.thread()

    done = await harness.script(
        thread,
        ("create_thread", {"title": "war room"}),
        ("post_notice", {"content": "over there", "thread_id": elsewhere}),
        ("post_notice", {"content": "here then"}),
    )

    assert done.status == "succeeded"
    told = done.output["told"]  # type: ignore[index]
    assert told[0].startswith("retry: refused (not_allowed): rule tools:scribe may not create")
    assert told[1].startswith("retry: refused (not_allowed):")
    assert told[2].startswith("ok: posted notice")
    assert await harness.written() == [("message_posted", "notice", "here then")]


async def test_what_artifactr_refuses_as_invalid_goes_back_to_the_model(
    harness: Harness,
) -> None:
    thread = await harness.thread()

    done = await harness.script(
        thread,
        ("create_artifact", {"kind": "tools_note", "data": {"title": "no text"}}),
        ("create_artifact", {"kind": "plan", "data": {"text": "x"}}),
        ("read_artifact", {"artifact_id": "art_missing"}),
        ("edit_artifact", {"artifact_id": "art_missing", "path": "/text", "value": "x"}),
        ("post_notice", {"content": "   "}),
        ("post_notice", {"content": "fine"}),
    )

    assert done.status == "succeeded"
    told = done.output["told"]  # type: ignore[index]
    assert [line.split(":")[0] for line in told] == ["retry"] * 5 + ["ok"]
    assert "(validation_failed)" in told[0]
    assert "no artifact kind 'plan'" in told[1]
    assert "(not_found)" in told[2]
    assert "(not_found)" in told[3]
    assert "(empty_content)" in told[4]


async def test_any_other_refusal_fails_the_run(harness: Harness) -> None:
    thread = await harness.thread()
    handle = await harness.artifacts()
    await handle.commit(create_artifact(ToolsRecord(text="# old"), artifact_id="art_old"))

    done = await harness.script(thread, ("archive_artifact", {"artifact_id": "art_old"}))

    assert (done.status, done.reason) == ("dead", "forbidden")
    assert done.attempts == 1


async def test_a_model_that_keeps_asking_for_a_refused_write_fails_the_run(
    harness: Harness,
) -> None:
    thread = await harness.thread()

    done = await harness.script(
        thread, *[("create_thread", {"title": "again"})] * (TOOL_RETRIES + 1)
    )

    assert done.status != "succeeded"
    assert "create_thread" in (done.error or "")


async def test_a_retried_attempt_makes_its_agent_writes_once(harness: Harness) -> None:
    thread = await harness.thread()

    done = await harness.script(
        thread,
        ("post_notice", {"content": "looking into it"}),
        ("create_artifact", {"kind": "tools_note", "data": {"text": "# triage"}}),
        fail_first_attempt=True,
    )

    assert (done.status, done.attempts) == ("succeeded", 2)
    written = await harness.written()
    assert [w[:2] for w in written] == [
        ("message_posted", "notice"),
        ("proposal_created", "create_artifact"),
    ]


async def test_a_direct_write_that_artifactr_proposes_is_told_as_a_proposal(
    harness: Harness,
) -> None:
    thread = await harness.thread()

    done = await harness.script(
        thread,
        ("create_artifact", {"kind": "tools_plan", "data": {"text": "# plan"}}),
        ("create_artifact", {"kind": "tools_plan", "data": {"text": "# plan"}}),
    )

    assert done.status == "succeeded", done.error
    told = done.output["told"]  # type: ignore[index]
    assert told[0].startswith("ok: proposed: proposal prp_"), told[0]
    assert told[1].startswith("ok: proposed: proposal prp_"), told[1]
    handle = await harness.artifacts()
    assert sorted(p.id for p in await handle.proposals()) == sorted(
        line.split()[3].rstrip(",") for line in told
    )
    assert await handle.artifacts(ToolsPlan) == []


@pytest.mark.parametrize("harness", ["sqlite"], indirect=True)
async def test_a_read_whose_storage_stays_down_fails_the_run_as_storage_unavailable(
    harness: Harness,
) -> None:
    engines = harness.runtime.application.engines
    thread = await harness.thread()
    handle = await harness.artifacts()
    await handle.commit(create_artifact(ToolsNote(text="# runbook"), artifact_id="art_runbook"))

    with Down("FROM artifactr_artifacts").on(engines[0]) as down:
        done = await harness.script(thread, ("read_artifact", {"artifact_id": "art_runbook"}))

    assert down.failed >= 3  # relayr read again before it gave up
    assert (done.status, done.reason) == ("dead", "storage_unavailable")
    assert "reading artifact art_runbook" in (done.error or "")
