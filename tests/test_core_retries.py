"""The executor's steps when a fault hides what happened, and what a message holds while it runs.

On real storage (SQLite and PostgreSQL), a COMMIT takes effect and then the step raises, as a
connection lost while PostgreSQL committed would (:class:`LostAfterCommit`, a wrapper around
the dialect's ``do_commit``): relayr tries the step again, which must find its own work, not
take it for another executor's. Then what a message must not keep to itself (the leases of
runs it did not start, the mark of a run another executor holds), what it must not lose (the
ledger rows of an attempt that was interrupted, or whose completion failed for good), and what
it must say (a run of a scope it found abandoned). Every fault and every "meanwhile" is made
by the test: an injected error, a gate the action waits on, a store the test writes.
"""

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from artifactr import UserActor
from artifactr import Workspaces as ArtifactWorkspaces
from reflexr import Event, F, RetryPolicy, Rule, SourceActor, by, on, run
from reflexr.core import Run, start
from reflexr.workspace import Reaction, Reactor, WorkspaceRef, run_lease
from reflexr.workspace import Workspaces as RuleWorkspaces
from sqlalchemy import event
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine
from tenacity import AsyncRetrying, RetryCallState

from relayr import metrics, transient
from relayr.actions import acting
from relayr.application import Application, open_storage
from relayr.bridge import Bridge
from relayr.core.allowlist import Allowlists
from relayr.executor import execute_run, execute_runs, fail_run
from relayr.ledger import WorkspaceKey
from relayr.runtime import Runtime
from relayr.settings import Settings
from tests.builders import Gates
from tests.services import SQL_STORAGES, STORAGES, storage_url

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
class LostAfterCommit:
    """Lets the COMMIT of a transaction that ran a matching statement take effect, then raises
    the driver's ``OperationalError``, once, as a connection lost during COMMIT would."""

    pattern: re.Pattern[str]
    skip: int = 0
    """Matching transactions to let through before the one that fails."""
    fired: int = 0
    _marked: set[int] = field(default_factory=set)

    def before(self, connection: Any, cursor: Any, statement: str, *_: Any) -> None:
        if self.pattern.search(statement):
            self._marked.add(id(connection.connection))

    @contextmanager
    def attached(self, engine: AsyncEngine) -> Iterator["LostAfterCommit"]:
        dialect: Any = engine.sync_engine.dialect
        commit = dialect.do_commit

        def do_commit(dbapi_connection: Any) -> None:
            commit(dbapi_connection)
            if id(dbapi_connection) not in self._marked:
                return
            self._marked.discard(id(dbapi_connection))
            if self.skip:
                self.skip -= 1
            elif not self.fired:
                self.fired += 1
                raise dialect.loaded_dbapi.OperationalError("connection lost in commit (injected)")

        dialect.do_commit = do_commit
        event.listen(engine.sync_engine, "before_cursor_execute", self.before)
        try:
            yield self
        finally:
            event.remove(engine.sync_engine, "before_cursor_execute", self.before)
            del dialect.do_commit


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


@pytest.fixture(params=STORAGES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return storage_url(request, tmp_path)


SQL = pytest.mark.parametrize("database_url", SQL_STORAGES, indirect=True)
"""For the tests of commits: in-memory storage commits nothing."""


@pytest.fixture
async def harness(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
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


# ─── a commit that took effect behind a fault ────────────────────────────────

RUNS_SAVED = re.compile(r"UPDATE reflexr_runs")
"""A claim's and a completion's transactions save runs; the lease's do not."""


@SQL
@pytest.mark.parametrize(("step", "skip"), [("claim", 0), ("completion", 1)])
async def test_a_step_whose_commit_took_effect_behind_a_fault_is_not_done_twice(
    harness: Harness, step: str, skip: int
) -> None:
    """The rule allows one attempt: a claim that took its own attempt for an abandoned one
    would leave the run dead without running it; a completion that found its run finished
    would report it dropped."""
    run_id = await harness.fire(Once())

    with LostAfterCommit(RUNS_SAVED, skip=skip).attached(harness.storage_engine()) as fault:
        [executed] = await execute_runs(harness.runtime, TENANT, WORKSPACE, [run_id])

    assert fault.fired == 1
    assert executed.outcome == "succeeded", executed.detail
    stored = await harness.run(run_id)
    assert (stored.status, stored.attempts, stored.epoch) == ("succeeded", 1, 1)
    assert await harness.facts(run_id) == ["run_started", "run_succeeded"]
    assert harness.gates.calls == 1


@SQL
async def test_a_completion_that_started_the_next_run_behind_a_fault_does_not_abandon_it(
    harness: Harness,
) -> None:
    first = await harness.fire(Ordered(key="api"))
    second = await harness.fire(Ordered(key="api"))

    with LostAfterCommit(RUNS_SAVED, skip=1).attached(harness.storage_engine()) as fault:
        executed = await execute_runs(harness.runtime, TENANT, WORKSPACE, [first])

    assert fault.fired == 1
    assert [(e.outcome, e.run_id) for e in executed] == [
        ("succeeded", first),
        ("succeeded", second),
    ]
    for run_id in (first, second):
        assert await harness.facts(run_id) == ["run_started", "run_succeeded"]
    assert harness.gates.calls == 2


@SQL
async def test_fail_run_whose_commit_took_effect_behind_a_fault_says_dead(
    harness: Harness,
) -> None:
    run_id = await harness.fire(Once())

    with LostAfterCommit(RUNS_SAVED).attached(harness.storage_engine()) as fault:
        failed = await fail_run(
            harness.runtime, TENANT, WORKSPACE, run_id, reason="worker_lost", error="killed"
        )

    assert fault.fired == 1
    assert failed.outcome == "dead"
    assert await harness.facts(run_id) == ["run_started", "run_dead_lettered"]


@SQL
async def test_a_claim_tried_again_counts_its_dispatch_lag_once(harness: Harness) -> None:
    """The first try rolled back: only the start that committed is counted."""
    run_id = await harness.fire(Once())
    lags = _sample("relayr_dispatch_lag_seconds_count")
    facts_appended = re.compile(r"INSERT INTO reflexr_events")

    with FailingStatements(facts_appended, times=1).attached(harness.storage_engine()) as fault:
        [executed] = await execute_runs(harness.runtime, TENANT, WORKSPACE, [run_id])

    assert (fault.fired, executed.outcome) == (1, "succeeded")
    assert _sample("relayr_dispatch_lag_seconds_count") == lags + 1


def _sample(name: str, **labels: str) -> float:
    return metrics.registry().get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(("tries", "wait_s"), [(1, 0.05), (2, 0.1), (3, 0.2), (5, 0.5), (60, 0.5)])
def test_the_wait_after_a_try_doubles_from_the_first_up_to_the_bound(
    tries: int, wait_s: float
) -> None:
    """Three tries wait 0.05 s, then 0.1 s (the bound, 0.5 s, only after more tries)."""
    state = RetryCallState(retry_object=AsyncRetrying(), fn=None, args=(), kwargs={})
    state.attempt_number = tries
    assert transient.WAIT(state) == pytest.approx(wait_s)
    assert transient.BACKOFF_S == (0.05, 0.5)


# ─── what a message releases at once ─────────────────────────────────────────


async def test_a_later_run_of_a_scope_named_in_the_same_message_goes_on(
    harness: Harness,
) -> None:
    """It is not first in its scope when claimed; its lease is released then, so the message
    takes it again when the run before it ends."""
    first = await harness.fire(Ordered(key="api"))
    second = await harness.fire(Ordered(key="api"))

    executed = await execute_runs(harness.runtime, TENANT, WORKSPACE, [first, second])

    assert [(e.outcome, e.run_id) for e in executed] == [
        ("succeeded", first),
        ("succeeded", second),
    ]
    assert harness.runtime.executing == set()


async def test_a_run_the_message_did_not_start_is_free_for_another_delivery(
    harness: Harness,
) -> None:
    holding = await harness.fire(Once(mode="wait"))
    finished = await harness.fire(Once())
    assert (await execute_run(harness.runtime, TENANT, WORKSPACE, finished)).outcome == (
        "succeeded"
    )
    message = asyncio.create_task(
        execute_runs(harness.runtime, TENANT, WORKSPACE, [holding, finished])
    )
    await asyncio.wait_for(harness.gates.started.wait(), WAIT_S)

    elsewhere = await execute_run(harness.other_worker(), TENANT, WORKSPACE, finished)
    here = await execute_run(harness.runtime, TENANT, WORKSPACE, finished)
    harness.gates.release.set()
    executed = await asyncio.wait_for(message, WAIT_S)

    assert (elsewhere.outcome, here.outcome) == ("not_due", "not_due")
    assert [e.outcome for e in executed] == ["succeeded", "not_due"]


async def test_a_run_another_executor_held_is_not_marked_as_executed_here(
    harness: Harness,
) -> None:
    holding = await harness.fire(Once(mode="wait"))
    contended = await harness.fire(Once())
    storage = harness.rules.storage
    ttl = timedelta(minutes=5)
    assert await storage.acquire_lease(REF, run_lease(contended), "other-worker", ttl)
    message = asyncio.create_task(
        execute_runs(harness.runtime, TENANT, WORKSPACE, [holding, contended])
    )
    await asyncio.wait_for(harness.gates.started.wait(), WAIT_S)

    marked = (TENANT, WORKSPACE, contended) in harness.runtime.executing
    await storage.release_lease(REF, run_lease(contended), "other-worker")
    redelivered = await execute_run(harness.runtime, TENANT, WORKSPACE, contended)
    harness.gates.release.set()
    executed = await asyncio.wait_for(message, WAIT_S)

    assert not marked
    assert redelivered.outcome == "succeeded", redelivered.detail
    assert [e.outcome for e in executed] == ["succeeded", "contended"]


# ─── what a message reports and keeps ────────────────────────────────────────


async def test_the_next_run_of_a_scope_found_abandoned_is_reported(harness: Harness) -> None:
    """Another worker took the scope's next run meanwhile and died: going on with the scope,
    the message takes its lapsed lease and records its attempt abandoned, and says so."""
    first = await harness.fire(Ordered(key="api", mode="wait"))
    second = await harness.fire(Ordered(key="api"))
    message = asyncio.create_task(execute_runs(harness.runtime, TENANT, WORKSPACE, [first]))
    await asyncio.wait_for(harness.gates.started.wait(), WAIT_S)
    async with harness.rules.storage.transaction(REF) as transaction:
        waiting = await transaction.run(second)
        assert waiting is not None
        await transaction.save_runs([start(waiting, now=harness.rules.clock())[0]])

    abandoned = _sample("relayr_runs_executed_total", rule="retries:ordered", outcome="abandoned")

    harness.gates.release.set()
    executed = await asyncio.wait_for(message, WAIT_S)

    assert [(e.outcome, e.run_id) for e in executed] == [
        ("succeeded", first),
        ("abandoned", second),
    ]
    assert _sample("relayr_runs_executed_total", rule="retries:ordered", outcome="abandoned") == (
        abandoned + 1
    )
    stored = await harness.run(second)
    assert (stored.status, stored.reason) == ("retrying", "abandoned")
    assert harness.runtime.executing == set()


async def _posted_then_retried(harness: Harness, then: str) -> str:
    """A run whose first attempt posted its notice and failed, made due again by an
    operator: its next attempt finds the notice posted (``already_posted``), a ledger row
    that only the run's completion carries."""
    thread = await harness.thread()
    run_id = await harness.fire(Noticed(thread_id=thread, then=then))
    assert (await execute_run(harness.runtime, TENANT, WORKSPACE, run_id)).outcome == "retrying"
    await (await harness.operator()).retry_run(run_id)
    return run_id


async def test_an_interrupted_attempt_keeps_the_ledger_rows_of_its_writes(
    harness: Harness,
) -> None:
    run_id = await _posted_then_retried(harness, "hold")
    worker = harness.other_worker(lease_ttl_s=0.3)  # a renewal finds the cancel soon
    message = asyncio.create_task(execute_run(worker, TENANT, WORKSPACE, run_id))
    await asyncio.wait_for(harness.gates.started.wait(), WAIT_S)

    await (await harness.operator()).cancel_run(run_id)
    executed = await asyncio.wait_for(message, WAIT_S)

    assert executed.outcome == "interrupted"
    records = await harness.runtime.bridge.ledger.emissions(KEY, run_id)
    assert [(r.epoch, r.outcome) for r in records] == [(1, "posted"), (2, "already_posted")]


@SQL
async def test_a_completion_that_fails_for_good_still_writes_the_ledger_rows(
    harness: Harness,
) -> None:
    run_id = await _posted_then_retried(harness, "end")

    failing = FailingStatements(RUNS_SAVED, skip=1)  # the claim's
    with (
        failing.attached(harness.storage_engine()) as fault,
        pytest.raises(OperationalError, match="database is locked"),
    ):
        await execute_run(harness.runtime, TENANT, WORKSPACE, run_id)

    assert fault.fired == 3  # the completion's tries; the rows' own write saves no run
    records = await harness.runtime.bridge.ledger.emissions(KEY, run_id)
    assert [(r.epoch, r.outcome) for r in records] == [(1, "posted"), (2, "already_posted")]
    assert (await harness.run(run_id)).status == "running"  # left to the next claim
