"""The example's agent: an offline triage agent, and the artifact kind it may write.

Its model is a function (``artifactr.agent.function_model``) that replies with a fixed triage
plan, so the example and its tests run without a network. Only workers and the commands that
read threads import this module (artifactr and pydantic-ai).
"""

import asyncio
from typing import Final

from artifactr import MarkdownArtifact
from artifactr.agent import ArtifactWorkspace, Session, function_model
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo


class TriageNote(MarkdownArtifact):
    """A note the triage agent may write (artifact kind ``triage_note``)."""


REPLY: Final = (
    "Triage plan: check the deploys of the last hour, the error rate of the affected service, "
    "and recent config changes; @on-call, watch the error rate. I will post what I find here."
)


def triage_agent(reply_delay_s: float = 0.0) -> Agent[Session[None], str]:
    """The offline agent: it answers every turn with :data:`REPLY`, after ``reply_delay_s``."""

    async def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if reply_delay_s:
            await asyncio.sleep(reply_delay_s)
        return ModelResponse(parts=[TextPart(REPLY)])

    return Agent(
        function_model(respond),
        deps_type=Session[None],
        capabilities=[ArtifactWorkspace(types=[TriageNote])],
    )
