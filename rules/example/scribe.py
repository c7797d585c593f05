"""The example's agent-driven rule: a scribe whose offline model acts through the run's tools.

When the triage turn of an incident thread ends, rule ``ops:incident-scribe`` hands the turn's end
to an agent whose tools are the run's own writes (:mod:`relayr.execution.agent_tools`): it proposes
a triage note (an artifact of kind ``triage_note``; the allowlist grants the rule no direct writes,
so a person reviews it), then posts a notice that names the proposal. Its model is a function
(pydantic-ai's ``FunctionModel``) that makes those two tool calls and answers, so the example runs
without a network, and the same calls on a retried attempt make the same writes, once. The action
(:func:`rules.example.actions.incident_scribe`) returns how many tool calls the agent made, which
the demo counts.

Only workers import this module (pydantic-ai, artifactr and reflexr).
"""

import json
import re
from typing import Final

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from relayr.execution.agent_tools import RuleCapability, RuleTools
from rules.example.agent import TriageNote

SCRIBE_TOOL_CALLS: Final = 2
"""The tool calls of one scribe run: the triage note's proposal, then the notice."""

_PROPOSAL = re.compile(r"\bprp_[0-9a-f]+\b")


def _prompt(messages: list[ModelMessage]) -> dict[str, str]:
    """The turn's end, as the action put it in the first prompt."""
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                    loaded: dict[str, str] = json.loads(part.content)
                    return loaded
    raise ValueError("the scribe was given no prompt")


def _returns(messages: list[ModelMessage]) -> list[str]:
    """What the tools returned so far, in order."""
    return [
        str(part.content)
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart) and part.outcome == "success"
    ]


async def write_up(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The offline model: propose the note, then name the proposal in a notice, then answer."""
    turn = _prompt(messages)
    returned = _returns(messages)
    if not returned:
        text = (
            f"# Triage of {turn['thread_id']}\n\n"
            f"The agent's triage turn {turn['turn_id']} ended {turn['outcome']}."
        )
        return ModelResponse(
            parts=[
                ToolCallPart(
                    tool_name="create_artifact",
                    args={"kind": TriageNote.kind, "data": {"text": text}},
                )
            ]
        )
    if len(returned) == 1:
        found = _PROPOSAL.search(returned[0])
        named = found.group(0) if found else "a triage note"
        return ModelResponse(
            parts=[
                ToolCallPart(
                    tool_name="post_notice",
                    args={"content": f"scribe: the triage is written up in {named}, for review"},
                )
            ]
        )
    return ModelResponse(parts=[TextPart("the triage is written up")])


SCRIBE: Final = Agent(
    FunctionModel(write_up),
    deps_type=RuleTools,
    capabilities=[RuleCapability(types=[TriageNote])],
    instructions="Write up the triage of the incident thread whose agent turn just ended.",
)
