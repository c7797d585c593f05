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

Three rules answer what the follower bridges from artifactr into reflexr (:mod:`relayr.follow`),
in the chain of the run that caused it, so a loop of them would stop at reflexr's depth limit:

- ``ops:agent-replied``: on ``artifactr:message_posted`` by ``agent:*`` of kind ``message`` (the
  agent's reply in an incident thread: only the triage rule starts turns), a notice
  "follow-up: the agent answered: ...";
- ``ops:page-on-call``: on a ``message_posted`` that is not a notice and says ``@on-call`` (the
  agent's reply does), a notice "paging @on-call ...". It leaves notices out by their kind: its
  own page says ``@on-call`` too;
- ``ops:incident-scribe``: on ``artifactr:turn_ended`` (completed), an agent-driven rule
  (:mod:`rules.example.scribe`): an offline model that acts through the run's tools
  (:mod:`relayr.execution.agent_tools`) proposes a triage note, then posts a notice naming the
  proposal.

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

Layout: :mod:`rules.example.events` (the event types), :mod:`rules.example.rules`,
:mod:`rules.example.agent` (the agent and its artifact kind), :mod:`rules.example.scribe` (the
scribe agent) and :mod:`rules.example.actions`.
This module holds only the factories, and imports each piece where a factory needs it, so that
a command loads only the library it uses (ADR-0050): ``relayr publish`` builds
:func:`create_rules` (reflexr only), ``relayr thread`` :func:`create_artifacts` (artifactr
only), and a worker the whole :func:`create_app`. The pieces' names are also this module's
(``from rules.example import RULES``), imported when first asked for.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any, Final, Literal

from relayr.runtime.application import Application, open_storage
from relayr.runtime.application_parts import (
    ArtifactsPart,
    RulesPart,
    open_artifact_storage,
    open_rule_storage,
    with_parts,
)
from relayr.settings import Settings

if TYPE_CHECKING:
    from artifactr import Workspaces as ArtifactWorkspaces
    from artifactr.workspace.storage import Storage as ArtifactStorage
    from reflexr.workspace import Storage as RuleStorage
    from reflexr.workspace import Workspaces as RuleWorkspaces

    from rules.example.actions import (
        ACTIONS,
        agent_replied,
        deploy_notice,
        incident_scribe,
        incident_triage,
        page_on_call,
    )
    from rules.example.agent import REPLY, TriageNote, triage_agent
    from rules.example.events import (
        EVENTS,
        DeployEvent,
        DeployFinished,
        IncidentEvent,
        IncidentOpened,
    )
    from rules.example.rules import (
        ACTION_TIMEOUT,
        AGENT_REPLIED,
        DEPLOY_NOTICE,
        INBOUND_RULES,
        INCIDENT_SCRIBE,
        INCIDENT_TRIAGE,
        ON_CALL,
        PAGE_ON_CALL,
        RETRY,
        RULES,
    )
    from rules.example.scribe import SCRIBE, SCRIBE_TOOL_CALLS

__all__ = [
    "ACTIONS",
    "ACTION_TIMEOUT",
    "AGENT_REPLIED",
    "DEPLOY_NOTICE",
    "EVENTS",
    "INBOUND_RULES",
    "INCIDENT_SCRIBE",
    "INCIDENT_TRIAGE",
    "ON_CALL",
    "PAGE_ON_CALL",
    "REPLY",
    "RETRY",
    "RULES",
    "SCRIBE",
    "SCRIBE_TOOL_CALLS",
    "DeployEvent",
    "DeployFinished",
    "IncidentEvent",
    "IncidentOpened",
    "TriageNote",
    "agent_replied",
    "artifact_workspaces",
    "build_app",
    "create_app",
    "create_artifacts",
    "create_rules",
    "deploy_notice",
    "incident_scribe",
    "incident_triage",
    "page_on_call",
    "rule_workspaces",
    "triage_agent",
]

PIECES: Final = {
    "rules.example.events": (
        "EVENTS",
        "DeployEvent",
        "DeployFinished",
        "IncidentEvent",
        "IncidentOpened",
    ),
    "rules.example.rules": (
        "ACTION_TIMEOUT",
        "AGENT_REPLIED",
        "DEPLOY_NOTICE",
        "INBOUND_RULES",
        "INCIDENT_SCRIBE",
        "INCIDENT_TRIAGE",
        "ON_CALL",
        "PAGE_ON_CALL",
        "RETRY",
        "RULES",
    ),
    "rules.example.agent": ("REPLY", "TriageNote", "triage_agent"),
    "rules.example.scribe": ("SCRIBE", "SCRIBE_TOOL_CALLS"),
    "rules.example.actions": (
        "ACTIONS",
        "agent_replied",
        "deploy_notice",
        "incident_scribe",
        "incident_triage",
        "page_on_call",
    ),
}
"""Which module holds each piece this module names."""

_HOME: Final = {name: module for module, names in PIECES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A piece of the example, imported from its module when first asked for."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module), name)


def rule_workspaces(
    storage: "RuleStorage", *, ordering: Literal["scope", "none"] | None = None
) -> "RuleWorkspaces":
    """reflexr's workspaces of the example on ``storage``: its events, the bridged ones (their
    namespace reserved to the follower), and its rules, outbound and inbound.

    ``ordering`` replaces every rule's own (``none``) when given: the benchmarks compare the
    example as it ships with the same application ordered by scope, reflexr's default.
    """
    from reflexr.workspace import Workspaces

    from relayr.follow.events import BRIDGED_EVENTS, PUBLISHERS
    from rules.example.events import EVENTS
    from rules.example.rules import INBOUND_RULES, RULES

    rules = [*RULES, *INBOUND_RULES]
    if ordering is not None:
        rules = [rule.model_copy(update={"ordering": ordering}) for rule in rules]
    return Workspaces(
        storage,
        events=[*EVENTS, *BRIDGED_EVENTS],
        publishers=PUBLISHERS,
        rules=rules,
    )


def artifact_workspaces(storage: "ArtifactStorage") -> "ArtifactWorkspaces":
    """artifactr's workspaces of the example on ``storage``: its agent's artifact kind."""
    from artifactr import Workspaces

    from rules.example.agent import TriageNote

    return Workspaces(storage, types=[TriageNote])


async def create_rules(settings: Settings) -> RulesPart:
    """The example's rules part (:mod:`relayr.runtime.application_parts`): for publishing, and
    for ops on runs."""
    storage = await open_rule_storage(settings)
    return RulesPart(rule_workspaces(storage.storage), storage.engines)


async def create_artifacts(settings: Settings) -> ArtifactsPart:
    """The example's artifacts part (:mod:`relayr.runtime.application_parts`): for creating and
    reading threads."""
    storage = await open_artifact_storage(settings)
    return ArtifactsPart(artifact_workspaces(storage.storage), storage.engines)


async def build_app(
    settings: Settings,
    *,
    reply_delay_s: float = 0.0,
    ordering: Literal["scope", "none"] | None = None,
) -> Application:
    """The example application on ``settings.database_url``, with a slower agent if asked.

    Tests of shutdown use ``reply_delay_s`` to keep turns running; the benchmarks use
    ``ordering`` (:func:`rule_workspaces`); ``create_app`` is this with the defaults.
    """
    from rules.example.actions import ACTIONS
    from rules.example.agent import triage_agent

    storage = await open_storage(settings)
    return Application(
        artifacts=artifact_workspaces(storage.artifacts),
        rules=rule_workspaces(storage.rules, ordering=ordering),
        actions=ACTIONS,
        agent=triage_agent(reply_delay_s),
        engines=storage.engines,
    )


@with_parts(rules=create_rules, artifacts=create_artifacts)
async def create_app(settings: Settings) -> Application:
    """The ``RELAYR_APP`` factory: ``rules.example:create_app``."""
    return await build_app(settings)
