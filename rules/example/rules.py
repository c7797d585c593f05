"""The example's rules: a deploy notice and an incident triage, unordered, with quick retries.

The decisions behind their settings are in the package's docstring (:mod:`rules.example`) and
ADR-0007. Rules name their actions (``run("deploy_notice")``), they do not import them, so this
module imports reflexr only.
"""

from datetime import timedelta
from typing import Final

from reflexr import RetryPolicy, Rule, on, run

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
