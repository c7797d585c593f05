"""What the tests of the executor's steps under faults share: a worker's runtime on real
storage (in memory, SQLite, PostgreSQL) with rules of their own, a fault made in the database
driver, and the metrics they read.

A test makes every fault and every "meanwhile" itself: an error injected into the statements
that match (:class:`FailingStatements`), a gate the action waits on (:class:`tests.builders.Gates`),
a store the test writes. The tests are in tests/test_commit_faults.py and
tests/test_message_runs.py.
"""

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from artifactr import UserActor
from artifactr import Workspaces as ArtifactWorkspaces
from reflexr import Event, F, RetryPolicy, Rule, SourceActor, by, on, run
from reflexr.core import Run
from reflexr.workspace import Reaction, Reactor, WorkspaceRef
from reflexr.workspace import Workspaces as RuleWorkspaces
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from relayr import metrics
from relayr.actions import acting
from relayr.application import Application, open_storage
from relayr.bridge import Bridge
from relayr.core.allowlist import Allowlists
from relayr.ledger import WorkspaceKey
from relayr.runtime import Runtime
from relayr.settings import Settings
from tests.builders import Gates
from tests.services import SQL_STORAGES

TENANT, WORKSPACE = "acme", "ops"
REF = WorkspaceRef(TENANT, WORKSPACE)
KEY = WorkspaceKey(TENANT, WORKSPACE)
WAIT_S = 30.0
"""How long a gate may take to open: far above what any step needs."""


class RetriesTestEvent(Event, abstract=True, event_namespace="retriestest"):
    pass


class Once(RetriesTestEvent, name="once"):
    """``mode``: ok, or wait (on the gate)."""

    mode: str = "ok"


class Ordered(RetriesTestEvent, name="ordered"):
    key: str
    mode: str = "ok"


class Noticed(RetriesTestEvent, name="noticed"):
    """A notice in ``thread_id``; the first attempt fails after it, a later one ``then``s:
    waits on the gate (``hold``) or ends (``end``)."""

    thread_id: str
    then: str


RULES = [
    Rule(
        name="retries:once",
        when=on(Once),
        then=run("work"),
        ordering="none",
        start="beginning",
        retry=RetryPolicy(max_attempts=1),
    ),
    Rule(
        name="retries:ordered",
        when=on(Ordered),
        scope=by(F.key),
        then=run("work"),
        ordering="scope",
        start="beginning",
        retry=RetryPolicy(max_attempts=2, backoff=timedelta(hours=1)),
    ),
    Rule(
        name="retries:noticed",
        when=on(Noticed),
        then=run("notify"),
        ordering="none",
        start="beginning",
        retry=RetryPolicy(max_attempts=3, backoff=timedelta(hours=1)),
    ),
]


def _gates(reaction: Reaction[Bridge]) -> Gates:
    gates = reaction.deps.app
    assert isinstance(gates, Gates)
    return gates


async def work(reaction: Reaction[Bridge]) -> None:
    gates = _gates(reaction)
    gates.calls += 1
    if reaction.events[-1].data.get("mode") == "wait":
        gates.started.set()
        await asyncio.wait_for(gates.release.wait(), WAIT_S)


async def notify(reaction: Reaction[Bridge]) -> None:
    data = reaction.events[-1].data
    await acting(reaction).notice("deploy held", thread_id=data["thread_id"])
    if reaction.attempt == 1:
        raise RuntimeError("failed after its notice")
    if data["then"] == "hold":
        gates = _gates(reaction)
        gates.started.set()
        await asyncio.wait_for(gates.release.wait(), WAIT_S)


ACTIONS: dict[str, Any] = {"work": work, "notify": notify}


@dataclass
class FailingStatements:
    """Fails the statements that match, after the first ``skip``, as the database driver
    would: ``times`` of them (a step tried again), or every one (a step that keeps failing)."""

    pattern: re.Pattern[str]
    skip: int = 0
    times: int | None = None
    fired: int = 0

    def before(self, connection: Any, cursor: Any, statement: str, *_: Any) -> None:
        if self.pattern.search(statement):
            if self.skip:
                self.skip -= 1
                return
            if self.times is not None and self.fired >= self.times:
                return
            self.fired += 1
            raise connection.dialect.loaded_dbapi.OperationalError("database is locked (injected)")

    @contextmanager
    def attached(self, engine: AsyncEngine) -> Iterator["FailingStatements"]:
        event.listen(engine.sync_engine, "before_cursor_execute", self.before)
        try:
            yield self
        finally:
            event.remove(engine.sync_engine, "before_cursor_execute", self.before)


class Harness:
    """A worker's runtime on real storage, and a way to make runs as the dispatcher would."""

    def __init__(self, settings: Settings, runtime: Runtime, engine: AsyncEngine | None) -> None:
        self.settings = settings
        self.runtime = runtime
        self.engine = engine
        self.rules = runtime.application.rules
        self.reactor = Reactor(self.rules, actions=ACTIONS)  # it only evaluates here
        gates = runtime.application.app_deps
        assert isinstance(gates, Gates)
        self.gates = gates

    async def fire(self, event: Event) -> str:
        """Publish an event, evaluate, and return the id of the run it made."""
        source = await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
        published = await source.publish(event)
        await self.reactor.evaluate()
        [made] = [r for r in await source.runs(limit=1000) if published.envelope.seq in r.matched]
        return made.id

    async def run(self, run_id: str) -> Run:
        source = await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
        return await source.run(run_id)

    async def facts(self, run_id: str) -> list[str]:
        """The ``reflexr:run_*`` facts of a run, in log order."""
        return [
            e.event_type.removeprefix("reflexr:")
            for e in await self.rules.storage.read(REF)
            if getattr(e.event, "run_id", None) == run_id
        ]

    async def thread(self) -> str:
        handle = await self.runtime.application.artifacts.open(
            TENANT, WORKSPACE, actor=UserActor(id="alice")
        )
        return (await handle.create_thread("retries")).id

    async def operator(self) -> Any:
        return await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="operator"))

    def other_worker(self, **settings: Any) -> Runtime:
        """Another process's runtime over the same storage: its own lease holder."""
        return dataclasses.replace(
            self.runtime,
            holder=f"{self.runtime.holder}-other",
            executing=set(),
            settings=self.settings.changed(**settings),
        )

    def storage_engine(self) -> AsyncEngine:
        assert self.engine is not None, "this test needs SQL storage"
        return self.engine


@asynccontextmanager
async def opened(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    """A harness on ``database_url``, its runtime closed after the block."""
    settings = Settings(home=tmp_path, database_url=database_url, lease_ttl_s=5, turn_grace_s=0)
    storage = await open_storage(settings)
    application = Application(
        artifacts=ArtifactWorkspaces(storage.artifacts),
        rules=RuleWorkspaces(storage.rules, events=[Once, Ordered, Noticed], rules=RULES),
        actions=ACTIONS,
        app_deps=Gates(),
        engines=storage.engines,
    )
    runtime = await Runtime.start(
        settings, role="worker", application=application, allowlists=Allowlists.empty
    )
    try:
        yield Harness(settings, runtime, storage.engine)
    finally:
        await runtime.aclose()


SQL = pytest.mark.parametrize("database_url", SQL_STORAGES, indirect=True)
"""For the tests of commits: in-memory storage commits nothing."""


RUNS_SAVED = re.compile(r"UPDATE reflexr_runs")
"""A claim's and a completion's transactions save runs; the lease's do not."""


def sample(name: str, **labels: str) -> float:
    """The current value of one sample of this process's metrics (0 when absent)."""
    return metrics.registry().get_sample_value(name, labels) or 0.0
