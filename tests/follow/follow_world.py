"""The inbound side's test world: a runtime on real storage (in memory, SQLite, PostgreSQL), its
followers and a dispatcher, and the loop that settles it in one process.

:meth:`World.settle` drives the whole loop as the dispatcher and a worker would: follow every
workspace, evaluate the rules and hand due runs to the executor, let the agent's turns end, and
again, until nothing moves. Tests then check what the stores hold (tests/follow/test_follow.py,
tests/follow/test_follow_chains.py).
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from artifactr import UserActor
from artifactr import Workspaces as ArtifactWorkspaces
from artifactr.core import MessagePosted as ArtifactrMessagePosted
from reflexr import SourceActor
from reflexr.core import Envelope
from reflexr.workspace import Workspace as RuleWorkspace

from relayr.core.allowlist_toml import parse_allowlist
from relayr.core.run_messages import RunMessage
from relayr.dispatch.dispatcher import Dispatcher
from relayr.execution.executor import execute_runs
from relayr.follow.config import Inbound
from relayr.follow.follower import Followers
from relayr.follow.projections import Projection
from relayr.follow.reports import Followed
from relayr.follow.store import FollowStore, InMemoryFollowStore, SqlFollowStore
from relayr.ledger.port import WorkspaceKey
from relayr.runtime.application import Application, open_storage
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tests.follow.follow_app import ACTIONS, ALLOWLIST, agent, rule_workspaces
from tests.workers import TURNS_SETTLE_S

TENANT, WORKSPACE = "acme", "ops"
KEY = WorkspaceKey(TENANT, WORKSPACE)
PERSON = UserActor(id="alice")
SETTLE_ROUNDS: Final = 60


@dataclass
class World:
    """A runtime on real storage, its followers and dispatcher, and the loop that settles."""

    runtime: Runtime
    store: FollowStore
    hooks: list[Any] = field(default_factory=list)
    followers: Followers = field(init=False)
    dispatcher: Dispatcher = field(init=False)

    def __post_init__(self) -> None:
        self.followers = self.follower()

        async def empty() -> int:
            return 0

        self.dispatcher = Dispatcher(self.runtime, queue_depth=empty, follow=False)

    def follower(
        self,
        holder: str = "follower-1",
        projections: dict[str, Projection] | None = None,
        tenants: Sequence[str] = (TENANT,),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> Followers:
        application = self.runtime.application

        async def after_publish(workspace: WorkspaceKey, seqs: Sequence[int]) -> None:
            for hook in self.hooks:
                await hook(workspace, seqs)

        return Followers(
            artifacts=application.artifacts,
            rules=application.rules,
            ledger=self.runtime.bridge.ledger,
            store=self.store,
            holder=holder,
            lease_ttl_s=30.0,
            monotonic=monotonic,
            inbound=Inbound(
                tenants=tenants, projections=projections or {}, after_publish=after_publish
            ),
        )

    async def thread(self) -> str:
        handle = await self.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
        return (await handle.create_thread("incident")).id

    async def publish(self, *events: Any) -> None:
        source = await self.rules()
        await source.publish_many(list(events))

    async def rules(self) -> RuleWorkspace:
        return await self.runtime.application.rules.open(
            TENANT, WORKSPACE, actor=SourceActor(name="test")
        )

    async def settle(self, *, follow: bool = True) -> Followed:
        """Follow (unless told not to), dispatch and execute until a round moves nothing; what
        following did."""
        total = Followed()
        queue: list[RunMessage] = []

        async def enqueue(batch: RunMessage) -> None:
            queue.append(batch)

        for _ in range(SETTLE_ROUNDS):
            followed = await self.followers.follow_all() if follow else Followed()
            total += followed
            queue.clear()
            await self.dispatcher.pass_once(enqueue)
            for batch in queue:
                await execute_runs(
                    self.runtime, batch.tenant_id, batch.workspace_id, list(batch.run_ids)
                )
            turns = await self.turns_ended()
            if not (followed.read or queue or turns):
                return total
        raise AssertionError("the world did not settle")

    async def turns_ended(self) -> int:
        """Wait for the turns this runtime started, and those they handed their threads over
        to; how many there were."""
        turns = self.runtime.bridge.turns
        waited = 0
        async with asyncio.timeout(TURNS_SETTLE_S):
            while pending := turns.pending():
                waited += len(turns.running())
                await asyncio.wait(pending)
        return waited

    async def bridged(self) -> list[Envelope]:
        """The bridged events in reflexr's log, in order."""
        handle = await self.rules()
        return [
            envelope
            for envelope in await handle.read(after_seq=0, limit=10_000)
            if envelope.event_type.startswith("artifactr:")
        ]

    async def notices(self, rule: str) -> list[str]:
        handle = await self.runtime.application.artifacts.open(TENANT, WORKSPACE, actor=PERSON)
        return [
            envelope.event.content
            for envelope in await handle.read()
            if isinstance(envelope.event, ArtifactrMessagePosted)
            and envelope.actor.participant == f"external_agent:reflexr:{rule}"
        ]


@asynccontextmanager
async def opened(database_url: str, tmp_path: Path) -> AsyncIterator[World]:
    """A world on ``database_url``, closed after the block."""
    settings = Settings(home=tmp_path, database_url=database_url, turn_grace_s=5)
    storage = await open_storage(settings)
    application = Application(
        artifacts=ArtifactWorkspaces(storage.artifacts),
        rules=rule_workspaces(storage.rules),
        actions=ACTIONS,
        agent=agent(),
        engines=storage.engines,
    )
    allowlists = parse_allowlist(ALLOWLIST)
    runtime = await Runtime.start(
        settings, role="worker", application=application, allowlists=lambda: allowlists
    )
    store = SqlFollowStore(storage.engine) if storage.engine else InMemoryFollowStore()
    try:
        yield World(runtime, store)
    finally:
        await runtime.aclose()
