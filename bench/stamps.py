"""Times read from the stores: when each event was published and when its notice committed.

A ``deploy:finished`` event's publish time is its reflexr envelope's ``ts``; its notice's time
is the ``ts`` of the artifactr ``message_posted`` envelope that the rule ``ops:deploy-notice``
wrote (``deploy of <service> finished: <status>``). Both are stamped by the storage's writers,
so whoever published the event (``relayr publish`` in another process, or a benchmark) and
however often a benchmark reads changes neither. Events are matched to their notices by the
event's ``service``, which each benchmark makes unique.

:class:`Stores` opens both libraries' workspaces of the settings' application (the command
line's own way, :mod:`relayr.runtime.application_parts`), to make threads, publish and read;
:class:`NoticeWatch` reads the notices as they come.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Self

from artifactr import Workspace as ArtifactWorkspace
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import CreateThread, MessagePosted
from reflexr import SourceActor
from reflexr.core import RunStarted
from reflexr.workspace import Workspace as RuleWorkspace
from reflexr.workspace import Workspaces as RuleWorkspaces

from bench.common import percentile
from relayr.demo import CLI_USER, DEPLOYS_PER_THREAD, RULE_AUTHOR_PREFIX
from relayr.runtime.application_parts import opened_artifacts, opened_rules
from relayr.settings import Settings

TENANT: Final = "bench"

READER: Final = SourceActor(name="relayr-bench")
"""Who the benchmarks read reflexr's logs (and publish, where they publish themselves) as."""

DEPLOY_FINISHED: Final = "deploy:finished"

NOTICE_RULE: Final = "ops:deploy-notice"
"""The example's rule whose notice a ``deploy:finished`` event makes."""

RUN_STARTED: Final = "reflexr:run_started"

READ_EVERY_S: Final = 1.0
"""How often :meth:`NoticeWatch.until` reads. On SQLite a read takes the write lock, so reading
often slows what is measured; the figures come from the envelopes' ``ts``, not from reads."""

READ_BATCH: Final = 1000
"""Envelopes per read of a log."""


def deploy(service: str, thread_id: str) -> dict[str, str]:
    """A ``deploy:finished`` event's data: its notice names ``service``."""
    return {"service": service, "status": "succeeded", "thread_id": thread_id}


def thread_of(threads: Sequence[str], index: int) -> str:
    """The thread of a workspace's ``index``-th deploy, among :meth:`Stores.create_threads`'."""
    return threads[index // DEPLOYS_PER_THREAD]


def latency_summary(milliseconds: Sequence[float]) -> dict[str, float | None]:
    """p50, p90, p99 and max (nearest rank), in milliseconds to one decimal."""
    summary: dict[str, float | None] = {}
    for name, q in (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("max", 100.0)):
        value = percentile(milliseconds, q)
        summary[name] = None if value is None else round(value, 1)
    return summary


def latencies_ms(
    published: Mapping[str, datetime], noticed: Mapping[str, datetime], services: Iterable[str]
) -> list[float]:
    """Each of ``services``' notice time minus its publish time, in ms (those with both)."""
    return [
        (noticed[service] - published[service]).total_seconds() * 1000.0
        for service in services
        if service in published and service in noticed
    ]


@dataclass(frozen=True)
class Stages:
    """One event's way to its notice, as the stores stamped it."""

    published: datetime
    decided: datetime
    """When its run was made: the dispatcher's evaluation committed."""
    claimed: datetime | None
    """When a worker claimed the run's first attempt (None: not yet)."""


def stage_summaries(
    stages: Mapping[str, Stages], noticed: Mapping[str, datetime], services: Iterable[str]
) -> dict[str, dict[str, float | None]]:
    """p50, p90, p99 and max of each stage over ``services``: ``decide`` (publish to run made),
    ``queue`` (run made to claimed) and ``act`` (claimed to notice committed), in ms."""
    spans: dict[str, list[float]] = {"decide": [], "queue": [], "act": []}
    for service in services:
        stage = stages.get(service)
        if stage is None or stage.claimed is None or service not in noticed:
            continue
        for name, start, end in (
            ("decide", stage.published, stage.decided),
            ("queue", stage.decided, stage.claimed),
            ("act", stage.claimed, noticed[service]),
        ):
            spans[name].append((end - start).total_seconds() * 1000.0)
    return {name: latency_summary(values) for name, values in spans.items()}


@dataclass
class Stores:
    """reflexr's and artifactr's workspaces of one deployment's application."""

    rules: RuleWorkspaces
    artifacts: ArtifactWorkspaces
    _rule_handles: dict[str, RuleWorkspace] = field(default_factory=dict)
    _artifact_handles: dict[str, ArtifactWorkspace] = field(default_factory=dict)

    @classmethod
    @asynccontextmanager
    async def opened(cls, settings: Settings) -> AsyncIterator[Self]:
        """Both sides of ``settings.app``, on its storage (migrated), for the block."""
        async with opened_rules(settings) as rules, opened_artifacts(settings) as artifacts:
            yield cls(rules, artifacts)

    async def rule_workspace(self, workspace: str) -> RuleWorkspace:
        handle = self._rule_handles.get(workspace)
        if handle is None:
            handle = await self.rules.open(TENANT, workspace, actor=READER)
            self._rule_handles[workspace] = handle
        return handle

    async def artifact_workspace(self, workspace: str) -> ArtifactWorkspace:
        handle = self._artifact_handles.get(workspace)
        if handle is None:
            handle = await self.artifacts.open(TENANT, workspace, actor=CLI_USER)
            self._artifact_handles[workspace] = handle
        return handle

    async def create_threads(self, workspace: str, events: int) -> list[str]:
        """Threads for ``events`` deploys in ``workspace``, :data:`DEPLOYS_PER_THREAD` each (as
        the demo shares them); made before anything is measured."""
        handle = await self.artifact_workspace(workspace)
        threads = []
        for start in range(0, max(events, 1), DEPLOYS_PER_THREAD):
            command = CreateThread(title=f"deploys {start // DEPLOYS_PER_THREAD + 1}")
            await handle.commit(command)
            threads.append(command.thread_id)
        return threads

    async def published(self, workspace: str) -> dict[str, datetime]:
        """Each ``deploy:finished`` event of ``workspace``'s log: its service, and when it was
        published."""
        handle = await self.rule_workspace(workspace)
        return {
            str(envelope.data["service"]): envelope.ts
            for envelope in await self._all(handle, {DEPLOY_FINISHED})
        }

    async def stages(self, workspace: str) -> dict[str, Stages]:
        """When each ``deploy:finished`` event of ``workspace`` was published, its run made
        (decided) and its run's first attempt claimed, by service: where a latency went before
        the notice."""
        handle = await self.rule_workspace(workspace)
        published: dict[int, tuple[str, datetime]] = {}
        claimed: dict[str, datetime] = {}
        for envelope in await self._all(handle, {DEPLOY_FINISHED, RUN_STARTED}):
            if isinstance(envelope.event, RunStarted):
                claimed.setdefault(envelope.event.run_id, envelope.ts)
            else:
                published[envelope.seq] = (str(envelope.data["service"]), envelope.ts)
        stages: dict[str, Stages] = {}
        for run in await handle.runs(rule=NOTICE_RULE):
            for seq in run.matched:
                if seq in published:
                    service, ts = published[seq]
                    stages[service] = Stages(ts, run.created_at, claimed.get(run.id))
        return stages

    @staticmethod
    async def _all(handle: RuleWorkspace, types: set[str]) -> list[Any]:
        found: list[Any] = []
        while True:
            after = found[-1].seq if found else 0
            envelopes = await handle.read(after_seq=after, types=types, limit=READ_BATCH)
            found += envelopes
            if len(envelopes) < READ_BATCH:
                return found

    async def watch(self, workspaces: Iterable[str]) -> "NoticeWatch":
        return NoticeWatch(
            {workspace: await self.artifact_workspace(workspace) for workspace in workspaces}
        )


class NoticeWatch:
    """Reads the workspaces' logs incrementally, keeping each rule notice's commit ``ts``."""

    def __init__(self, handles: Mapping[str, ArtifactWorkspace]) -> None:
        self._handles = dict(handles)
        self._after = dict.fromkeys(handles, 0)
        self.seen: dict[str, datetime] = {}
        self.duplicates = 0

    async def read(self) -> None:
        """What each log holds past the last read: one read of a workspace unless it holds more
        than :data:`READ_BATCH` new envelopes (each read takes SQLite's write lock)."""
        for workspace, handle in self._handles.items():
            while True:
                envelopes = await handle.read(after_seq=self._after[workspace], limit=READ_BATCH)
                if envelopes:
                    self._after[workspace] = max(self._after[workspace], envelopes[-1].seq)
                for envelope in envelopes:
                    self._keep(envelope)
                if len(envelopes) < READ_BATCH:
                    break

    def _keep(self, envelope: Any) -> None:
        posted = envelope.event
        if not isinstance(posted, MessagePosted) or posted.kind != "notice":
            return
        if not envelope.actor.participant.startswith(RULE_AUTHOR_PREFIX):
            return
        service = posted.content.split()[2]  # "deploy of <service> finished: ..."
        if service in self.seen:
            self.duplicates += 1
        else:
            self.seen[service] = envelope.ts

    async def until(self, services: Iterable[str], timeout_s: float) -> bool:
        """Read until every service's notice is in; False if the time ran out first."""
        wanted = set(services)
        deadline = time.monotonic() + timeout_s
        while True:
            await self.read()
            if wanted <= self.seen.keys():
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(READ_EVERY_S)
