"""What the executor's tests share: a worker's runtime on real reflexr storage (in memory, SQLite,
PostgreSQL), the rules and actions its runs execute, and a way to make runs as the dispatcher
would.

Runs are created the way production creates them (reflexr's Reactor evaluates published
events) and executed through ``execute_run`` as a worker would; :class:`Harness` reads what the
store holds afterwards: the run, and the ``reflexr:run_*`` facts in the log. The tests are in
tests/execution/test_executor_outcomes.py, tests/execution/test_executor_leases.py and
tests/execution/test_executor_batches.py.
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Self

import pytest
from artifactr import Workspaces as ArtifactWorkspaces
from reflexr import Event, F, RetryPolicy, Rule, SourceActor, by, on, run
from reflexr.core import Run
from reflexr.workspace import Reaction, Reactor, RunFailure, WorkspaceRef
from reflexr.workspace import Workspaces as RuleWorkspaces

from relayr.core.allowlist import Allowlists
from relayr.execution.executor import Executed, execute_run
from relayr.runtime.application import Application, SharedStorage, open_storage
from relayr.runtime.bridge import Bridge
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tests.builders import Gates
from tests.services import STORAGES, storage_url

TENANT, WORKSPACE = "acme", "ops"
REF = WorkspaceRef(TENANT, WORKSPACE)
BACKOFF = timedelta(milliseconds=400)


class ExecTestEvent(Event, abstract=True, event_namespace="exectest"):
    pass


class Asked(ExecTestEvent, name="asked"):
    """``mode`` says what the action does: ok, fail, permanent, wait, slow, not_json,
    own_timeout (a TimeoutError of its own)."""

    mode: str


class Keyed(ExecTestEvent, name="keyed"):
    key: str
    mode: str = "ok"


class Timed(ExecTestEvent, name="timed"):
    pass


RULES = [
    Rule(
        name="exec:work",
        when=on(Asked),
        then=run("work"),
        ordering="none",
        start="beginning",
        retry=RetryPolicy(max_attempts=2, backoff=BACKOFF),
    ),
    Rule(
        name="exec:ordered",
        when=on(Keyed),
        scope=by(F.key),
        then=run("work"),
        ordering="scope",
        start="beginning",
        retry=RetryPolicy(max_attempts=2, backoff=BACKOFF),
    ),
    Rule(
        name="exec:timed",
        when=on(Timed),
        then=run("slow"),
        start="beginning",
        timeout=timedelta(milliseconds=300),
        retry=RetryPolicy(max_attempts=3, backoff=BACKOFF),
    ),
]


def _gates(reaction: Reaction[Bridge]) -> Gates:
    gates = reaction.deps.app
    assert isinstance(gates, Gates)
    return gates


async def work(reaction: Reaction[Bridge]) -> object:
    gates = _gates(reaction)
    gates.calls += 1
    mode = reaction.events[-1].data.get("mode", "ok")
    if mode == "fail":
        raise RuntimeError("flaky")
    if mode == "permanent":
        raise RunFailure("will not do that", reason="bad_input", permanent=True)
    if mode == "wait":
        gates.started.set()
        await gates.release.wait()
    if mode == "not_json":
        return object()
    if mode == "own_timeout":
        raise TimeoutError("the upstream API timed out")
    return {"attempt": reaction.attempt, "rule": reaction.rule.name}


async def slow(reaction: Reaction[Bridge]) -> None:
    await asyncio.sleep(30)


ACTIONS = {"work": work, "slow": slow}


class Harness:
    """A worker's runtime on real storage, and a way to make runs as the dispatcher would.

    Its application is :data:`EVENTS`, :data:`RULES` and :data:`ACTIONS`; a harness of other
    tests names its own (:class:`tests.execution.retries_harness.Harness`).
    """

    EVENTS: ClassVar[list[type[Event]]] = [Asked, Keyed, Timed]
    RULES: ClassVar[list[Rule]] = RULES
    ACTIONS: ClassVar[dict[str, Any]] = ACTIONS

    def __init__(self, settings: Settings, storage: SharedStorage, runtime: Runtime) -> None:
        self.settings = settings
        self.storage = storage
        self.runtime = runtime
        self.application = runtime.application
        self.rules = self.application.rules
        self.reactor = Reactor(self.rules, actions=self.ACTIONS)  # it only evaluates here
        gates = self.application.app_deps
        assert isinstance(gates, Gates)
        self.gates = gates

    @classmethod
    async def open(cls, settings: Settings) -> Self:
        storage = await open_storage(settings)
        application = Application(
            artifacts=ArtifactWorkspaces(storage.artifacts),
            rules=RuleWorkspaces(storage.rules, events=cls.EVENTS, rules=cls.RULES),
            actions=cls.ACTIONS,
            app_deps=Gates(),
            engines=storage.engines,
        )
        runtime = await Runtime.start(
            settings, role="worker", application=application, allowlists=Allowlists.empty
        )
        return cls(settings, storage, runtime)

    async def fire(self, event: Event) -> str:
        """Publish an event, evaluate, and return the id of the run it made."""
        source = await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
        published = await source.publish(event)
        await self.reactor.evaluate()
        [made] = [r for r in await source.runs(limit=1000) if published.envelope.seq in r.matched]
        return made.id

    async def execute(self, run_id: str, runtime: Runtime | None = None) -> Executed:
        return await execute_run(runtime or self.runtime, TENANT, WORKSPACE, run_id)

    async def run(self, run_id: str) -> Run:
        source = await self.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="test"))
        return await source.run(run_id)

    async def facts(self, run_id: str) -> list[str]:
        """The ``reflexr:run_*`` facts of a run, in log order."""
        envelopes = await self.rules.storage.read(REF)
        return [
            e.event_type.removeprefix("reflexr:")
            for e in envelopes
            if getattr(e.event, "run_id", None) == run_id
        ]

    async def head(self) -> int:
        return await self.rules.storage.head_seq(REF)

    def other_worker(self, **settings: Any) -> Runtime:
        """Another process's runtime over the same storage: its own lease holder."""
        return dataclasses.replace(
            self.runtime,
            holder=f"{self.runtime.holder}-other",
            executing=set(),
            settings=self.settings.changed(**settings),
        )

    def redeployed(self, application: Application) -> Runtime:
        """This worker after a deploy changed the application's actions or rules."""
        return dataclasses.replace(self.runtime, application=application, executing=set())

    async def aclose(self) -> None:
        await self.runtime.aclose()

    @classmethod
    @asynccontextmanager
    async def opened(cls, database_url: str, tmp_path: Path) -> AsyncIterator[Self]:
        """A harness on ``database_url``, closed after the block."""
        settings = Settings(home=tmp_path, database_url=database_url, lease_ttl_s=5, turn_grace_s=0)
        harness = await cls.open(settings)
        try:
            yield harness
        finally:
            await harness.aclose()


@pytest.fixture(params=STORAGES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return storage_url(request, tmp_path)


@pytest.fixture
async def harness(database_url: str, tmp_path: Path) -> AsyncIterator[Harness]:
    async with Harness.opened(database_url, tmp_path) as harness:
        yield harness
