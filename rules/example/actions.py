"""The example's actions: post the deploy notice, send the triage message.

Each acts as its rule's own participant through :func:`relayr.actions.acting`, with ids derived
from the run, so a retried attempt writes nothing twice. Only workers import this module.
"""

from typing import Final

from reflexr import Event
from reflexr.workspace import Reaction, RunFailure

from relayr.actions import acting
from relayr.bridge import Bridge
from rules.example.events import DeployFinished, IncidentOpened


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


ACTIONS: Final = {"deploy_notice": deploy_notice, "incident_triage": incident_triage}
