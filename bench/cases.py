"""The end-to-end case engine: one case's storage, workers, publisher, dispatcher and figures.

:func:`run_case` runs a :class:`Case` (its storage, ``celery worker`` processes, the publisher
and the dispatcher in this process) and returns its figures; :mod:`bench.end_to_end`,
:mod:`bench.targets`, :mod:`bench.transactions` and :mod:`bench.memory` run their cases through
it. What each figure means is said in :mod:`bench.end_to_end`.
"""

import asyncio
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Literal

from artifactr.core import CreateThread
from reflexr import SourceActor
from reflexr.core import load_event

from bench.common import (
    APPS,
    PROFILE_MARKER,
    STORAGES,
    CaseStorage,
    EngineCounter,
    Ordering,
    StorageKind,
    build_example,
    case_storage,
    fresh_home,
    machine,
    note,
)
from bench.figures import Probe, count_outcomes, profile_summary, round_figures
from bench.stamps import NoticeWatch
from bench.workers import ALLOWLIST, RelayrProcess, relayr_environment, start_worker
from relayr.core.run_messages import RunMessage
from relayr.demo import CLI_USER, DEPLOYS_PER_THREAD
from relayr.dispatch.changes import Changes
from relayr.dispatch.dispatcher import Dispatcher, DispatchPass, Enqueue
from relayr.runtime.process import Runtime
from relayr.settings import Settings
from tasks.runs import send_runs

type WorkerMode = Literal["prefork", "separate"]

PUBLISHER: Final = SourceActor(name="relayr-bench")

DISPATCH_INTERVAL_S: Final = 0.5
"""The dispatcher's pass interval, as in the demo and the tests (the default is 1 s)."""


@dataclass(frozen=True)
class Case:
    """One measurement: a storage, how many events, how many workers, where, in what order.

    ``batches`` splits the events into rounds, measured one after the other on the same
    workers (:mod:`bench.memory`); by default one round of ``n``.
    """

    storage: StorageKind = "sqlite"
    n: int = 1000
    workers: int = 1
    worker_mode: WorkerMode = "prefork"
    workspaces: int = 1
    ordering: Ordering = "none"
    rate: float | None = None
    dispatch_interval_s: float = DISPATCH_INTERVAL_S
    profile: bool = False
    timeout_s: float | None = None
    batches: tuple[int, ...] = field(default=())
    follow: bool = True
    """Whether the dispatcher follows artifactr's log back into reflexr (relayr's default), as
    it does in production; False measures the outbound path alone."""
    limits: str = ""
    """``[limits.NAME]`` entries added to the example's allowlist (none: no limit binds)."""

    @property
    def rounds(self) -> tuple[int, ...]:
        return self.batches or (self.n,)

    @property
    def label(self) -> str:
        return (
            f"{self.storage}-n{self.n}-w{self.workers}{self.worker_mode[0]}-"
            f"ws{self.workspaces}-{self.ordering}{'' if self.follow else '-nofollow'}"
            f"{'-limited' if self.limits else ''}"
        )


@dataclass(frozen=True)
class Planned:
    """One event to publish: its index, workspace, thread and service (which names it)."""

    index: int
    workspace: str
    thread: str
    service: str
    status: str


class CountingDispatcher(Dispatcher):
    """relayr's dispatcher, counting its passes and the runs it enqueued again (copies)."""

    passes = 0
    copies = 0

    async def pass_once(self, enqueue: Enqueue, changes: Changes | None = None) -> DispatchPass:
        done = await super().pass_once(enqueue, changes)
        self.passes += 1
        self.copies += done.again
        return done


def workspace_names(count: int) -> list[str]:
    return ["ops"] if count == 1 else [f"ops-{index}" for index in range(count)]


async def plan_events(runtime: Runtime, names: Sequence[str], total_n: int) -> list[Planned]:
    """Create the threads (before anything is measured) and plan every event into them.

    Events go round-robin to the workspaces; within one, deploys share threads of
    :data:`relayr.demo.DEPLOYS_PER_THREAD`, as in the demo.
    """
    per_workspace: dict[str, list[int]] = {name: [] for name in names}
    for index in range(total_n):
        per_workspace[names[index % len(names)]].append(index)
    planned: list[Planned] = []
    for name, indexes in per_workspace.items():
        handle = await runtime.application.artifacts.open("bench", name, actor=CLI_USER)
        threads: list[str] = []
        for start in range(0, len(indexes), DEPLOYS_PER_THREAD):
            command = CreateThread(title=f"deploys {start // DEPLOYS_PER_THREAD + 1}")
            await handle.commit(command)
            threads.append(command.thread_id)
        for position, index in enumerate(indexes):
            planned.append(
                Planned(
                    index=index,
                    workspace=name,
                    thread=threads[position // DEPLOYS_PER_THREAD],
                    service=f"svc-{index:05d}",
                    status="failed" if index % 5 == 4 else "succeeded",
                )
            )
    return sorted(planned, key=lambda event: event.index)


async def publish(
    runtime: Runtime, events: Sequence[Planned], rate: float | None
) -> dict[str, datetime]:
    """Publish each event with its own ``publish`` call; return each one's envelope ``ts``."""
    handles = {}
    stamped: dict[str, datetime] = {}
    started = time.monotonic()
    for count, planned in enumerate(events):
        handle = handles.get(planned.workspace)
        if handle is None:
            handle = handles[planned.workspace] = await runtime.application.rules.open(
                "bench", planned.workspace, actor=PUBLISHER
            )
        if rate:
            await asyncio.sleep(max(0.0, started + count / rate - time.monotonic()))
        data = {"service": planned.service, "status": planned.status, "thread_id": planned.thread}
        event = load_event({"type": "deploy:finished", **data})
        published = await handle.publish(event, id=f"bench-{planned.index}")
        stamped[planned.service] = published.envelope.ts
    return stamped


async def _serve(runtime: Runtime, dispatcher: CountingDispatcher, stop: asyncio.Event) -> None:
    """The dispatcher's loop, enqueueing on Celery as ``relayr dispatch`` does."""
    from tasks.app import create_celery

    app = create_celery(runtime.settings)
    queue = runtime.settings.queue

    async def enqueue(batch: RunMessage) -> None:
        send_runs(app, queue, batch)

    try:
        await dispatcher.serve(enqueue, stop)
    finally:
        app.close()


async def drive(
    case: Case, settings: Settings, storage: CaseStorage, workers: Sequence[RelayrProcess]
) -> list[dict[str, Any]]:
    """Publish each round, dispatch in this process, and measure until its notices are in."""
    runtimes: dict[str, Runtime] = {}
    counters: dict[str, EngineCounter] = {}
    for label, role in (("publish", "cli"), ("dispatch", "dispatcher"), ("watch", "cli")):
        application = await build_example(settings, case.ordering)
        runtimes[label] = await Runtime.start(settings, role=role, application=application)
        counters[label] = EngineCounter(application.engines[0])
    stop = asyncio.Event()
    dispatcher = CountingDispatcher(runtimes["dispatch"], follow=case.follow)
    serving: asyncio.Task[None] | None = None
    try:
        names = workspace_names(case.workspaces)
        planned = await plan_events(runtimes["publish"], names, sum(case.rounds))
        handles = {
            name: await runtimes["watch"].application.artifacts.open("bench", name, actor=CLI_USER)
            for name in names
        }
        watch = NoticeWatch(handles)
        probe = Probe(settings.home, workers, counters, dispatcher, storage.database)
        serving = asyncio.create_task(_serve(runtimes["dispatch"], dispatcher, stop))
        await probe.idle()
        results: list[dict[str, Any]] = []
        offset = 0
        for count in case.rounds:
            events = planned[offset : offset + count]
            offset += count
            load_before = machine()["load_avg"]
            before = await probe.read()
            started = time.monotonic()
            published = await publish(runtimes["publish"], events, case.rate)
            publish_s = time.monotonic() - started
            done = await watch.until(set(published), timeout_s=case.timeout_s or 300 + count * 2.0)
            if not done:
                note(f"{case.label}: only {len(watch.seen)} of {offset} notices in time")
            await probe.idle()
            after = await probe.read()
            figures = round_figures(count, published, watch.seen, before, after, probe, publish_s)
            figures["runs_done"] = offset
            figures["load_avg"] = {"before": load_before, "after": machine()["load_avg"]}
            results.append(figures)
        succeeded = 0
        for name in names:
            handle = await runtimes["dispatch"].application.rules.open(
                "bench", name, actor=PUBLISHER
            )
            succeeded += len(await handle.runs(status="succeeded"))
        for figures in results:
            figures["runs_succeeded_total"] = succeeded
            figures["duplicates_total"] = watch.duplicates
        return results
    finally:
        stop.set()
        if serving is not None:
            await serving
        for runtime in runtimes.values():
            await runtime.aclose()


def _allowlist(home: Path, limits: str) -> dict[str, Path]:
    """The example's allowlist with ``limits`` added, as a ``Settings`` override (none if no
    limit is added: the example's own file)."""
    if not limits:
        return {}
    path = home / "allowlist.toml"
    path.write_text(f"{ALLOWLIST.read_text()}\n{limits}\n")
    return {"allowlist": path}


def run_case(case: Case, *, keep: bool = False) -> list[dict[str, Any]]:
    """Run one case on a storage of its own, with fresh workers; one figures dict per round."""
    home = fresh_home(case.label)
    if case.profile:
        (home / PROFILE_MARKER).touch()
    note(f"{case.label}: home {home}")
    results: list[dict[str, Any]] = []
    workers: list[RelayrProcess] = []
    try:
        with case_storage(case.storage) as storage:
            environment = relayr_environment(
                home,
                **_allowlist(home, case.limits),
                app=APPS[case.ordering],
                dispatch_interval_s=case.dispatch_interval_s,
                **storage.overrides,
            )
            settings = Settings.from_env(environment)
            try:
                if case.worker_mode == "prefork":
                    workers.append(start_worker(environment, home, concurrency=case.workers))
                else:
                    for _ in range(case.workers):
                        workers.append(start_worker(environment, home, concurrency=1))
                results = asyncio.run(drive(case, settings, storage, workers))
            finally:
                for worker in workers:
                    worker.stop()
        outcomes = count_outcomes(workers)
        profile = profile_summary(home, sum(case.rounds)) if case.profile else {}
    finally:
        if not keep and not case.profile:
            shutil.rmtree(home, ignore_errors=True)
    broker, database = STORAGES[case.storage]
    described = {
        "storage": case.storage,
        "broker": broker,
        "database": database,
        "worker_processes": case.workers,
        "worker_mode": (
            f"one celery worker, prefork concurrency {case.workers}"
            if case.worker_mode == "prefork"
            else f"{case.workers} celery workers, prefork concurrency 1 each"
        ),
        **{
            key: value
            for key, value in asdict(case).items()
            if key not in ("storage", "workers", "worker_mode", "batches")
        },
    }
    for figures in results:
        figures["outcomes"] = outcomes
        if profile:
            figures["profile"] = profile
    return [{**described, **figures} for figures in results]
