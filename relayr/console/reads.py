"""What the console's pages show, read with the calls the command line makes.

Each page's data comes from the engine function behind the matching command (the runs
:func:`relayr.ops.rows.list_runs` lists, from the console's :class:`relayr.ops.index.RunIndex`;
:func:`relayr.ops.report.show_run`,
:func:`relayr.ops.transcript.read_thread`, the allowlist's ``explain``, health's checks), so the
console and the CLI never disagree. Nothing here writes; every read runs on the console's runtime.
"""

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal

from artifactr import SystemActor as ArtifactSystemActor
from artifactr.core import NotFound as ArtifactNotFound
from reflexr.workspace import WorkspaceRef

from relayr.broker import queue_depth
from relayr.core.errors import InvalidAllowlist, Problem
from relayr.core.parsing import ID_PATTERN
from relayr.follow.follower import followers_of
from relayr.follow.reports import Replayed, WorkspaceStatus
from relayr.follow.store import DeadLetter
from relayr.ledger.limits import LimitUse, limit_uses
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
from relayr.ops.index import RunIndex
from relayr.ops.limits import with_waits
from relayr.ops.report import RunReport, show_run
from relayr.ops.rows import RunRow, find_run
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
    """One page of the runs list (:func:`relayr.ops.rows.list_runs`), and the cursor of the next
    one when more runs follow."""

    query: RunQuery
    rows: list[RunRow]
    next_cursor: str | None
    now: datetime
    rule_names: tuple[str, ...] | None
    """The rules the filter's part of a name selects (None: no rule filter)."""

    @property
    def has_next(self) -> bool:
        return self.next_cursor is not None


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
    threads: tuple[str, ...] = ()
    """The threads its data names (``thread_id``), linked from the page."""


@dataclass(frozen=True)
class RunPage:
    """A run whole: what ``relayr runs show`` says, and the events that fired it."""

    report: RunReport
    fired_by: list[FiringEvent]
    matched: int
    """How many events the firing matched (the page shows :data:`FIRING_EVENTS_SHOWN`)."""
    traces: tuple[str, ...] = ()
    """The trace id of each traced attempt, oldest first."""
    trace_url: str = ""
    """The settings' trace URL template (``{trace_id}``), empty when none."""

    def trace_link(self, trace_id: str) -> str | None:
        return self.trace_url.replace("{trace_id}", trace_id) if self.trace_url else None


@dataclass(frozen=True)
class Thread:
    """A thread's transcript, each message a run posted with that run's id."""

    workspace: WorkspaceKey
    id: str
    title: str
    entries: list[ThreadEntry]
    runs: dict[str, str] = field(default_factory=dict)
    """The run that posted each message a run posted, by message id (the ledger's causes)."""


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
class FollowedWorkspace:
    """A followed workspace's position, and how far behind it is in time: the age of the oldest
    artifactr envelope not bridged yet (None when none waits or it could not be read)."""

    status: WorkspaceStatus
    lag_s: float | None


@dataclass(frozen=True)
class FollowersStatus:
    """Every followed workspace's position and its dead letters, or why they could not be
    read."""

    workspaces: list[FollowedWorkspace]
    dead_letters: list[DeadLetter] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class Heartbeat:
    """A role's heartbeat, what ``relayr run`` says of its worker when it runs one, and the one
    verdict both make together (:attr:`state`, :attr:`verdict`)."""

    role: Literal["worker", "dispatcher"]
    check: Check
    supervisor: Check | None = None
    supervised: dict[str, Any] | None = None
    """``relayr run``'s status of its worker (pid, since, restarts), when it runs one."""

    @property
    def ok(self) -> bool:
        return self.check.ok and (self.supervisor is None or self.supervisor.ok)

    @property
    def state(self) -> str:
        """``up``, ``frozen`` (its process is there, its heartbeat is not), or ``down``."""
        if self.ok:
            return "up"
        if self.supervised is not None and self.supervised.get("state") == "running":
            return "frozen"
        return "down"

    def verdict(self, now: datetime) -> str:
        """One sentence for people, the heartbeat and ``relayr run`` read together."""
        beat = self.check.detail
        if self.supervised is None:
            return beat if self.check.ok else f"{self.role} {beat}"
        pid = self.supervised.get("worker_pid")
        since = _moment(self.supervised.get("since"))
        restarts = self.supervised.get("restarts", 0)
        started = "" if since is None else f" since {_clock(since)} ({_ago(since, now)} ago)"
        if self.supervised.get("state") == "restarting":
            return (
                f"worker pid {pid} ended{started}; relayr run starts it again "
                f"(restarts so far: {restarts})"
            )
        if not self.check.ok:
            return (
                f"worker pid {pid} is up{started} but does not beat: frozen or hung "
                f"({beat}); runs wait as pending until it recovers or is killed"
            )
        return f"worker pid {pid} up{started}, restarts: {restarts}; heartbeat {beat}"


@dataclass(frozen=True)
class HealthPage:
    """Heartbeats, the broker, the database, the queue and the followers."""

    home: str
    heartbeats: list[Heartbeat]
    dependencies: list[Check]
    queue: QueueDepth
    followers: FollowersStatus
    now: datetime

    @property
    def problems(self) -> list[str]:
        """What is unhealthy, one line each (the banner every page shows)."""
        found = [
            f"{beat.role} {beat.state}: {beat.verdict(self.now)}"
            for beat in self.heartbeats
            if not beat.ok
        ]
        found += [
            f"{check.name} failing: {check.detail}" for check in self.dependencies if not check.ok
        ]
        if self.followers.error:
            found.append(f"followers unreadable: {self.followers.error}")
        for followed in self.followers.workspaces:
            if followed.lag_s is not None and followed.lag_s > FOLLOWER_LAG_LIMIT_S:
                found.append(
                    f"follower of {followed.status.workspace} is {_span(followed.lag_s)} behind"
                )
        if self.followers.dead_letters:
            found.append(f"{len(self.followers.dead_letters)} follower dead letter(s) wait")
        return found


FOLLOWER_LAG_LIMIT_S: Final = 60.0
"""A follower further behind than this (the oldest envelope it has not bridged) is unhealthy."""


def _moment(text: object) -> datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def _clock(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(then: datetime, now: datetime) -> str:
    return _span((now - then).total_seconds())


def _span(seconds: float) -> str:
    """A duration for people: ``45 s``, ``12 min``, ``3 h``, ``2 d``."""
    whole = max(int(seconds), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if whole >= size:
            return f"{whole // size} {unit}"
    return f"{whole} s"


async def runs_page(runtime: Runtime, query: RunQuery, index: RunIndex) -> RunsPage:
    """A page of runs (``relayr runs list`` with the page's filter, from the console's run
    index), from the query's cursor, and the cursor of the next page when more follow."""
    await index.refreshed()
    now = runtime.application.rules.clock()
    known = rule_names(runtime)
    rows = index.select(query.run_filter(now, limit=PAGE_SIZE + 1, known=known))
    shown = await with_waits(rows[:PAGE_SIZE], runtime.bridge.limits)
    more = len(rows) > PAGE_SIZE
    return RunsPage(
        query=query,
        rows=shown,
        next_cursor=query.cursor_of(shown[-1]) if more else None,
        now=now,
        rule_names=query.rule_names(known),
    )


def rule_names(runtime: Runtime) -> list[str]:
    """Every rule of the application, by name."""
    return sorted(runtime.application.rules.rules)


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
    fired_by = await firing_events(rules, ref, matched)
    return RunPage(
        report=report,
        fired_by=fired_by,
        matched=len(matched),
        traces=() if run is None else tuple(dict.fromkeys(run.trace_ids)),  # each id once
        trace_url=runtime.settings.trace_url,
    )


async def firing_events(rules: Any, ref: WorkspaceRef, matched: Sequence[int]) -> list[FiringEvent]:
    """The first :data:`FIRING_EVENTS_SHOWN` events a firing matched, with the threads their
    data names."""
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
                        threads=threads_named(envelope.data),
                    )
                )
    return fired_by


def threads_named(data: Any) -> tuple[str, ...]:
    """The thread ids an event's data names (``thread_id``), for links."""
    if not isinstance(data, dict):
        return ()
    value = data.get("thread_id")
    return (value,) if isinstance(value, str) and ID_PATTERN.fullmatch(value) else ()


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
    causes = await runtime.bridge.ledger.causes(
        workspace, {("message", entry.id) for entry in entries}
    )
    runs = {key: cause.run_id for (_, key), cause in causes.items()}
    return Thread(workspace=workspace, id=thread_id, title=thread.title, entries=entries, runs=runs)


async def event_page(runtime: Runtime, workspace: WorkspaceKey, seq: int) -> FiringEvent | None:
    """The event at ``seq`` in a workspace's reflexr log, or None."""
    ref = WorkspaceRef(workspace.tenant_id, workspace.workspace_id)
    found = await firing_events(runtime.application.rules, ref, [seq])
    return found[0] if found else None


async def replay(
    runtime: Runtime, workspace: WorkspaceKey, envelope_ids: Sequence[str] | None
) -> Replayed:
    """``relayr follow dead-letters replay``: a workspace's dead letters (those named, or every
    one waiting) projected and published again."""
    return await followers_of(runtime).replay(workspace, envelope_ids)


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


@dataclass(frozen=True)
class LimitsPage:
    """Each bound of each limit in the allowlist file, its use now and the runs waiting on it
    (``relayr limits``), or the file's problems when it is invalid."""

    path: str
    uses: list[LimitUse] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


async def limits_page(runtime: Runtime) -> LimitsPage:
    path = runtime.settings.allowlist
    try:
        allowlists = load_allowlist(path)
    except InvalidAllowlist as invalid:
        return LimitsPage(path=str(path), problems=list(invalid.problems))
    clock = runtime.application.rules.clock
    uses = await limit_uses(allowlists.limits, runtime.bridge.limits, now=clock())
    return LimitsPage(path=str(path), uses=uses)


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
                supervised=None if supervised is None else supervised[1],
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
        now=datetime.now(UTC),
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
        followers = followers_of(runtime)
        statuses = await followers.status()
        letters = await followers.store.dead_letters()
        now = datetime.now(UTC)
        followed = [
            FollowedWorkspace(status, await _lag_s(runtime, status, now)) for status in statuses
        ]
        return FollowersStatus(followed, letters)
    except Exception as error:  # a page that says why beats a page that fails
        return FollowersStatus([], [], f"{type(error).__name__}: {error}")


async def _lag_s(runtime: Runtime, status: WorkspaceStatus, now: datetime) -> float | None:
    """How old the oldest envelope the follower has not bridged is; None when none waits."""
    if status.lag <= 0:
        return None
    key = status.workspace
    handle = await runtime.application.artifacts.open(key.tenant_id, key.workspace_id, actor=READER)
    waiting = await handle.read(after_seq=status.cursor, limit=1)
    if not waiting:
        return None
    return max((now - waiting[0].ts).total_seconds(), 0.0)
