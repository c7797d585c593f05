"""End to end: ``deploy:finished`` events published, notices committed by real workers.

``python -m bench.end_to_end`` (``make bench``) measures, for each case, how fast the example
application turns published events into committed notices: one ``deploy:finished`` event per
``publish`` call (one SQL transaction each, as a source publishes), the dispatcher in this
process (reflexr's evaluation, then each due run enqueued on Celery), and ``celery worker``
processes (:mod:`bench.workers`) executing the runs. Every case has a storage of its own
(:func:`bench.common.case_storage`).

Figures, per case, one JSON object per line on stdout:

- ``runs_per_s`` and ``ms_per_run``: the case's events over the time from the first event's
  publish (the reflexr envelope's ``ts``) to the last notice's commit (the artifactr envelope's
  ``ts``): both stamped by the storage's writers, so polling adds nothing to them;
- ``latency_ms``: each event's notice ``ts`` minus its publish ``ts``, p50/p95/p99/max. Events
  are published as fast as one publisher can (a burst), unless ``--rate`` paces them, so in a
  burst the latency is mostly the wait in the queue;
- ``transactions``: SQL transactions (``begin`` events of each engine), per run in the workers
  (every pool process counts its own, :func:`bench.common.create_app`), per publish, per
  dispatcher pass, and the benchmark's own polling apart;
- ``cpu_ms_per_run``: CPU time used per run by the workers' main processes, their pool
  processes, this process (publisher, dispatcher, poller) and PostgreSQL's backends;
- ``rss_kib``: each pool process's peak (``VmHWM``) and current RSS after the case;
- ``outcomes``: what the workers' run tasks did (``succeeded``, and declined duplicates);
- ``copies``: runs the dispatcher enqueued again because it presumed their message lost;
- ``floor_ms_per_commit`` and ``ratio_to_floor``: :mod:`bench.floor` on the same storage.

"Workers" is the number of pool processes: one ``celery worker`` with prefork concurrency 1 or
2 by default (``--worker-mode separate``: that many workers of concurrency 1).

``--full`` runs the sweep of docs/performance.md (N 200, 1000, 5000; 1 and 2 workers; both
storages; 8 workspaces; reflexr's default ordering); ``--all`` adds :mod:`bench.transactions`
and :mod:`bench.memory`.
"""

import argparse
import asyncio
import json
import pstats
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Literal

from artifactr import Workspace as ArtifactWorkspace
from artifactr.core import CreateThread, MessagePosted
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
    children,
    cpu_s,
    difference,
    emit,
    fresh_home,
    machine,
    memory_kib,
    note,
    percentile,
    postgres_backends,
    quiet_logging,
    read_counts,
    run_delay_s,
    storage_available,
    total,
)
from bench.workers import WorkerProcess, relayr_environment, start_worker
from relayr.batch import RunBatch
from relayr.demo import CLI_USER, DEPLOYS_PER_THREAD, RULE_AUTHOR_PREFIX
from relayr.dispatch import Dispatcher, DispatchPass, Enqueue
from relayr.runtime import Runtime
from relayr.settings import Settings
from tasks.runs import OUTCOMES, send_runs

type WorkerMode = Literal["prefork", "separate"]

PUBLISHER: Final = SourceActor(name="relayr-bench")

POLL_INTERVAL_S: Final = 1.0
"""How often the benchmark reads the notices. On SQLite a read takes the write lock, so polling
often slows what it measures; the figures come from the envelopes' ``ts``, not from polls."""

IDLE_QUIET_S: Final = 1.0
"""How long the workers' transaction counts must stay unchanged for them to count as idle."""

DISPATCH_INTERVAL_S: Final = 0.5
"""The dispatcher's pass interval, as in the demo and the tests (the default is 1 s)."""

_MESSAGE_OUTCOMES: Final = {message: outcome for outcome, (_, message) in OUTCOMES.items()}


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

    @property
    def rounds(self) -> tuple[int, ...]:
        return self.batches or (self.n,)

    @property
    def label(self) -> str:
        return (
            f"{self.storage}-n{self.n}-w{self.workers}{self.worker_mode[0]}-"
            f"ws{self.workspaces}-{self.ordering}"
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

    async def pass_once(self, enqueue: Enqueue) -> DispatchPass:
        done = await super().pass_once(enqueue)
        self.passes += 1
        self.copies += done.again
        return done


class NoticeWatch:
    """Reads the workspaces' logs incrementally, keeping each rule notice's commit ``ts``."""

    def __init__(self, handles: dict[str, ArtifactWorkspace]) -> None:
        self._handles = handles
        self._after = dict.fromkeys(handles, 0)
        self.seen: dict[str, datetime] = {}
        self.duplicates = 0

    async def read(self) -> None:
        for workspace, handle in self._handles.items():
            for envelope in await handle.read(after_seq=self._after[workspace]):
                self._after[workspace] = max(self._after[workspace], envelope.seq)
                posted = envelope.event
                if not isinstance(posted, MessagePosted) or posted.kind != "notice":
                    continue
                if not envelope.actor.participant.startswith(RULE_AUTHOR_PREFIX):
                    continue
                service = posted.content.split()[2]  # "deploy of <service> finished: ..."
                if service in self.seen:
                    self.duplicates += 1
                else:
                    self.seen[service] = envelope.ts

    async def until(self, services: set[str], timeout_s: float) -> bool:
        """Read until every service's notice is in; False if the time ran out first."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.read()
            if services <= self.seen.keys():
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(POLL_INTERVAL_S)


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

    async def enqueue(batch: RunBatch) -> None:
        send_runs(app, queue, batch)

    try:
        await dispatcher.serve(enqueue, stop)
    finally:
        app.close()


class Probe:
    """Reads what a round costs: transactions, passes, CPU, wall time."""

    def __init__(
        self,
        home: Path,
        workers: Sequence[WorkerProcess],
        counters: dict[str, EngineCounter],
        dispatcher: CountingDispatcher,
        database: str | None,
    ) -> None:
        self.home = home
        self.mains = [worker.process.pid for worker in workers]
        self.pool = [pid for main in self.mains for pid in children(main)]
        self.counters = counters
        self.dispatcher = dispatcher
        self.database = database

    async def backends(self) -> list[int]:
        return [] if self.database is None else await postgres_backends(self.database)

    async def read(self) -> dict[str, Any]:
        import os

        backends = await self.backends()
        return {
            "at": time.monotonic(),
            "workers": total(read_counts(self.home, self.pool)),
            "engines": {label: counter.snapshot() for label, counter in self.counters.items()},
            "passes": self.dispatcher.passes,
            "copies": self.dispatcher.copies,
            "cpu": {
                "worker_main": sum(cpu_s(pid) for pid in self.mains),
                "pool": sum(cpu_s(pid) for pid in self.pool),
                "bench": cpu_s(os.getpid()),
            },
            "backends": {pid: cpu_s(pid) for pid in backends},
            "run_queue": {
                "worker_main": sum(run_delay_s(pid) for pid in self.mains),
                "pool": sum(run_delay_s(pid) for pid in self.pool),
                "bench": run_delay_s(os.getpid()),
            },
        }

    async def idle(self, timeout_s: float = 60.0) -> None:
        """Wait until every pool process wrote its counts and they stopped changing."""
        deadline = time.monotonic() + timeout_s
        last: dict[int, dict[str, int]] | None = None
        since = time.monotonic()
        while time.monotonic() < deadline:
            counts = read_counts(self.home, self.pool)
            if len(counts) < len(self.pool) or counts != last:
                last, since = counts, time.monotonic()
            elif time.monotonic() - since >= IDLE_QUIET_S:
                return
            await asyncio.sleep(0.2)
        note(f"workers did not settle within {timeout_s} s; counts may include stragglers")


def _per(value: float, count: int, digits: int = 2) -> float | None:
    return None if count <= 0 else round(value / count, digits)


def round_figures(
    n: int,
    published: dict[str, datetime],
    watch: NoticeWatch,
    before: dict[str, Any],
    after: dict[str, Any],
    probe: Probe,
    publish_s: float,
) -> dict[str, Any]:
    """The figures of one round, from its publish stamps, its notices and two probe reads.

    Per-run figures of the workers are over the runs whose notices are in (all of them, unless
    the round timed out); the publish's and the dispatcher's over every event published.
    """
    latencies = [
        (watch.seen[service] - stamp).total_seconds() * 1000
        for service, stamp in published.items()
        if service in watch.seen
    ]
    notices = [watch.seen[service] for service in published if service in watch.seen]
    elapsed_s = (max(notices) - min(published.values())).total_seconds() if notices else None
    workers = difference(after["workers"], before["workers"])
    engines = {
        label: difference(after["engines"][label], before["engines"][label])
        for label in after["engines"]
    }
    passes = after["passes"] - before["passes"]
    backends_cpu = sum(
        cpu - before["backends"].get(pid, 0.0) for pid, cpu in after["backends"].items()
    )
    cpu = {name: after["cpu"][name] - before["cpu"][name] for name in after["cpu"]}
    if probe.database is not None:
        cpu["postgres"] = backends_cpu
    waited = {
        name: after["run_queue"][name] - before["run_queue"][name] for name in after["run_queue"]
    }
    complete = len(notices)
    return {
        "notices": complete,
        "copies": after["copies"] - before["copies"],
        "complete": complete == n,
        "elapsed_s": None if elapsed_s is None else round(elapsed_s, 3),
        "runs_per_s": round(complete / elapsed_s, 2) if elapsed_s else None,
        "ms_per_run": round(elapsed_s * 1000 / complete, 2) if elapsed_s and complete else None,
        "publish_ms_per_event": round(publish_s * 1000 / n, 2),
        "latency_ms": {
            name: None if value is None else round(value, 1)
            for name, value in (
                ("p50", percentile(latencies, 50)),
                ("p95", percentile(latencies, 95)),
                ("p99", percentile(latencies, 99)),
                ("max", percentile(latencies, 100)),
            )
        },
        "transactions": {
            "worker_per_run": _per(workers["begin"], complete),
            "publish_per_run": _per(engines["publish"]["begin"], n),
            "notice_run_with_publish": _per(
                workers["begin"] * n / max(complete, 1) + engines["publish"]["begin"], n
            ),
            "dispatch_per_run": _per(engines["dispatch"]["begin"], n),
            "dispatch_per_pass": _per(engines["dispatch"]["begin"], passes),
            "dispatch_passes": passes,
            "bench_poll_per_run": _per(engines["watch"]["begin"], n),
            "worker": workers,
            "publish": engines["publish"],
            "dispatch": engines["dispatch"],
        },
        "cpu_ms_per_run": {name: _per(seconds * 1000, complete) for name, seconds in cpu.items()},
        "run_queue_ms_per_run": {
            name: _per(seconds * 1000, complete) for name, seconds in waited.items()
        },
        "wall_s": round(after["at"] - before["at"], 2),
        "rss_kib": {str(pid): memory_kib(pid) for pid in probe.pool},
    }


async def drive(
    case: Case, settings: Settings, storage: CaseStorage, workers: Sequence[WorkerProcess]
) -> list[dict[str, Any]]:
    """Publish each round, dispatch in this process, and measure until its notices are in."""
    runtimes: dict[str, Runtime] = {}
    counters: dict[str, EngineCounter] = {}
    for label, role in (("publish", "cli"), ("dispatch", "dispatcher"), ("watch", "cli")):
        application = await build_example(settings, case.ordering)
        runtimes[label] = await Runtime.start(settings, role=role, application=application)
        counters[label] = EngineCounter(application.engines[0])
    stop = asyncio.Event()
    dispatcher = CountingDispatcher(runtimes["dispatch"])
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
            figures = round_figures(count, published, watch, before, after, probe, publish_s)
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


def count_outcomes(workers: Sequence[WorkerProcess]) -> dict[str, int]:
    """What the run tasks did, from the workers' JSON logs."""
    outcomes: Counter[str] = Counter()
    for worker in workers:
        for line in worker.log().splitlines():
            if not line.startswith("{"):
                continue
            try:
                message = json.loads(line).get("event")
            except ValueError:
                continue
            if message in _MESSAGE_OUTCOMES:
                outcomes[_MESSAGE_OUTCOMES[message]] += 1
    return dict(sorted(outcomes.items()))


def profile_summary(home: Path, runs: int, top: int = 25) -> dict[str, Any]:
    """The pool processes' profiles merged: the functions that took the most time per run."""
    paths = sorted(home.glob("profile-*.prof"))
    if not paths:
        return {}
    stats = pstats.Stats(*(str(path) for path in paths))
    text = home / "profile.txt"
    with text.open("w") as out:
        for order in ("tottime", "cumulative"):
            stats.stream = out  # type: ignore[attr-defined]
            stats.sort_stats(order).print_stats(60)
    rows = stats.stats  # type: ignore[attr-defined]

    def name(key: tuple[str, int, str]) -> str:
        filename, line, function = key
        short = filename.split("site-packages/")[-1].replace(str(home.parents[2]) + "/", "")
        return f"{short}:{line}({function})"

    def listing(index: int) -> list[dict[str, Any]]:
        ordered = sorted(rows.items(), key=lambda item: item[1][index], reverse=True)[:top]
        return [
            {
                "function": name(key),
                "calls_per_run": round(value[1] / runs, 2),
                "tottime_ms_per_run": round(value[2] * 1000 / runs, 3),
                "cumtime_ms_per_run": round(value[3] * 1000 / runs, 3),
            }
            for key, value in ordered
        ]

    return {"text": str(text), "by_tottime": listing(2), "by_cumtime": listing(3)}


def run_case(case: Case, *, keep: bool = False) -> list[dict[str, Any]]:
    """Run one case on a storage of its own, with fresh workers; one figures dict per round."""
    home = fresh_home(case.label)
    if case.profile:
        (home / PROFILE_MARKER).touch()
    note(f"{case.label}: home {home}")
    results: list[dict[str, Any]] = []
    workers: list[WorkerProcess] = []
    try:
        with case_storage(case.storage) as storage:
            environment = relayr_environment(
                home,
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


def full_sweep(args: argparse.Namespace) -> list[Case]:
    """docs/performance.md's sweep."""
    cases = [
        Case(storage=storage, n=n, workers=workers)
        for storage in args.storage
        for n in (200, 1000, 5000)
        for workers in (1, 2)
    ]
    cases += [
        Case(storage=storage, n=1000, workers=workers, workspaces=8)
        for storage in args.storage
        for workers in (1, 2)
    ]
    cases += [Case(storage=storage, n=1000, ordering="scope") for storage in args.storage]
    return cases


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.end_to_end",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--n", type=int, nargs="+", default=[1000], help="events per case")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="pool processes")
    parser.add_argument(
        "--storage", nargs="+", choices=sorted(STORAGES), default=["sqlite", "postgres"]
    )
    parser.add_argument("--workspaces", type=int, nargs="+", default=[1])
    parser.add_argument("--ordering", choices=sorted(APPS), default="none")
    parser.add_argument("--worker-mode", choices=["prefork", "separate"], default="prefork")
    parser.add_argument("--rate", type=float, default=None, help="events/s (default: a burst)")
    parser.add_argument("--dispatch-interval-s", type=float, default=DISPATCH_INTERVAL_S)
    parser.add_argument("--profile", action="store_true", help="cProfile the pool processes")
    parser.add_argument("--no-floor", action="store_true", help="skip bench.floor")
    parser.add_argument("--keep", action="store_true", help="keep each case's home")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="stop waiting for a round's notices after this long (default 300 s + 2 s per event);"
        " the figures then cover the notices in by then, with complete=false",
    )
    parser.add_argument("--full", action="store_true", help="docs/performance.md's sweep")
    parser.add_argument("--all", action="store_true", help="--full, transactions and memory")
    args = parser.parse_args(argv)
    from bench import floor

    quiet_logging()
    storages = [kind for kind in args.storage if storage_available(kind)]
    for kind in set(args.storage) - set(storages):
        emit({"bench": "end_to_end", "storage": kind, "skipped": "PostgreSQL or Redis is down"})
    args.storage = storages
    emit({"bench": "machine", **machine()})
    if args.full or args.all:
        cases = full_sweep(args)
    else:
        cases = [
            Case(
                storage=storage,
                n=n,
                workers=workers,
                worker_mode=args.worker_mode,
                workspaces=workspaces,
                ordering=args.ordering,
                rate=args.rate,
                dispatch_interval_s=args.dispatch_interval_s,
                profile=args.profile,
                timeout_s=args.timeout_s,
            )
            for storage in storages
            for n in args.n
            for workspaces in args.workspaces
            for workers in args.workers
        ]
    floors: dict[tuple[str, int], float] = {}
    if not args.no_floor:
        for storage, n in sorted({(case.storage, case.n) for case in cases}):
            figures = floor.measure(storage, n)
            emit(figures)
            floors[(storage, n)] = figures["ms_per_commit"]
    for case in cases:
        for figures in run_case(case, keep=args.keep):
            base = floors.get((case.storage, case.n))
            if base is not None and figures.get("ms_per_run"):
                figures["floor_ms_per_commit"] = base
                figures["ratio_to_floor"] = round(figures["ms_per_run"] / base, 2)
            emit({"bench": "end_to_end", **figures})
    if args.all:
        from bench import memory, transactions

        for storage in storages:
            transactions.main(["--storage", storage])
            memory.main(["--storage", storage])


if __name__ == "__main__":
    main()
