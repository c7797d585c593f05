"""The demo's scenario: the example's events published, waited for, and counted.

``relayr demo`` runs it in a fresh home of its own (:func:`demo_home`): it publishes the
example's events, waits until every run and turn has ended (:func:`wait_until_done`) and checks
the counts, including what the followers bridge back (:func:`summarize`). The integration tests
use the same pieces, so what the demo checks is what they assert. Engine only: dispatching on
Celery is :func:`relayr.cli.demo.run_scenario`'s.
"""

import asyncio
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from artifactr import UserActor as ArtifactUserActor
from artifactr import Workspace as ArtifactWorkspace
from artifactr.core import MessagePosted, RunEnded
from reflexr import SourceActor
from reflexr.core import FINISHED, Run, load_event
from reflexr.workspace import Workspace as RuleWorkspace

from relayr.follow.events import BRIDGED_EVENTS
from relayr.runtime.process import Runtime

TENANT: Final = "demo"
WORKSPACE: Final = "ops"

RULE_AUTHOR_PREFIX: Final = "external_agent:reflexr:"
"""How a rule's writes are authored in artifactr: ``external_agent:reflexr:<rule>``."""

AGENT_AUTHOR_PREFIX: Final = "agent:"

DEPLOYS_PER_THREAD: Final = 10
"""How many deploy notices share one thread: enough to read like a channel."""

POLL_INTERVAL_S: Final = 1.0
"""How often the demo looks at the runs and the threads while it waits."""

DISPATCH_INTERVAL_S: Final = 0.5
"""The demo's dispatcher pass interval: shorter than the default, so a small demo is quick."""

INBOUND_RULES: Final = ("ops:agent-replied", "ops:page-on-call", "ops:incident-scribe")
"""The example's rules that answer bridged events (``rules.example.INBOUND_RULES``): each runs
once per incident, in the incident's chain, and posts one notice.

This and the two below are copies: the engine imports no application (``rules`` builds on
``relayr``, not the other way). tests/test_example_inbound.py keeps them equal to the
example's."""

SCRIBE_RULE: Final = "ops:incident-scribe"
TOOL_CALLS_PER_INCIDENT: Final = 2
"""The scribe agent's tool calls per incident (``rules.example.SCRIBE_TOOL_CALLS``): it
proposes a triage note, then names the proposal in a notice."""

BRIDGED_PER_INCIDENT: Final = 7
"""The events bridged per incident: the triage message, the agent's reply, the turn's end, the
inbound rules' three notices and the scribe's proposal."""

BRIDGED_PER_DEPLOY: Final = 1
"""The events bridged per deploy: its notice."""

BRIDGED_TYPES: Final = tuple(event.event_type for event in BRIDGED_EVENTS)

DEMO_PUBLISHER: Final = SourceActor(name="relayr-demo")

CLI_USER: Final = ArtifactUserActor(id="relayr-cli", name="relayr CLI")
"""Who creates the demo's threads and reads them: the command line's user, as
``relayr thread`` acts (``relayr.cli.threads.cli_user``), so the demo's threads read as made by
hand."""


@dataclass(frozen=True)
class Plan:
    """What a scenario publishes: ``deploys`` notices' worth of events and ``incidents`` turns'."""

    deploys: int
    incidents: int

    @classmethod
    def of(cls, runs: int) -> "Plan":
        """A quarter incidents (at least one), the rest deploys."""
        incidents = max(1, runs // 4)
        return cls(deploys=runs - incidents, incidents=incidents)

    @property
    def runs(self) -> int:
        """The runs of the events published: a notice per deploy, a send per incident."""
        return self.deploys + self.incidents

    @property
    def follow_ups(self) -> int:
        """The runs (and notices) of the example's inbound rules, which answer bridged events."""
        return len(INBOUND_RULES) * self.incidents

    @property
    def all_runs(self) -> int:
        return self.runs + self.follow_ups

    @property
    def bridged_events(self) -> int:
        return BRIDGED_PER_DEPLOY * self.deploys + BRIDGED_PER_INCIDENT * self.incidents

    @property
    def tool_calls(self) -> int:
        return TOOL_CALLS_PER_INCIDENT * self.incidents


@dataclass(frozen=True)
class Scenario:
    """What :func:`publish_scenario` made: the threads, and the events' ids."""

    threads: tuple[str, ...]
    event_ids: tuple[str, ...]


async def publish_scenario(
    runtime: Runtime,
    tenant_id: str,
    workspace_id: str,
    plan: Plan,
    *,
    prefix: str = "demo",
) -> Scenario:
    """Create threads and publish ``plan``'s events into one workspace.

    Deploys share threads (:data:`DEPLOYS_PER_THREAD` each); each incident has a thread of its
    own, so each message starts a turn of its own (messages of one author in a busy thread would
    steer the turn already running instead). Event ids are derived from ``prefix``, so
    publishing the same scenario twice adds nothing.
    """
    artifacts = await runtime.application.artifacts.open(tenant_id, workspace_id, actor=CLI_USER)
    deploy_threads = [
        (await artifacts.create_thread(f"deploys {index + 1}")).id
        for index in range(-(-plan.deploys // DEPLOYS_PER_THREAD))
    ]
    incident_threads = [
        (await artifacts.create_thread(f"incident {index + 1}")).id
        for index in range(plan.incidents)
    ]
    events, ids = [], []
    for index in range(plan.deploys):
        thread_id = deploy_threads[index // DEPLOYS_PER_THREAD]
        status = "failed" if index % 5 == 4 else "succeeded"
        data = {"service": f"svc-{index + 1:03d}", "status": status, "thread_id": thread_id}
        events.append(load_event({"type": "deploy:finished", **data}))
        ids.append(f"{prefix}-deploy-{index + 1}")
    for index, thread_id in enumerate(incident_threads):
        data = {"title": f"checkout errors #{index + 1}", "thread_id": thread_id}
        events.append(load_event({"type": "incident:opened", **data}))
        ids.append(f"{prefix}-incident-{index + 1}")
    rules = await runtime.application.rules.open(tenant_id, workspace_id, actor=DEMO_PUBLISHER)
    await rules.publish_many(events, ids=ids)
    return Scenario(threads=(*deploy_threads, *incident_threads), event_ids=tuple(ids))


@dataclass
class Tally:
    """What rules and the agent wrote in a workspace, read from its log as it grows."""

    after_seq: int = 0
    entries: dict[str, list[MessagePosted]] = field(default_factory=dict)
    authors: dict[str, str] = field(default_factory=dict)
    seqs: dict[str, int] = field(default_factory=dict)
    ids: Counter[str] = field(default_factory=Counter)
    rule_texts: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    notices: int = 0
    messages: int = 0
    replies: int = 0
    turns: int = 0
    turns_failed: int = 0
    follow_ups: int = 0
    bridged_after_seq: int = 0
    bridged_events: int = 0

    async def read(self, workspace: ArtifactWorkspace) -> None:
        """Take in what the workspace's log gained since the last read."""
        for envelope in await workspace.read(after_seq=self.after_seq):
            self.after_seq = max(self.after_seq, envelope.seq)
            event = envelope.event
            author = envelope.actor.participant
            if isinstance(event, MessagePosted):
                self.ids[event.message_id] += 1
                if author.startswith(RULE_AUTHOR_PREFIX):
                    self.rule_texts[(event.thread_id, author, event.content)] += 1
                    if event.kind == "notice":
                        self.notices += 1
                        if author.removeprefix(RULE_AUTHOR_PREFIX) in INBOUND_RULES:
                            self.follow_ups += 1
                    else:
                        self.messages += 1
                elif author.startswith(AGENT_AUTHOR_PREFIX):
                    self.replies += 1
            elif isinstance(event, RunEnded):
                if event.status == "completed":
                    self.turns += 1
                else:
                    self.turns_failed += 1

    async def read_bridged(self, rules: RuleWorkspace) -> None:
        """Take in the bridged events reflexr's log gained since the last read."""
        for envelope in await rules.read(after_seq=self.bridged_after_seq, types=BRIDGED_TYPES):
            self.bridged_after_seq = max(self.bridged_after_seq, envelope.seq)
            self.bridged_events += 1

    @property
    def duplicates(self) -> int:
        """Message ids posted twice, plus rule texts posted twice by one rule in one thread."""
        twice_ids = sum(count - 1 for count in self.ids.values() if count > 1)
        twice_texts = sum(count - 1 for count in self.rule_texts.values() if count > 1)
        return twice_ids + twice_texts


@dataclass(frozen=True)
class Progress:
    """Where a scenario stands: its runs by status, the tally of its writes, and the tool calls
    of the scribe's runs that succeeded."""

    statuses: Mapping[str, int]
    tally: Tally
    tool_calls: int = 0

    @property
    def finished(self) -> int:
        return sum(count for status, count in self.statuses.items() if status in FINISHED)


async def wait_until_done(
    rules: RuleWorkspace,
    artifacts: ArtifactWorkspace,
    plan: Plan,
    *,
    timeout_s: float,
    poll_interval_s: float = POLL_INTERVAL_S,
) -> tuple[Progress, float | None]:
    """Wait until ``plan.all_runs`` runs have finished, every incident's turn has ended and
    ``plan.bridged_events`` events were bridged.

    Returns the progress and how long the runs took to finish (None if they did not in time).
    """
    tally = Tally()
    started = time.monotonic()
    deadline = started + timeout_s
    runs_done_s: float | None = None
    while True:
        runs = await rules.runs()
        statuses: Counter[str] = Counter(run.status for run in runs)
        await tally.read(artifacts)
        await tally.read_bridged(rules)
        progress = Progress(statuses, tally, _tool_calls(runs))
        if runs_done_s is None and progress.finished >= plan.all_runs:
            runs_done_s = time.monotonic() - started
        turns_done = tally.turns + tally.turns_failed >= plan.incidents
        bridged = tally.bridged_events >= plan.bridged_events
        done = runs_done_s is not None and turns_done and bridged
        if done or time.monotonic() >= deadline:
            return progress, runs_done_s
        await asyncio.sleep(poll_interval_s)


def _tool_calls(runs: Sequence[Run]) -> int:
    """The tool calls the scribe's agent made in the runs that succeeded (their output)."""
    total = 0
    for run in runs:
        if run.rule == SCRIBE_RULE and run.status == "succeeded" and isinstance(run.output, dict):
            calls = run.output.get("tool_calls")
            total += calls if isinstance(calls, int) else 0
    return total


def summarize(plan: Plan, progress: Progress, runs_done_s: float | None) -> dict[str, Any]:
    """The summary the demo prints, with the expected counts and what is off."""
    tally = progress.tally
    counts = {
        "runs_succeeded": progress.statuses.get("succeeded", 0),
        "notices": tally.notices,
        "messages": tally.messages,
        "turns": tally.turns,
        "duplicates": tally.duplicates,
        "bridged_events": tally.bridged_events,
        "follow_ups": tally.follow_ups,
        "tool_calls": progress.tool_calls,
    }
    expected = {
        "runs_succeeded": plan.all_runs,
        "notices": plan.deploys + plan.follow_ups,
        "messages": plan.incidents,
        "turns": plan.incidents,
        "duplicates": 0,
        "bridged_events": plan.bridged_events,
        "follow_ups": plan.follow_ups,
        "tool_calls": plan.tool_calls,
    }
    problems = [
        f"{name}: {counts[name]}, expected {expected[name]}"
        for name in expected
        if counts[name] != expected[name]
    ]
    if runs_done_s is None:
        problems.append("the runs did not all finish in time")
    return {
        "runs": plan.all_runs,
        **counts,
        "replies": tally.replies,
        "turns_failed": tally.turns_failed,
        "runs_by_status": dict(sorted(progress.statuses.items())),
        "elapsed_s": None if runs_done_s is None else round(runs_done_s, 3),
        "runs_per_s": None if not runs_done_s else round(plan.all_runs / runs_done_s, 2),
        "expected": expected,
        "problems": problems,
        "ok": not problems,
    }


def demo_home(base: Path = Path(".relayr")) -> Path:
    """A fresh home for one demo run: ``.relayr/demo-<time>-<pid>``."""
    return (base / f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}").absolute()


def example_allowlist() -> Path:
    """The example application's allowlist, next to its rules, wherever relayr is installed."""
    import rules

    for folder in rules.__path__:
        candidate = Path(folder) / "allowlist.toml"
        if candidate.is_file():
            return candidate
    return Path("rules/allowlist.toml")


def demo_environment(home: Path) -> dict[str, str]:
    """The demo's settings, as ``RELAYR_*`` variables: embedded defaults in ``home``.

    The example application and its allowlist are the package's own, whatever the caller's
    ``RELAYR_*`` variables say and wherever the demo is started from.
    """
    return {
        "RELAYR_HOME": str(home),
        "RELAYR_ALLOWLIST": str(example_allowlist()),
        "RELAYR_DISPATCH_INTERVAL_S": str(DISPATCH_INTERVAL_S),
        "RELAYR_LOG_FORMAT": "json",
    }
