"""A world of runs for the console's tests, made on real storage by relayr's own executor.

The test process publishes events with reflexr, evaluates the rules of
:mod:`tests.console.console_app` with reflexr's Reactor, and executes runs with relayr's executor
in this process (as a worker's pool process would), until each reaches the state a test needs: dead
(``ops:backup-check`` until the home's ``fixed`` exists, ``console:hostile`` at once), dead for
a thread that does not exist, or left pending (never executed). A real ``relayr console``
process then serves it (:func:`tests.console.consoles.running_console`).
"""

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artifactr import UserActor
from reflexr import Event, SourceActor
from reflexr.workspace import Reactor, WorkspaceRef

from relayr.execution.executor import execute_run
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tests.console.console_app import HostileDue
from tests.ops.ops_app import BackupDue

ENDED = ("succeeded", "dead", "cancelled", "skipped")


@dataclass(frozen=True)
class Fired:
    """A run the world made: its workspace, id, the event that fired it and its thread."""

    where: str
    id: str
    event_id: str
    thread: str

    @property
    def tenant(self) -> str:
        return self.where.split("/")[0]

    @property
    def workspace(self) -> str:
        return self.where.split("/")[1]


@dataclass
class World:
    """The runs made, by what the tests use them for."""

    environment: dict[str, str]
    dead: list[Fired] = field(default_factory=list)
    missing_thread: list[Fired] = field(default_factory=list)
    hostile: list[Fired] = field(default_factory=list)
    pending: list[Fired] = field(default_factory=list)
    bulk: list[str] = field(default_factory=list)
    """Runs of ``acme/bulk`` left pending, many (their ids)."""
    threads: dict[str, str] = field(default_factory=dict)


def in_runtime[T](environment: dict[str, str], work: Any) -> T:
    """``await work(runtime)`` on a runtime of the environment's settings, then closed; in a
    thread of its own, so a test may call it while Playwright's sync API holds this thread's
    event loop."""

    async def main() -> T:
        runtime = await Runtime.start(Settings.from_env(environment), role="cli")
        async with runtime:
            result: T = await work(runtime)
            return result

    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(asyncio.run, main()).result()


async def thread_in(runtime: Runtime, where: str, title: str) -> str:
    tenant, workspace = where.split("/")
    handle = await runtime.application.artifacts.open(
        tenant, workspace, actor=UserActor(id="alice")
    )
    return (await handle.create_thread(title)).id


async def fire(runtime: Runtime, where: str, event: Event) -> Fired:
    """Publish ``event`` in ``where`` and evaluate: the run it fired."""
    tenant, workspace = where.split("/")
    rules = runtime.application.rules
    handle = await rules.open(tenant, workspace, actor=SourceActor(name="test"))
    published = await handle.publish(event)
    await Reactor(rules, actions=runtime.application.actions).evaluate()
    seq = published.envelope.seq
    [run] = [run for run in await handle.runs() if seq in run.matched]
    return Fired(where, run.id, published.envelope.id, getattr(event, "thread_id", ""))


async def run_to_end(runtime: Runtime, fired: Fired) -> str:
    """Execute the run's attempts as a worker would, until it ended; its status."""
    ref = WorkspaceRef(fired.tenant, fired.workspace)
    for _ in range(200):
        await execute_run(runtime, fired.tenant, fired.workspace, fired.id)
        run = await runtime.application.rules.storage.run(ref, fired.id)
        assert run is not None
        if run.status in ENDED:
            return run.status
        await asyncio.sleep(0.05)  # a retry's backoff is 200 ms
    raise AssertionError(f"run {fired.id} did not end")


def make_world(
    environment: dict[str, str],
    *,
    dead: int = 3,
    dead_elsewhere: int = 1,
    missing_thread: int = 1,
    hostile: int = 1,
    pending: int = 1,
    bulk: int = 0,
) -> World:
    """Runs in ``acme/ops`` (and ``acme/billing``, ``zeta/ops``) in the states the tests need."""
    world = World(environment)

    async def work(runtime: Runtime) -> World:
        for where in ("acme/ops", "acme/billing", "zeta/ops"):
            world.threads[where] = await thread_in(runtime, where, "backups")
        for index in range(dead + dead_elsewhere):
            where = "acme/ops" if index < dead else "acme/billing"
            fired = await fire(runtime, where, BackupDue(thread_id=world.threads[where]))
            assert await run_to_end(runtime, fired) == "dead"
            world.dead.append(fired)
        for _ in range(missing_thread):
            fired = await fire(runtime, "acme/ops", BackupDue(thread_id="thr_gone"))
            assert await run_to_end(runtime, fired) == "dead"
            world.missing_thread.append(fired)
        for _ in range(hostile):
            event = HostileDue(thread_id=world.threads["acme/ops"], payload="not a backup")
            fired = await fire(runtime, "acme/ops", event)
            assert await run_to_end(runtime, fired) == "dead"
            world.hostile.append(fired)
        for _ in range(pending):
            event = HostileDue(thread_id=world.threads["zeta/ops"], payload="waits")
            world.pending.append(await fire(runtime, "zeta/ops", event))
        if bulk:
            rules = runtime.application.rules
            handle = await rules.open("acme", "bulk", actor=SourceActor(name="test"))
            await handle.publish_many(
                [HostileDue(thread_id="thr_bulk", payload=f"{n}") for n in range(bulk)]
            )
            await Reactor(rules, actions=runtime.application.actions).evaluate()
            world.bulk = [run.id for run in await handle.runs()]
        return world

    return in_runtime(environment, work)


def execute(environment: dict[str, str], runs: Sequence[Fired]) -> list[str]:
    """Run each of ``runs`` to its end in this process (after a retry made it due)."""

    async def work(runtime: Runtime) -> list[str]:
        return [await run_to_end(runtime, fired) for fired in runs]

    return in_runtime(environment, work)


def home_of(environment: dict[str, str]) -> Path:
    return Path(environment["RELAYR_HOME"])
