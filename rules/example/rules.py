"""The example's rules: unordered, with quick retries.

Outbound (:data:`RULES`): a deploy notice and an incident triage. Inbound
(:data:`INBOUND_RULES`), on what the follower bridges from artifactr (:mod:`relayr.follow`):
a follow-up notice when the agent replies, a page when a message (never a notice) calls
``@on-call``, and the scribe, an agent-driven rule, when a triage turn ends.

The decisions behind their settings are in the package's docstring (:mod:`rules.example`) and
ADR-0007. Rules name their actions (``run("deploy_notice")``), they do not import them, so this
module imports reflexr (and the bridged event types, reflexr only).
"""

from datetime import timedelta
from typing import Final

from reflexr import F, RetryPolicy, Rule, on, run

from relayr.follow.events import MessagePosted, TurnEnded
from rules.example.events import DeployFinished, IncidentOpened

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
"""The outbound rules: they answer the events people's tools publish."""

ON_CALL: Final = "@on-call"
"""What a message writes to page the on-call engineer (the triage agent's reply does)."""

AGENT_REPLIED: Final = Rule(
    name="ops:agent-replied",
    when=on(MessagePosted).where(F.author.matches(r"^agent:"), F.kind.eq("message")),
    then=run("agent_replied"),
    ordering="none",
    start="beginning",
    retry=RETRY,
    timeout=ACTION_TIMEOUT,
    description="Post a follow-up notice when the thread's agent replies.",
)

PAGE_ON_CALL: Final = Rule(
    name="ops:page-on-call",
    # a notice never pages: the page itself is a notice that names @on-call, and without the
    # kind it would page again, and again, up to the depth limit
    when=on(MessagePosted).where(F.kind.ne("notice"), F.content.contains(ON_CALL)),
    then=run("page_on_call"),
    ordering="none",
    start="beginning",
    retry=RETRY,
    timeout=ACTION_TIMEOUT,
    description="Page the on-call engineer when a message (not a notice) calls @on-call.",
)

INCIDENT_SCRIBE: Final = Rule(
    name="ops:incident-scribe",
    when=on(TurnEnded).where(F.outcome.eq("completed")),
    then=run("incident_scribe"),
    ordering="none",
    start="beginning",
    retry=RETRY,
    timeout=ACTION_TIMEOUT,
    description="Have the scribe agent write up a triage turn that ended, through its tools.",
)

INBOUND_RULES: Final = (AGENT_REPLIED, PAGE_ON_CALL, INCIDENT_SCRIBE)
"""The inbound rules: they answer what the follower bridges from artifactr."""
