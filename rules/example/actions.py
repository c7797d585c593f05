"""The example's actions: post the deploy notice, send the triage message, and answer what the
follower bridges (a follow-up, a page, the scribe's write-up).

Each acts as its rule's own participant through :func:`relayr.execution.actions.acting`, with ids
derived from the run, so a retried attempt writes nothing twice. Only workers import this module.
"""

import json
from typing import Final

from reflexr import Event
from reflexr.workspace import Reaction, RunFailure

from relayr.execution.actions import acting
from relayr.execution.agent_tools import RuleTools
from relayr.follow.events import MessagePosted, TurnEnded
from relayr.runtime.bridge import Bridge
from rules.example.events import DeployFinished, IncidentOpened
from rules.example.scribe import SCRIBE

EXCERPT_CHARS: Final = 80
"""How much of the agent's reply a follow-up or a page quotes."""


async def deploy_notice(reaction: Reaction[Bridge]) -> dict[str, str]:
    """Post "deploy of <service> finished: <status>" as a notice in the deploy's thread."""
    deploy = _fired_by(reaction, DeployFinished)
    message_id = await acting(reaction).notice(
        f"deploy of {deploy.service} finished: {deploy.status}", thread_id=deploy.thread_id
    )
    return {"message_id": message_id}


async def incident_triage(reaction: Reaction[Bridge]) -> dict[str, str]:
    """Send "Triage incident: <title>" in the incident's thread, starting the agent's turn."""
    incident = _fired_by(reaction, IncidentOpened)
    message_id = await acting(reaction).send(
        f"Triage incident: {incident.title}", thread_id=incident.thread_id
    )
    return {"message_id": message_id}


async def agent_replied(reaction: Reaction[Bridge]) -> dict[str, str]:
    """Post "follow-up: the agent answered: <reply>" as a notice in the reply's thread."""
    reply = _fired_by(reaction, MessagePosted)
    message_id = await acting(reaction).notice(
        f"follow-up: the agent answered: {_excerpt(reply.content)}", thread_id=reply.thread_id
    )
    return {"message_id": message_id}


async def page_on_call(reaction: Reaction[Bridge]) -> dict[str, str]:
    """Post "paging @on-call: <message>" as a notice in the message's thread."""
    message = _fired_by(reaction, MessagePosted)
    message_id = await acting(reaction).notice(
        f"paging @on-call for {message.author}: {_excerpt(message.content)}",
        thread_id=message.thread_id,
    )
    return {"message_id": message_id}


async def incident_scribe(reaction: Reaction[Bridge]) -> dict[str, int | str]:
    """Hand a triage turn's end to the scribe agent (:mod:`rules.example.scribe`), which acts
    through the run's tools; return how many tool calls it made."""
    turn = _fired_by(reaction, TurnEnded)
    prompt = json.dumps(
        {"thread_id": turn.thread_id, "turn_id": turn.turn_id, "outcome": turn.outcome}
    )
    result = await SCRIBE.run(prompt, deps=RuleTools.of(reaction))
    return {"tool_calls": result.usage.tool_calls, "answer": result.output}


def _excerpt(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= EXCERPT_CHARS else flat[: EXCERPT_CHARS - 1] + "…"


def _fired_by[E: Event](reaction: Reaction[Bridge], kind: type[E]) -> E:
    """The event that made the rule fire, as ``kind``.

    Raises:
        RunFailure: Permanently (``unexpected_event``) if it is another type: the rule and its
            action disagree, and a retry would too.
    """
    event = reaction.events[-1].event
    if not isinstance(event, kind):
        raise RunFailure(
            f"run {reaction.run_id} fired on {event.event_type}, not {kind.event_type}",
            reason="unexpected_event",
            permanent=True,
        )
    return event


ACTIONS: Final = {
    "deploy_notice": deploy_notice,
    "incident_triage": incident_triage,
    "agent_replied": agent_replied,
    "page_on_call": page_on_call,
    "incident_scribe": incident_scribe,
}
