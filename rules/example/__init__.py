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

Layout: :mod:`rules.example.events` (the event types), :mod:`rules.example.rules`,
:mod:`rules.example.agent` (the agent and its artifact kind) and :mod:`rules.example.actions`.
This module holds only the factories, and imports each piece where a factory needs it, so that
a command loads only the library it uses (ADR-0050): ``relayr publish`` builds
:func:`create_rules` (reflexr only), ``relayr thread`` :func:`create_artifacts` (artifactr
only), and a worker the whole :func:`create_app`. The pieces' names are also this module's
(``from rules.example import RULES``), imported when first asked for.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any, Final

from relayr.application import Application, open_storage
from relayr.parts import (
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

    from rules.example.actions import ACTIONS, deploy_notice, incident_triage
    from rules.example.agent import REPLY, TriageNote, triage_agent
    from rules.example.events import (
        EVENTS,
        DeployEvent,
        DeployFinished,
        IncidentEvent,
        IncidentOpened,
    )
    from rules.example.rules import ACTION_TIMEOUT, DEPLOY_NOTICE, INCIDENT_TRIAGE, RETRY, RULES

__all__ = [
    "ACTIONS",
    "ACTION_TIMEOUT",
    "DEPLOY_NOTICE",
    "EVENTS",
    "INCIDENT_TRIAGE",
    "REPLY",
    "RETRY",
    "RULES",
    "DeployEvent",
    "DeployFinished",
    "IncidentEvent",
    "IncidentOpened",
    "TriageNote",
    "artifact_workspaces",
    "build_app",
    "create_app",
    "create_artifacts",
    "create_rules",
    "deploy_notice",
    "incident_triage",
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
    "rules.example.rules": ("ACTION_TIMEOUT", "DEPLOY_NOTICE", "INCIDENT_TRIAGE", "RETRY", "RULES"),
    "rules.example.agent": ("REPLY", "TriageNote", "triage_agent"),
    "rules.example.actions": ("ACTIONS", "deploy_notice", "incident_triage"),
}
"""Which module holds each piece this module names."""

_HOME: Final = {name: module for module, names in PIECES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A piece of the example, imported from its module when first asked for."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module), name)


def rule_workspaces(storage: "RuleStorage") -> "RuleWorkspaces":
    """reflexr's workspaces of the example on ``storage``: its events and rules."""
    from reflexr.workspace import Workspaces

    from rules.example.events import EVENTS
    from rules.example.rules import RULES

    return Workspaces(storage, events=list(EVENTS), rules=RULES)


def artifact_workspaces(storage: "ArtifactStorage") -> "ArtifactWorkspaces":
    """artifactr's workspaces of the example on ``storage``: its agent's artifact kind."""
    from artifactr import Workspaces

    from rules.example.agent import TriageNote

    return Workspaces(storage, types=[TriageNote])


async def create_rules(settings: Settings) -> RulesPart:
    """The example's rules part (:mod:`relayr.parts`): for publishing, and for ops on runs."""
    storage = await open_rule_storage(settings)
    return RulesPart(rule_workspaces(storage.storage), storage.engines)


async def create_artifacts(settings: Settings) -> ArtifactsPart:
    """The example's artifacts part (:mod:`relayr.parts`): for creating and reading threads."""
    storage = await open_artifact_storage(settings)
    return ArtifactsPart(artifact_workspaces(storage.storage), storage.engines)


async def build_app(settings: Settings, *, reply_delay_s: float = 0.0) -> Application:
    """The example application on ``settings.database_url``, with a slower agent if asked.

    Tests of shutdown use ``reply_delay_s`` to keep turns running; ``create_app`` is this with
    the defaults.
    """
    from rules.example.actions import ACTIONS
    from rules.example.agent import triage_agent

    storage = await open_storage(settings)
    return Application(
        artifacts=artifact_workspaces(storage.artifacts),
        rules=rule_workspaces(storage.rules),
        actions=ACTIONS,
        agent=triage_agent(reply_delay_s),
        engines=storage.engines,
    )


@with_parts(rules=create_rules, artifacts=create_artifacts)
async def create_app(settings: Settings) -> Application:
    """The ``RELAYR_APP`` factory: ``rules.example:create_app``."""
    return await build_app(settings)
