"""What the tests of the executor's steps under faults share: a worker's runtime on real
storage (in memory, SQLite, PostgreSQL) with rules of their own, a fault made in the database
driver, and the metrics they read.

A test makes every fault and every "meanwhile" itself: an error injected into the statements
that match (:class:`FailingStatements`), a gate the action waits on (:class:`tests.builders.Gates`),
a store the test writes. The tests are in tests/execution/test_commit_faults.py and
tests/execution/test_message_runs.py.
"""

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
from artifactr import UserActor
from reflexr import Event, F, RetryPolicy, Rule, SourceActor, by, on, run
from reflexr.workspace import Reaction
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from relayr.execution.actions import acting
from relayr.ledger import WorkspaceKey
from relayr.observe import metrics
from relayr.runtime.bridge import Bridge
from tests.builders import Gates
from tests.execution import executor_harness
from tests.execution.executor_harness import (
    REF as REF,  # the workspace, as the base harness names it
)
from tests.execution.executor_harness import TENANT, WORKSPACE
from tests.services import SQL_STORAGES, STORAGES, storage_url

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


class Harness(executor_harness.Harness):
    """The executor's harness (:class:`tests.execution.executor_harness.Harness`) with these
    tests' rules, a thread to write in, an operator, and the SQL engine a fault is made in."""

    EVENTS: ClassVar[list[type[Event]]] = [Once, Ordered, Noticed]
    RULES: ClassVar[list[Rule]] = RULES
    ACTIONS: ClassVar[dict[str, Any]] = ACTIONS

    async def thread(self) -> str:
        handle = await self.runtime.application.artifacts.open(
            TENANT, WORKSPACE, actor=UserActor(id="alice")
        )
        return (await handle.create_thread("retries")).id

    async def operator(self) -> Any:
        return await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="operator"))

    def storage_engine(self) -> AsyncEngine:
        assert self.storage.engine is not None, "this test needs SQL storage"
        return self.storage.engine


SQL = pytest.mark.parametrize("database_url", SQL_STORAGES, indirect=True)
"""For the tests of commits: in-memory storage commits nothing."""


RUNS_SAVED = re.compile(r"UPDATE reflexr_runs")
"""A claim's and a completion's transactions save runs; the lease's do not."""


def sample(name: str, **labels: str) -> float:
    """The current value of one sample of this process's metrics (0 when absent)."""
    return metrics.registry().get_sample_value(name, labels) or 0.0


@pytest.fixture(params=STORAGES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return storage_url(request, tmp_path)


@pytest.fixture
async def harness(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    async with Harness.opened(database_url, tmp_path) as harness:
        yield harness
