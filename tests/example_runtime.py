"""The example application (:mod:`rules.example`) in a worker's runtime, as the application's
tests drive it: the settings they start it with, and :class:`Example`, which publishes events,
runs the dispatcher's pass, executes the runs it enqueued and reads the threads back.

Used by tests/runtime/test_runtime_lifecycle.py, tests/runtime/test_storage_opening.py,
tests/project/test_example_application.py and tests/execution/test_worker_turns.py.
"""

from pathlib import Path

from artifactr import UserActor
from artifactr.core import MessagePosted, RunEnded
from reflexr import SourceActor

from relayr.core.run_messages import RunMessage
from relayr.dispatch.dispatcher import Dispatcher
from relayr.execution.executor import Executed, execute_runs
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from rules.example import DeployFinished, IncidentOpened
from tests.workers import ALLOWLIST

TENANT, WORKSPACE = "acme", "ops"
ALICE = UserActor(id="alice")


def settings_for(url: str, tmp_path: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "home": tmp_path,
        "database_url": url,
        "allowlist": ALLOWLIST,
        "turn_grace_s": 5,
    }
    return Settings(**{**values, **overrides})  # type: ignore[arg-type]


class Example:
    """The example application in a worker's runtime, with the dispatcher's pass."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.application = runtime.application
        self.dispatcher = Dispatcher(runtime)
        self.enqueued: list[RunMessage] = []

    async def enqueue(self, batch: RunMessage) -> None:
        self.enqueued.append(batch)

    async def thread(self, title: str) -> str:
        handle = await self.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        return (await handle.create_thread(title)).id

    async def publish(self, *events: DeployFinished | IncidentOpened) -> None:
        source = await self.application.rules.open(TENANT, WORKSPACE, actor=SourceActor(name="ci"))
        for event in events:
            await source.publish(event)

    async def work(self) -> list[Executed]:
        """One dispatcher pass, then every run it enqueued executed."""
        self.enqueued.clear()
        await self.dispatcher.pass_once(self.enqueue)
        return [
            executed
            for batch in self.enqueued
            for executed in await execute_runs(
                self.runtime, batch.tenant_id, batch.workspace_id, batch.run_ids
            )
        ]

    async def transcript(self, thread_id: str) -> list[tuple[str, str, str]]:
        """(kind, author, content) of each message in the thread, in order."""
        handle = await self.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        return [
            (env.event.kind, env.actor.participant, env.event.content)
            for env in await handle.read(threads={thread_id})
            if isinstance(env.event, MessagePosted)
        ]

    async def turns_ended(self, thread_id: str) -> list[str]:
        handle = await self.application.artifacts.open(TENANT, WORKSPACE, actor=ALICE)
        return [
            env.event.status
            for env in await handle.read(threads={thread_id})
            if isinstance(env.event, RunEnded)
        ]
