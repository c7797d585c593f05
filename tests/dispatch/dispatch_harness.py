"""The dispatcher's harness on real reflexr storage (memory, SQLite, PostgreSQL): its rules, the
clocks the test moves, and a queue that is a list of messages.

The queue is a list of messages: what the dispatcher promises is which ids it hands over,
together, and when. A worker taking a message is a run executed (so it leaves the due list), as
it would be. ``requeue_after_s`` is measured on a clock the test moves (:class:`Clock`), so "the
message was lost" needs no waiting, and so is the rules' time (:class:`Later`), so a retry comes
due when the test says, not when a second has passed. Used by
:mod:`tests.dispatch.test_dispatch_due`,
:mod:`tests.dispatch.test_dispatch_requeue` and :mod:`tests.dispatch.test_dispatch_passes`.
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

import pytest
from artifactr import Workspaces as ArtifactWorkspaces
from reflexr import Event, F, RetryPolicy, Rule, SourceActor, by, on, run
from reflexr.workspace import Reaction, WorkspaceRef
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.core.allowlist import Allowlists
from relayr.core.run_messages import RunMessage
from relayr.dispatch.changes import Changes
from relayr.dispatch.dispatcher import Dispatcher, DispatchPass, Enqueue
from relayr.execution.executor import execute_runs
from relayr.runtime.application import Application, open_storage
from relayr.runtime.bridge import Bridge
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tests.builders import Gates
from tests.services import STORAGES, storage_url

TENANT, WORKSPACE = "acme", "ops"
REF = WorkspaceRef(TENANT, WORKSPACE)
REQUEUE_AFTER_S = 60.0
FAIR_OFF = 1000
"""``fair_messages`` where fairness is not under test: every due run of a pass goes out at once,
so a test reads a pass's whole hand-out."""
BACKOFF = timedelta(hours=1)
"""A retry's wait: no pass takes that long, so a retry is due only once the test moves
:class:`Later` past it."""

FAIR_BATCH = int(Settings.model_fields["fair_batch"].default)
"""The most runs one message of a workspace carries, by default (RELAYR_FAIR_BATCH)."""


class DispatchTestEvent(Event, abstract=True, event_namespace="dispatchtest"):
    pass


class Ping(DispatchTestEvent, name="ping"):
    mode: str = "ok"


class Step(DispatchTestEvent, name="step"):
    key: str


RULES = [
    Rule(
        name="dispatch:ping",
        when=on(Ping),
        then=run("act"),
        ordering="none",
        start="beginning",
        retry=RetryPolicy(max_attempts=3, backoff=BACKOFF),
    ),
    Rule(
        name="dispatch:step",
        when=on(Step),
        scope=by(F.key),
        then=run("act"),
        ordering="scope",
        start="beginning",
    ),
]


async def act(reaction: Reaction[Bridge]) -> None:
    mode = reaction.events[-1].data.get("mode", "ok")
    if mode == "fail":
        raise RuntimeError("flaky")
    if mode == "wait":
        gates = reaction.deps.app
        assert isinstance(gates, Gates)
        gates.started.set()
        await gates.release.wait()


class Clock:
    """The monotonic clock ``requeue_after_s`` is measured on, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Later:
    """The rules' clock: the time now, plus what the test moved it by."""

    def __init__(self) -> None:
        self.ahead = timedelta(0)

    def __call__(self) -> datetime:
        return datetime.now(UTC) + self.ahead


class Harness:
    def __init__(self, runtime: Runtime, later: Later) -> None:
        self.runtime = runtime
        self.rules = runtime.application.rules
        self.later = later
        self.clock = Clock()
        self.depth: int | None = None
        """What the broker says waits in the queue; None: it cannot say."""
        self.dispatcher = Dispatcher(runtime, monotonic=self.clock, queue_depth=self.queue_depth)
        self.queue: list[RunMessage] = []
        gates = runtime.application.app_deps
        assert isinstance(gates, Gates)
        self.gates = gates

    async def queue_depth(self) -> int | None:
        return self.depth

    async def enqueue(self, batch: RunMessage) -> None:
        assert (batch.tenant_id, batch.workspace_id) == (TENANT, WORKSPACE)
        self.queue.append(batch)

    async def publish(self, *events: Event) -> None:
        source = await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
        for event in events:
            await source.publish(event)

    async def dispatch(self) -> tuple[DispatchPass, list[str]]:
        """One pass; returns it and the ids it enqueued."""
        self.queue.clear()
        done = await self.dispatcher.pass_once(self.enqueue)
        return done, [run_id for batch in self.queue for run_id in batch.run_ids]

    async def dispatch_caught_up(self) -> tuple[DispatchPass, list[str]]:
        """Passes until every workspace is evaluated to its head (:func:`caught_up`); what they
        did together, and the ids they enqueued."""
        self.queue.clear()
        done = await caught_up(self.dispatcher, self.enqueue)
        return done, [run_id for batch in self.queue for run_id in batch.run_ids]

    async def take(self, run_ids: list[str]) -> None:
        """What a worker does with a message it takes: execute its runs."""
        await execute_runs(self.runtime, TENANT, WORKSPACE, run_ids)

    async def runs(self) -> dict[str, str]:
        source = await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
        return {r.id: r.status for r in await source.runs(limit=1000)}


async def caught_up(dispatcher: Dispatcher, enqueue: Enqueue) -> DispatchPass:
    """Passes until every workspace is evaluated to its head: a backlog takes a pass for each
    transaction of envelopes (``BATCH_ENVELOPES``). What they did together: the counts summed,
    what waits (``waiting``, ``withheld``) as the last pass left it."""
    done = await dispatcher.pass_once(enqueue)
    total = done
    while dispatcher.behind:
        done = await dispatcher.pass_once(enqueue, Changes())
        total = replace(
            total,
            **{name: getattr(total, name) + getattr(done, name) for name in SUMMED},
            waiting=done.waiting,
            withheld=done.withheld,
        )
    return total


SUMMED: Final = ("ticks", "firings", "due", "enqueued", "messages", "again", "failed", "bridged")


@pytest.fixture(params=STORAGES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return storage_url(request, tmp_path)


@asynccontextmanager
async def opened(settings: Settings, rules: list[Rule]) -> AsyncIterator[Harness]:
    """A dispatcher's runtime on ``settings``' storage, running ``rules`` on the test's clock;
    closed after the block."""
    storage = await open_storage(settings)
    later = Later()
    application = Application(
        artifacts=ArtifactWorkspaces(storage.artifacts),
        rules=RuleWorkspaces(storage.rules, events=[Ping, Step], rules=rules, clock=later),
        actions={"act": act},
        app_deps=Gates(),
        engines=storage.engines,
    )
    runtime = await Runtime.start(
        settings, role="dispatcher", application=application, allowlists=Allowlists.empty
    )
    try:
        yield Harness(runtime, later)
    finally:
        await runtime.aclose()


@pytest.fixture
async def harness(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    settings = Settings(
        home=tmp_path,
        database_url=database_url,
        requeue_after_s=REQUEUE_AFTER_S,
        dispatch_interval_s=0.05,
        turn_grace_s=0,
        fair_messages=FAIR_OFF,
    )
    async with opened(settings, RULES) as harness:
        yield harness
