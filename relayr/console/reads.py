"""What the console's pages show, read with the calls the command line makes.

Each page's data comes from the engine function behind the matching command
(:func:`relayr.ops.rows.list_runs`, :func:`relayr.ops.report.show_run`,
:func:`relayr.ops.transcript.read_thread`, the allowlist's ``explain``, health's checks), so the
console and the CLI never disagree. Nothing here writes; every read runs on the console's runtime.
"""

import asyncio
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal

from artifactr import SystemActor as ArtifactSystemActor
from artifactr.core import NotFound as ArtifactNotFound
from reflexr.workspace import WorkspaceRef

from relayr.broker import queue_depth
from relayr.core.errors import InvalidAllowlist, Problem
from relayr.follow.follower import followers_of
from relayr.follow.reports import WorkspaceStatus
from relayr.ledger.port import WorkspaceKey
from relayr.observe.health import (
    DEFAULT_MAX_AGE_S,
    DEFAULT_TIMEOUT_S,
    Check,
    check_broker,
    check_database,
    check_heartbeat,
    check_supervisor,
    heartbeat_path,
)
from relayr.ops.report import RunReport, show_run
from relayr.ops.rows import RunRow, find_run, list_runs
from relayr.ops.transcript import ThreadEntry, read_thread
from relayr.runtime.allowlist_file import load_allowlist
from relayr.runtime.process import Runtime

from .queries import PAGE_SIZE, RunQuery

READER: Final = ArtifactSystemActor(name="relayr-console")
"""Who reads threads from the console, as artifactr records it."""

FIRING_EVENTS_SHOWN: Final = 20
"""How many of the events that fired a run its page shows: a window rule may match thousands,
and the first twenty say what happened."""

TURN_ADVICE: Final = {
    "completed": "the agent answered",
    "failed": "the turn failed",
    "stopped": "the turn was stopped before it ended (cancelled, or its worker shut down)",
    "running": "the agent is on it",
    "untaken": "no turn has taken this message yet",
}
"""What a turn's status means, shown when ``relayr runs show`` gives no reason of its own (it
gives one for a stalled turn: what to do about it)."""

QUEUE_DEPTH_TIMEOUT_S: Final = DEFAULT_TIMEOUT_S
"""How long the broker gets to say its queue's depth: as long as ``relayr health`` gives it."""


@dataclass(frozen=True)
class RunsPage:
    """One page of the runs list, newest created first (:func:`relayr.ops.rows.list_runs`: a page
    shows the runs the pages before it did not)."""

    query: RunQuery
    rows: list[RunRow]
    has_next: bool
    now: datetime


@dataclass(frozen=True)
class FiringEvent:
    """An event that made the run's rule fire, as its page shows it."""

    seq: int
    id: str
    type: str
    ts: datetime
    actor: str
    data: str
    """The event's fields as indented JSON."""


@dataclass(frozen=True)
class RunPage:
    """A run whole: what ``relayr runs show`` says, and the events that fired it."""

    report: RunReport
    fired_by: list[FiringEvent]
    matched: int
    """How many events the firing matched (the page shows :data:`FIRING_EVENTS_SHOWN`)."""


@dataclass(frozen=True)
class Thread:
    """A thread's transcript."""

    workspace: WorkspaceKey
    id: str
    title: str
    entries: list[ThreadEntry]


@dataclass(frozen=True)
class RuleGrant:
    """What one rule of the application may do, and which entry said so (``explain``)."""

    rule: str
    grant: dict[str, Any]


@dataclass(frozen=True)
class AllowlistPage:
    """The allowlist file as the application's rules meet it, or its problems."""

    path: str
    grants: list[RuleGrant] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class QueueDepth:
    """How many messages wait in the runs' queue, or why it could not be read."""

    queue: str
    depth: int | None
    detail: str


@dataclass(frozen=True)
class FollowersStatus:
    """Every followed workspace's position, or why it could not be read."""

    workspaces: list[WorkspaceStatus]
    error: str | None = None


@dataclass(frozen=True)
class Heartbeat:
    """A role's heartbeat, and what ``relayr run`` says of its worker when it runs one."""

    role: Literal["worker", "dispatcher"]
    check: Check
    supervisor: Check | None = None


@dataclass(frozen=True)
class HealthPage:
    """Heartbeats, the broker, the database, the queue and the followers."""

    home: str
    heartbeats: list[Heartbeat]
    dependencies: list[Check]
    queue: QueueDepth
    followers: FollowersStatus


async def runs_page(runtime: Runtime, query: RunQuery) -> RunsPage:
    """A page of runs (``relayr runs list`` with the page's filter), and whether more follow."""
    rules = runtime.application.rules
    now = rules.clock()
    shown_to = query.page * PAGE_SIZE
    rows = await list_runs(rules, query.run_filter(now, limit=shown_to + 1))
    return RunsPage(
        query=query,
        rows=rows[shown_to - PAGE_SIZE : shown_to],
        has_next=len(rows) > shown_to,
        now=now,
    )


async def run_page(runtime: Runtime, run_id: str, workspace: WorkspaceKey | None) -> RunPage | None:
    """A run (``relayr runs show``) and the events that fired it; None if there is no such run."""
    rules = runtime.application.rules
    row = await find_run(rules, run_id, workspace)
    if row is None:
        return None
    report = await show_run(rules, runtime.application.artifacts, runtime.bridge.ledger, row)
    ref = WorkspaceRef(row.tenant_id, row.workspace_id)
    run = await rules.storage.run(ref, row.id)
    matched = () if run is None else run.matched
    fired_by = []
    for seq in sorted(matched)[:FIRING_EVENTS_SHOWN]:
        for envelope in await rules.storage.read(ref, after_seq=seq - 1, limit=1):
            if envelope.seq == seq:
                fired_by.append(
                    FiringEvent(
                        seq=envelope.seq,
                        id=envelope.id,
                        type=envelope.event_type,
                        ts=envelope.ts,
                        actor=str(envelope.actor.participant),
                        data=json.dumps(envelope.data, indent=2, ensure_ascii=False, default=str),
                    )
                )
    return RunPage(report=report, fired_by=fired_by, matched=len(matched))


async def thread_page(runtime: Runtime, workspace: WorkspaceKey, thread_id: str) -> Thread | None:
    """A thread's transcript (``relayr thread show``); None if the thread does not exist."""
    handle = await runtime.application.artifacts.open(
        workspace.tenant_id, workspace.workspace_id, actor=READER
    )
    try:
        thread = await handle.thread(thread_id)
    except ArtifactNotFound:
        return None
    entries = await read_thread(handle, thread_id)
    return Thread(workspace=workspace, id=thread_id, title=thread.title, entries=entries)


def allowlist_page(runtime: Runtime) -> AllowlistPage:
    """Every rule of the application with what it may do and which entry gave it (``relayr
    allowlist explain`` for each), the file's warnings, or its problems when it is invalid."""
    from relayr.core.allowlist import warnings

    path = runtime.settings.allowlist
    try:
        allowlists = load_allowlist(path)
    except InvalidAllowlist as invalid:
        return AllowlistPage(path=str(path), problems=list(invalid.problems))
    names = sorted(runtime.application.rules.rules)
    return AllowlistPage(
        path=str(path),
        grants=[RuleGrant(rule, allowlists.explain(rule).to_json()) for rule in names],
        warnings=warnings(allowlists, names),
    )


async def health_page(runtime: Runtime) -> HealthPage:
    """What ``relayr health`` checks for both roles, the queue's depth and the followers."""
    settings = runtime.settings
    heartbeats = []
    for role in ("worker", "dispatcher"):
        path = heartbeat_path(settings.home, role)
        supervised = (
            check_supervisor(settings.home, max_age_s=DEFAULT_MAX_AGE_S)
            if role == "worker"
            else None
        )
        heartbeats.append(
            Heartbeat(
                role=role,
                check=check_heartbeat(path, max_age_s=DEFAULT_MAX_AGE_S),
                supervisor=None if supervised is None else supervised[0],
            )
        )
    broker, database, queue, followers = await asyncio.gather(
        check_broker(settings, timeout_s=DEFAULT_TIMEOUT_S),
        check_database(settings, timeout_s=DEFAULT_TIMEOUT_S),
        _queue_depth(runtime),
        _followers(runtime),
    )
    return HealthPage(
        home=str(settings.home.absolute()),
        heartbeats=heartbeats,
        dependencies=[broker, database],
        queue=queue,
        followers=followers,
    )


async def _queue_depth(runtime: Runtime) -> QueueDepth:
    settings = runtime.settings
    try:
        async with asyncio.timeout(QUEUE_DEPTH_TIMEOUT_S):
            depth = await asyncio.to_thread(queue_depth, settings)
    except TimeoutError:
        detail = f"the broker did not answer within {QUEUE_DEPTH_TIMEOUT_S:g} s"
        return QueueDepth(settings.queue, None, detail)
    except Exception as error:  # any failure to read it is the answer, named
        return QueueDepth(settings.queue, None, f"{type(error).__name__}: {error}")
    return QueueDepth(settings.queue, depth, f"{depth} message(s) waiting")


async def _followers(runtime: Runtime) -> FollowersStatus:
    try:
        return FollowersStatus(await followers_of(runtime).status())
    except Exception as error:  # a page that says why beats a page that fails
        return FollowersStatus([], f"{type(error).__name__}: {error}")
