"""The example application: deploy notices, and incident triage by an offline agent.

Two event types, published by whatever watches deploys and incidents:

- ``deploy:finished`` (``service``, ``status``, ``thread_id``): rule ``ops:deploy-notice`` posts a
  notice "deploy of <service> finished: <status>" in that thread. Notices are for people: they
  never wake the agent.
- ``incident:opened`` (``title``, ``thread_id``): rule ``ops:incident-triage`` sends
  "Triage incident: <title>" in that thread, which starts a turn of the thread's agent. Only
  because ``rules/allowlist.toml`` grants this rule ``turns``; without the grant the send fails
  ``not_allowed`` and writes nothing.

The agent answers without a network: its model is a function (``artifactr.agent.function_model``)
that replies with a fixed triage plan, so the example and its tests run anywhere.

Decisions:

- ``start="beginning"``: reflexr's default (``"now"``) starts a rule at the log's head when it is
  first evaluated, so events published into a workspace before its first evaluation would be
  skipped. The example's workspaces are created by their first event, and that event must fire.
- ``ordering="none"``: each run writes in its own event's thread under ids derived from the run,
  so runs need no order among themselves. ``ordering="scope"`` with no scope would put every run
  of a rule in a workspace into one queue, one run at a time, and a burst of 200 deploys would
  take 200 round trips through the queue. Triage turns in one thread are serialised by artifactr
  itself (one turn per thread at a time), which is the only order that matters there.
- A short retry backoff (0.2 s, doubling up to 5 s, five attempts): a transient fault, such as
  a thread another holder has claimed, clears fast, and tests settle fast.
"""

import asyncio
from datetime import timedelta
from typing import Final

from artifactr import MarkdownArtifact
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.agent import ArtifactWorkspace, Session, function_model
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo
from reflexr import Event, RetryPolicy, Rule, on, run
from reflexr.workspace import Reaction, RunFailure
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.actions import acting
from relayr.application import Application, open_storage
from relayr.bridge import Bridge
from relayr.settings import Settings


class DeployEvent(Event, abstract=True, event_namespace="deploy"):
    """Events about deploys."""


class DeployFinished(DeployEvent, name="finished"):
    """``deploy:finished``: a deploy of a service ended, with its status."""

    service: str
    status: str
    thread_id: str


class IncidentEvent(Event, abstract=True, event_namespace="incident"):
    """Events about incidents."""


class IncidentOpened(IncidentEvent, name="opened"):
    """``incident:opened``: someone opened an incident, discussed in a thread."""

    title: str
    thread_id: str


class TriageNote(MarkdownArtifact):
    """A note the triage agent may write (artifact kind ``triage_note``)."""


RETRY: Final = RetryPolicy(
    max_attempts=5,
    backoff=timedelta(milliseconds=200),
    multiplier=2.0,
    max_backoff=timedelta(seconds=5),
)

ACTION_TIMEOUT: Final = timedelta(seconds=60)
"""Long enough for a send, which commits and asks but does not wait for the turn."""

DEPLOY_NOTICE: Final = Rule(
    name="ops:deploy-notice",
    when=on(DeployFinished),
    then=run("deploy_notice"),
    ordering="none",
    start="beginning",
    retry=RETRY,
    timeout=ACTION_TIMEOUT,
    description="Post a notice in the deploy's thread when a deploy finishes.",
)

INCIDENT_TRIAGE: Final = Rule(
    name="ops:incident-triage",
    when=on(IncidentOpened),
    then=run("incident_triage"),
    ordering="none",
    start="beginning",
    retry=RETRY,
    timeout=ACTION_TIMEOUT,
    description="Ask the thread's agent to triage a new incident.",
)

RULES: Final = (DEPLOY_NOTICE, INCIDENT_TRIAGE)

REPLY: Final = (
    "Triage plan: check the deploys of the last hour, the error rate of the affected service, "
    "and recent config changes; I will post what I find here."
)


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


async def build_app(settings: Settings, *, reply_delay_s: float = 0.0) -> Application:
    """The example application on ``settings.database_url``, with a slower agent if asked.

    Tests of shutdown use ``reply_delay_s`` to keep turns running; ``create_app`` is this with
    the defaults.
    """
    storage = await open_storage(settings)
    return Application(
        artifacts=ArtifactWorkspaces(storage.artifacts, types=[TriageNote]),
        rules=RuleWorkspaces(storage.rules, events=[DeployFinished, IncidentOpened], rules=RULES),
        actions=ACTIONS,
        agent=triage_agent(reply_delay_s),
        engines=storage.engines,
    )


async def create_app(settings: Settings) -> Application:
    """The ``RELAYR_APP`` factory: ``rules.example:create_app``."""
    return await build_app(settings)
